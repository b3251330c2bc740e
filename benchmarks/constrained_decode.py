"""Single-stream decode speed with and without grammar constraints (issue 15: target >= 90%).

One job at a time in the dynamic generator (the engine behind `exlpy serve`), the same prompt and the same
number of new tokens for each variant, decode speed = (new tokens - 1) / time from the first token to the
last. Variants:
- `free`: no constraint (greedy and sampled both sample on the device, in the overlapped loop).
- `json`: a JSON schema (an array of N small objects, so the output is long) enforced by
  `ExLlamaV2GrammarFilter`: the forward pass of step t+1 is launched on token t still on the device, then the
  host reads token t, llguidance computes the next bitmask in a worker thread while the GPU runs that forward
  pass, and one kernel masks the logits on the GPU before the device sampler.
- `regex`: a regex of comma-separated words, same machinery.
Each is run greedy and sampled (temperature 0.8, top-p 0.9). The host-side cost of one mask computation is
measured on its own too, to show what the overlap hides.

    python -m benchmarks.constrained_decode [--model DIR] [--tokens 512] [--quick] [--out FILE]

Default model: ../shared/models/smollm2-135m-exl2-4.0 (a small model is the hard case: its step is short, so
mask time has the least room to hide). Needs `pip install -e '.[grammar]'`; a CUDA GPU for meaningful numbers
(it runs on the CPU too).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT.parent / "shared" / "models" / "smollm2-135m-exl2-4.0"
PROMPT = "<|im_start|>user\nList many people with their names, ages and cities as JSON.<|im_end|>\n" \
         "<|im_start|>assistant\n"


def json_schema(n: int) -> dict[str, Any]:
    item = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                             "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                             "city": {"type": "string", "maxLength": 24}},
            "required": ["name", "age", "city"], "additionalProperties": False}
    return {"type": "array", "items": item, "minItems": n, "maxItems": n}


def load(model_dir: str) -> Any:
    from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Tokenizer
    from exlpy.generator import ExLlamaV2DynamicGenerator

    cfg = ExLlamaV2Config(model_dir)
    cfg.max_seq_len = min(cfg.max_seq_len, 4096)
    model = ExLlamaV2(cfg)
    cache = ExLlamaV2Cache(model, max_seq_len=4096, lazy=True)
    model.load_autosplit(cache)
    gen = ExLlamaV2DynamicGenerator(model, cache, ExLlamaV2Tokenizer(cfg))
    gen.warmup()
    return gen


def make_filter(gen: Any, kind: str, tokens: int) -> list[Any]:
    from exlpy.generator.filters import ExLlamaV2GrammarFilter

    if kind == "free":
        return []
    if kind == "json":
        return [ExLlamaV2GrammarFilter.json_schema(gen.model, gen.tokenizer, json_schema(max(4, tokens // 8)))]
    return [ExLlamaV2GrammarFilter.regex(gen.model, gen.tokenizer, r"[a-z]{1,12}(, [a-z]{1,12}){" +
                                         str(tokens) + r",}")]


def one_run(gen: Any, kind: str, tokens: int, sampled: bool, seed: int) -> float:
    from exlpy.generator import ExLlamaV2DynamicJob, ExLlamaV2Sampler

    settings = ExLlamaV2Sampler.Settings(temperature=0.8, top_p=0.9, top_k=0, token_repetition_penalty=1.0) \
        if sampled else ExLlamaV2Sampler.Settings.greedy()
    ids = gen.tokenizer.encode(PROMPT, encode_special_tokens=True)
    job = ExLlamaV2DynamicJob(ids, tokens, gen_settings=settings, stop_conditions=[], seed=seed,
                              filters=make_filter(gen, kind, tokens))
    gen.enqueue(job)
    first = last = None
    n = 0
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            if r["stage"] == "streaming":
                if "error" in r:
                    raise r["error"]
                if first is None:
                    first = time.perf_counter()
                n = r.get("new_tokens", n)
                if r["eos"]:
                    last = time.perf_counter()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    assert first is not None and last is not None
    if n < tokens * 0.9:
        raise RuntimeError(f"{kind}: only {n} of {tokens} tokens were generated (the grammar ended early)")
    return (n - 1) / (last - first)


def mask_cost_us(gen: Any, kind: str, tokens: int) -> float:
    """Average host time of one prepare_logit_mask() along a real constrained generation (no overlap)."""
    from exlpy.generator import ExLlamaV2Sampler

    f = make_filter(gen, kind, tokens)[0]
    g = f.clone()
    text = gen.generate(PROMPT, min(tokens, 200), gen_settings=ExLlamaV2Sampler.Settings.greedy(),
                        encode_special_tokens=True, completion_only=True, filters=[f], stop_conditions=[])
    ids = gen.tokenizer.encode(text)[0].tolist()
    g.begin("")
    times = []
    for t in ids:
        t0 = time.perf_counter()
        g.prepare_logit_mask()
        times.append(time.perf_counter() - t0)
        try:
            g.feed(t)
        except Exception:  # re-tokenized text may take another path through the grammar: stop measuring there
            break
    return statistics.median(times) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="128 tokens, 1 repeat")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "constrained_decode.md"))
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.repeats = 128, 1
    gen = load(args.model)
    for kind in ("free", "json", "regex"):  # warm up every path (kernels, graphs, grammar compilation)
        one_run(gen, kind, 32, False, 0)
    rows, speeds = [], {}
    for sampled in (False, True):
        for kind in ("free", "json", "regex"):
            runs = [one_run(gen, kind, args.tokens, sampled, seed) for seed in range(args.repeats)]
            speeds[(kind, sampled)] = statistics.median(runs)
    for sampled in (False, True):
        base = speeds[("free", sampled)]
        for kind in ("free", "json", "regex"):
            v = speeds[(kind, sampled)]
            rows.append(f"| {'sampled' if sampled else 'greedy'} | {kind} | {v:.1f} | {100 * v / base:.1f}% |")
    masks = {k: mask_cost_us(gen, k, args.tokens) for k in ("json", "regex")}
    worst = min(speeds[(k, s)] / speeds[("free", s)] for k in ("json", "regex") for s in (False, True))
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.machine()})"
    cmd = "python -m benchmarks.constrained_decode " + " ".join(sys.argv[1:])
    report = "\n".join([
        "# Single-stream decode with and without grammar constraints", "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- device: {device}, torch {torch.__version__}", f"- model: `{args.model}`", f"- command: `{cmd}`",
        f"- {args.tokens} new tokens per run, median of {args.repeats} runs; limit measured in the same run: the "
        "unconstrained speed (`free`)", "",
        "| decoding | constraint | tokens/s | of unconstrained |", "|---|---|---|---|", *rows, "",
        f"Host time of one mask computation (median, not overlapped): json {masks['json']:.0f} us, "
        f"regex {masks['regex']:.0f} us; one unconstrained greedy step: "
        f"{1e6 / speeds[('free', False)]:.0f} us.", "",
        f"Worst constrained / unconstrained ratio: {100 * worst:.1f}% (target >= 90%): "
        f"{'PASS' if worst >= 0.9 else 'FAIL'}.", ""])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
