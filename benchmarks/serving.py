"""Serving speed on one GPU, in one run: raw decode vs the dynamic generator, and `exlpy serve` under load.

    PYTHONPATH=. python benchmarks/serving.py --out benchmarks/results/serving.md      # 8B fp16 + 8B EXL2 4.0
    PYTHONPATH=. python benchmarks/serving.py --quick --out /tmp/serving_quick.md      # small shape, ~2 minutes

Part `gen` (per model): the raw decode speed (what `exlpy bench` times: model.forward on a contiguous cache,
CUDA graphs, argmax on the GPU) and the dynamic generator's at batch 1, 8, 32, 64 with 512-token random prompts
and 256 new tokens, greedy and with top-p sampling. The generator's speed is its steady decode rate: tokens
received after every job had its first token, over the time since. Targets: >= 97% of raw at batch 1, >= 90%
at 32 and 64.

Part `server` (benchmarks/serving_client.py): `exlpy serve` in a subprocess, driven by the official `openai`
AsyncOpenAI client with streaming: one stream (target >= 95% of the generator's batch-1 greedy speed), 64
concurrent streams with random prompt lengths 100-2,000 and max_tokens 256 (all must complete; total tokens/s,
TTFT and inter-token latency median / p99), and 32 streams with and without a 16k-token prompt arriving while
they decode (target: their inter-token p99 stays under 3x its value without it).

Part `load` (benchmarks/serving_load.py): `exlpy serve` with its default cache (sized from free GPU memory)
and the generator driven directly, on the same load in one run: 64 streams, prompts of 100-2,000 tokens,
max_tokens 256 (total tok/s of each, TTFT median / p99, inter-token median / p99, Triton compiles while serving),
then 128 streams of the same shape on fresh prompts (all must complete: none refused while the cache has room),
then 32 decoding streams alone, with a 16k-token prompt arriving, and alone again (the baseline moves between
runs: inter-token p99 and median of each; the target, p99 <= 3x, judged against both runs alone pooled). Prompt
chunks next to the streams run as CUDA graphs; `EXLPY_PREFILL_GRAPHS=0` (inherited by the server) runs them eagerly.
About 6 minutes for 8B fp16 on an H100 (model written once, server start with its warm-up, generator load):

    PYTHONPATH=. python benchmarks/serving.py --models 8b --parts load --out /tmp/serving_load.md

Models are random-weight Llama-3-8B shapes written by benchmarks/make_models.py (plus a synthetic tokenizer)
into --work, once. Results: a markdown file with device, date and command.
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

MODELS = {"8b": ("llama3-8b", 0), "exl2": ("llama3-8b", 4), "small": ("smollm2-135m", 0), "1b": ("llama3.2-1b", 0)}
GREEDY, TOP_P = "greedy", "top-p 0.9"


def model_dir(work: str, key: str) -> str:
    shape, bits = MODELS[key]
    fmt = f"exl2-{bits}" if bits else "fp16"
    d = write_model(os.path.join(work, f"{shape}-{fmt}"), shape, exl2_bits=bits)
    if not os.path.exists(os.path.join(d, "tokenizer.json")):
        write_word_tokenizer(Path(d), SHAPES[shape]["vocab_size"])
    return d


def settings_for(kind: str) -> Any:
    from exlpy.generator import ExLlamaV2Sampler

    if kind == GREEDY:
        return ExLlamaV2Sampler.Settings.greedy()
    return ExLlamaV2Sampler.Settings(temperature=1.0, top_k=0, top_p=0.9, token_repetition_penalty=1.0)


def time_generator(model: Any, tok: Any, batch: int, prompt_len: int, new_tokens: int, kind: str) -> dict[str, float]:
    """Steady decode tokens/s of the dynamic generator with `batch` concurrent jobs (graphs warmed first)."""
    from exlpy import ExLlamaV2Cache
    from exlpy.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob

    pages = -(-(prompt_len + new_tokens) // 256)
    cache = ExLlamaV2Cache(model, max_seq_len=batch * pages * 256)
    gen = ExLlamaV2DynamicGenerator(model, cache, tok, max_batch_size=batch)
    vocab = model.config.vocab_size
    rng = torch.Generator().manual_seed(batch)
    settings = settings_for(kind)

    def jobs(n_new: int) -> list[Any]:
        return [ExLlamaV2DynamicJob(torch.randint(3, vocab, (1, prompt_len), generator=rng), n_new,
                                    gen_settings=settings, stop_conditions=[], seed=k) for k in range(batch)]

    for warm in (jobs(8), jobs(new_tokens)):  # the first run captures the graphs of this batch size
        gen.enqueue(warm)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        first: dict[Any, float] = {}
        t_all = None
        after = 0
        while gen.num_remaining_jobs():
            for r in gen.iterate():
                if r["stage"] != "streaming":
                    continue
                n = r["token_ids"].shape[1]
                if r["job"] not in first:
                    first[r["job"]] = time.perf_counter()
                    n -= 1
                    if len(first) == batch:
                        t_all = time.perf_counter()
                        continue
                if t_all is not None:
                    after += n
        t_end = time.perf_counter()
    assert t_all is not None
    out = {"tok_s": after / (t_end - t_all), "ttft_max_s": max(first.values()) - t0,
           "tokens": float(batch * new_tokens)}
    del gen, cache
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def part_gen(key: str, work: str, batches: list[int], prompt_len: int, new_tokens: int) -> tuple[list[str], dict]:
    from exlpy import ExLlamaV2Tokenizer
    from exlpy.cli.bench import load_model, time_decode

    path = model_dir(work, key)
    model = load_model(path, prompt_len + new_tokens + 16, max(batches))
    tok = ExLlamaV2Tokenizer(model.config)
    lines = [f"### {key}: `{path}`", "",
             f"{prompt_len}-token random prompts, {new_tokens} new tokens per sequence. Raw = model.forward on a "
             "contiguous cache with CUDA graphs and argmax on the GPU (exlpy bench); generator = "
             "ExLlamaV2DynamicGenerator, steady decode rate after every job's first token.", "",
             "| batch | raw tok/s | generator greedy | % of raw | generator top-p 0.9 | % of raw | target |",
             "|---|---|---|---|---|---|---|"]
    speeds: dict[tuple[int, str], float] = {}
    for b in batches:
        raw = time_decode(model, b, prompt_len, new_tokens).tokens_per_s
        g = {kind: time_generator(model, tok, b, prompt_len, new_tokens, kind)["tok_s"] for kind in (GREEDY, TOP_P)}
        speeds[(b, GREEDY)], speeds[(b, TOP_P)] = g[GREEDY], g[TOP_P]
        target = 0.97 if b == 1 else 0.90 if b >= 32 else None
        ok = "" if target is None else ("met" if min(g.values()) >= target * raw else "**missed**")
        lines.append(f"| {b} | {raw:,.1f} | {g[GREEDY]:,.1f} | {g[GREEDY] / raw:.1%} | {g[TOP_P]:,.1f} | "
                     f"{g[TOP_P] / raw:.1%} | {'' if target is None else f'>= {target:.0%}: {ok}'} |")
        print(lines[-1], flush=True)
    model.unload()
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return lines + [""], speeds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="markdown results file")
    ap.add_argument("--models", default="8b,exl2", help="comma list of: 8b (fp16), exl2 (4.0 bpw), small")
    ap.add_argument("--parts", default="gen,server", help="comma list of: gen, server, load")
    ap.add_argument("--work", default="/tmp/exlpy_bench", help="where the random-weight models are written")
    ap.add_argument("--quick", action="store_true", help="small model, batches 1 and 8, shorter server runs")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--server-args", default="", help="part load: more `exlpy serve` arguments, e.g. "
                    "\"--max-prefill-per-step 512\"")
    ap.add_argument("--append", action="store_true", help="add to --out instead of replacing it (runs split "
                    "over several calls, e.g. one model each)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/serving.py needs a CUDA device")
    models = ["small"] if args.quick else args.models.split(",")
    parts = args.parts.split(",")
    batches = [1, 8] if args.quick else [1, 8, 32, 64]
    new_tokens = 64 if args.quick else 256
    header = ["# Serving: dynamic generator and `exlpy serve` vs raw decode", "",
              f"- device: {torch.cuda.get_device_name()}; torch {torch.__version__}",
              f"- date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
              f"- command: `python {' '.join(sys.argv)}`", ""]
    body: list[str] = []
    if args.append and Path(args.out).exists():
        header = [Path(args.out).read_text().rstrip(), "", f"### Appended: `python {' '.join(sys.argv)}` "
                  f"({datetime.now(timezone.utc).strftime('%H:%M UTC')})", ""]
    for key in models:
        gen_speed: float | None = None
        if "gen" in parts:
            lines, speeds = part_gen(key, args.work, batches, 512, new_tokens)
            body += ["## Generator vs raw decode", ""] + lines
            gen_speed = speeds[(1, GREEDY)]
            Path(args.out).write_text("\n".join(header + body) + "\n")
        if "load" in parts:
            from benchmarks.serving_load import Load, part_load

            load = Load(16, (100, 500), 64) if args.quick else Load(64, (100, 2000), 256)
            body += part_load(model_dir(args.work, key), key, args.port + 1, load, 4096 if args.quick else 20480,
                              8 if args.quick else 32, 2048 if args.quick else 16384,
                              server_args=args.server_args.split(), crowd=32 if args.quick else 128)
            Path(args.out).write_text("\n".join(header + body) + "\n")
        if "server" in parts:
            from benchmarks.serving_client import part_server

            body += part_server(model_dir(args.work, key), key, args.port, gen_speed, args.quick)
            Path(args.out).write_text("\n".join(header + body) + "\n")
    text = "\n".join(header + body) + "\n"
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
