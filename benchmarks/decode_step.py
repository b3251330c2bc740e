"""Decode speed with sampling, grammar masks and speculation against greedy, old sampler path vs captured one.

    PYTHONPATH=. python benchmarks/decode_step.py --out benchmarks/results/decode_step.md      (GPU, ~4 min)
    PYTHONPATH=. python benchmarks/decode_step.py --tiny --out /tmp/decode_step_tiny.md      (CPU, end to end)

The dynamic generator on a random-weight Llama-3-8B-shape fp16 model (benchmarks/make_models.py, synthetic
tokenizer; written once into --work), steady tokens/s after every job's first token, for: greedy, exllamav2's
default `Settings()`, top-k 40 + top-p 0.9 + min-p 0.05 + repetition penalty 1.1, top-p 0.9 over the whole
vocabulary (top_k 0: what the OpenAI server sends), at batch 1 and 64, each with
the old sampler path (`graph_sampling = False`: sample_rows / the host chain for penalties) and the captured
sampler (exlpy/generator/sampling/graphed.py); JSON-schema constrained decoding (llguidance) at batch 1 and 16
against the same jobs unconstrained; with `--exl2` the EXL2 4.0 bpw 8B at batch 1 (writing its weights the first
time adds minutes). Then the speculative replay draft at acceptance 0.8 vs plain at batch 1 (benchmarks/
speculative.py's part `replay`, a 1B-shape draft; verification through the captured sampler; `--no-spec` skips
it; `--spec-only` runs it alone; `--spec-ahead both` times it with and without rounds launched ahead of the
previous round's bookkeeping), with the mean round's time by phase (exlpy/generator/speculative/profile.py).
Results: a markdown table with device, date and command.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.dynamic_generator import write_word_tokenizer  # noqa: E402
from benchmarks.make_models import SHAPES, write_model  # noqa: E402
from benchmarks.speculative import drive  # noqa: E402

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=1024, tie_word_embeddings=False, rope_theta=10000.0)


def settings(kind: str) -> Any:
    from exlpy.generator import ExLlamaV2Sampler

    S = ExLlamaV2Sampler.Settings
    if kind == "greedy":
        return S.greedy()
    if kind == "default Settings()":
        return S()
    if kind == "top-p 0.9, top_k 0 (server)":
        return S(temperature=1.0, top_k=0, top_p=0.9, token_repetition_penalty=1.0)
    return S(temperature=0.9, top_k=40, top_p=0.9, min_p=0.05, token_repetition_penalty=1.1)


KINDS = ("greedy", "default Settings()", "top-k+top-p+min-p+rep", "top-p 0.9, top_k 0 (server)")


def load(work: str, tiny: bool, exl2: bool, max_batch: int, max_len: int) -> tuple[Any, Any]:
    from exlpy import ExLlamaV2, ExLlamaV2Config, ExLlamaV2Tokenizer

    if tiny:
        SHAPES.setdefault("tiny-decode-step", TINY)
        d = write_model(os.path.join(work, "tiny-decode-step"), "tiny-decode-step")
        vocab = TINY["vocab_size"]
    else:
        bits = 4 if exl2 else 0
        d = write_model(os.path.join(work, "llama3-8b-" + (f"exl2-{bits}" if bits else "fp16")), "llama3-8b",
                        exl2_bits=bits)
        vocab = SHAPES["llama3-8b"]["vocab_size"]
    if not os.path.exists(os.path.join(d, "tokenizer.json")):
        write_word_tokenizer(Path(d), vocab)
    if torch.cuda.is_available():  # every module on GPU 0, as the other decode benchmarks
        from exlpy.cli.bench import load_model

        model = load_model(d, max_len, max_batch)
    else:
        cfg = ExLlamaV2Config(d)
        cfg.max_seq_len = max_len
        cfg.max_batch_size = max_batch
        model = ExLlamaV2(cfg)
        model.load()
    return model, ExLlamaV2Tokenizer(model.config)


def run(model: Any, tok: Any, batch: int, kind: str, graph: bool, prompt_len: int, new: int,
        filters: Any = None) -> float:
    """Steady tok/s of `batch` jobs (a short run first captures the graphs of this shape)."""
    from exlpy import ExLlamaV2Cache
    from exlpy.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob

    pages = -(-(prompt_len + new + 8) // 256)
    cache = ExLlamaV2Cache(model, max_seq_len=batch * pages * 256)
    gen = ExLlamaV2DynamicGenerator(model, cache, tok, max_batch_size=batch)
    gen.graph_sampling = graph
    rng = torch.Generator().manual_seed(batch)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (1, prompt_len), generator=rng) for _ in range(batch)]
    speed = 0.0
    for n in (8, new):
        jobs = [ExLlamaV2DynamicJob(p, n, gen_settings=settings(kind), stop_conditions=[], seed=None,
                                    filters=filters(gen) if filters else None) for p in prompts]
        gen.enqueue(jobs)
        speed, _ = drive(gen, jobs)
    del gen, cache
    return speed


def json_filters(gen: Any) -> list[Any]:
    from benchmarks.constrained_decode import json_schema
    from exlpy.generator.filters import ExLlamaV2GrammarFilter

    return [ExLlamaV2GrammarFilter.json_schema(gen.model, gen.tokenizer, json_schema(64))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a tiny random model on whatever device (CPU check)")
    ap.add_argument("--exl2", action="store_true", help="also the EXL2 4.0 bpw 8B at batch 1")
    ap.add_argument("--no-spec", action="store_true", help="skip speculative replay draft a=0.8 vs plain")
    ap.add_argument("--spec-only", action="store_true", help="only the speculative replay draft (with its per-round "
                    "time breakdown)")
    ap.add_argument("--spec-ahead", choices=("on", "off", "both"), default="on",
                    help="speculative rounds launched ahead of the previous round's bookkeeping (on; the generator's "
                    "default is off), not (off), or both timed one after the other on the same loaded models")
    ap.add_argument("--work", default="/tmp/exlpy_bench_models")
    ap.add_argument("--new-tokens", type=int, default=0, help="tokens per timed job (default 128; tiny 12)")
    ap.add_argument("--out", default="benchmarks/results/decode_step.md")
    args = ap.parse_args()
    new = args.new_tokens or (12 if args.tiny else 128)
    prompt_len = 32 if args.tiny else 256
    batches = (1, 4) if args.tiny else (1, 64)
    json_batches = (1, 2) if args.tiny else (1, 16)
    max_b = max(batches)
    model, tok = (None, None) if args.spec_only else load(args.work, args.tiny, False, max_b, prompt_len + new + 256)
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    lines = [f"# Decode step: sampling, masks and speculation vs greedy ({'tiny model' if args.tiny else '8B fp16'})",
             "", f"- device: {dev}", f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}",
             f"- command: `PYTHONPATH=. python {' '.join(sys.argv)}`", f"- torch {torch.__version__}", "",
             f"{prompt_len}-token prompts, {new} new tokens per job, steady tok/s (all jobs). old = "
             "`graph_sampling=False` (sample_rows; penalties on the host chain), captured = the captured sampler. "
             "% = of greedy with the captured sampler at the same batch.", "",
             "| batch | settings | old tok/s | captured tok/s | captured % of greedy |", "|---|---|---|---|---|"]

    def emit() -> None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")

    t0 = time.time()
    for b in () if args.spec_only else batches:
        greedy = None
        for kind in KINDS:
            old = run(model, tok, b, kind, False, prompt_len, new)
            cap = run(model, tok, b, kind, True, prompt_len, new)
            greedy = cap if kind == "greedy" else greedy
            lines.append(f"| {b} | {kind} | {old:,.1f} | {cap:,.1f} | {100 * cap / greedy:.1f}% |")
            print(lines[-1], f"({time.time() - t0:.0f}s)", flush=True)
            emit()
    lines += ["", "JSON-schema constrained (llguidance, an array of 64 objects) vs the same jobs unconstrained, "
              "greedy, captured sampler:", "", "| batch | unconstrained tok/s | constrained tok/s | % |",
              "|---|---|---|---|"]
    for b in () if args.spec_only else json_batches:
        try:
            free = run(model, tok, b, "greedy", True, prompt_len, new)
            con = run(model, tok, b, "greedy", True, prompt_len, new, json_filters)
            lines.append(f"| {b} | {free:,.1f} | {con:,.1f} | {100 * con / free:.1f}% |")
        except Exception as e:  # llguidance missing or the synthetic tokenizer refused: say so in the table
            lines.append(f"| {b} | - | - | skipped: {type(e).__name__}: {e} |")
        print(lines[-1], f"({time.time() - t0:.0f}s)", flush=True)
        emit()
    if args.exl2 and not args.tiny:
        del model
        gc.collect()
        torch.cuda.empty_cache()
        model, tok = load(args.work, False, True, 1, prompt_len + new + 256)
        lines += ["", "EXL2 4.0 bpw 8B, batch 1:", "", "| settings | old tok/s | captured tok/s | % of greedy |",
                  "|---|---|---|---|"]
        greedy = None
        for kind in KINDS:
            old = run(model, tok, 1, kind, False, prompt_len, new)
            cap = run(model, tok, 1, kind, True, prompt_len, new)
            greedy = cap if kind == "greedy" else greedy
            lines.append(f"| {kind} | {old:,.1f} | {cap:,.1f} | {100 * cap / greedy:.1f}% |")
            print(lines[-1], flush=True)
            emit()
    if not args.no_spec and not args.tiny:
        from benchmarks.speculative import part_replay

        del model
        gc.collect()
        torch.cuda.empty_cache()
        modes = {"on": (True,), "off": (False,), "both": (False, True)}[args.spec_ahead]
        lines += [""] + part_replay(args.work, [1], [0.8], new, ahead=modes)
        emit()
    lines += ["", f"Total wall time {time.time() - t0:.0f} s."]
    emit()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
