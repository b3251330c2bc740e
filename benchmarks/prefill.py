"""Long-context prefill and quantized-cache decode, Llama-3-8B shape fp16 (random weights), next to HF transformers.

python benchmarks/prefill.py [--quick] [--work DIR] [--lengths 2048,8192,32768,65536] [--chunk 2048] [--out FILE]
Prefill of N tokens (only the last position's logits), best of a few runs, tokens/s and peak GPU memory:
- exlpy without the flash kernel (EXLPY_FLASH_ATTN=0, the path before it): later chunks gather K/V and run
  torch SDPA with a [T, L] mask, chunks of max_input_len shrinking with max_attention_size; up to 32k only
  (at 64k its chunks shrink to ~60 tokens);
- exlpy, one forward: the whole prompt as one chunk into an empty contiguous cache (the first chunk of a
  contiguous cache runs torch's causal SDPA over the slice it just wrote);
- exlpy, contiguous chunks: chunks of --chunk tokens, later chunks through the flash kernel over the cache
  (max_attention_size no longer limits them: the kernel builds no [T, L] scores);
- exlpy flash, paged chunks: the dynamic generator's way: chunks of --chunk tokens through
  `model.forward_batch` into 256-token pages in random order;
- HF transformers (SDPA), one forward into an empty DynamicCache, in a subprocess (benchmarks/hf_prefill.py).
Decode at --decode-context tokens of context (default 32k), batch 1: one step captured in a CUDA graph per
cache type (fp16, Q4, Q6, Q8, FP8; quantized caches read at their own width), so all caches run the same
way; plus the fp16 cache through model.forward's own graphs for reference.
Writes a markdown table (device, date, command) to --out.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from make_models import write_model  # noqa: E402

from exlpy.cli.bench import load_model  # noqa: E402
from exlpy.model.batch import build_batch  # noqa: E402
from exlpy.runtime import options, use_options  # noqa: E402

PAGE = 256


def timed(fn: Callable[[], Any], reps: int) -> tuple[float, float]:
    """(best seconds, peak GB) of fn over a warm-up call and `reps` timed ones."""
    torch.cuda.reset_peak_memory_stats()
    best = float("inf")
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best, torch.cuda.max_memory_allocated() / 2**30


def contiguous_prefill(model: Any, n: int, chunk: int, cap_attention: bool) -> Callable[[], Any]:
    from exlpy import ExLlamaV2Cache

    cfg = model.config
    cache = ExLlamaV2Cache(model, batch_size=1, max_seq_len=n)
    ids = torch.randint(0, cfg.vocab_size, (1, n), device="cuda")

    def run() -> Any:
        cfg.max_input_len = chunk
        cfg.max_attention_size = 2048**2 if cap_attention else n * n
        cache.current_seq_len = 0
        return model.forward(ids, cache, last_id_only=True)

    return run


def paged_prefill(model: Any, n: int, chunk: int) -> Callable[[], Any]:
    """Chunks through forward_batch into pages in random order, as the dynamic generator runs a prompt."""
    from exlpy import ExLlamaV2Cache

    pages = (n + PAGE - 1) // PAGE
    pool = ExLlamaV2Cache(model, batch_size=1, max_seq_len=(pages + 4) * PAGE)
    dev = torch.device("cuda:0")
    table = torch.randperm(pages + 4)[:pages].tolist()
    ids = torch.randint(0, model.config.vocab_size, (1, n), device=dev)
    batches = [(a, min(n, a + chunk), build_batch([a], min(n, a + chunk) - a, dev, cache=pool, tables=[table],
                                                  page_size=PAGE)) for a in range(0, n, chunk)]

    def run() -> Any:
        out = None
        for a, e, b in batches:
            last = e == n
            out = model.forward_batch(ids[:, a:e], b, last_id_only=last, preprocess_only=not last)
        return out

    return run


def run_hf(model_dir: str, lengths: list[int], reps: int, timeout: int) -> dict[int, dict]:
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "hf_prefill.py"), "--model", model_dir, "--lengths",
           ",".join(map(str, lengths)), "--reps", str(reps)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        stdout, stderr = p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:  # keep the lengths it finished
        raw = e.stdout or b""
        stdout = raw.decode() if isinstance(raw, bytes) else raw
        stderr = f"timed out after {timeout} s"
    out: dict[int, dict] = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            out[r["tokens"]] = r
    for n in lengths:
        if n not in out:
            err = stderr.strip().splitlines()
            out[n] = {"tokens": n, "error": err[-1][:200] if err else "no result"}
    return out


def graph_decode(model: Any, cache: Any, ctx: int, steps: int) -> float:
    """Tokens/s of batch-1 decode at `ctx` tokens of context: one step captured in a CUDA graph (the model's own
    graphs turned off), positions advanced on the device between replays."""
    dev = torch.device("cuda:0")
    S = cache.max_seq_len
    ids = torch.zeros(1, 1, dtype=torch.long, device=dev)
    # Split counts follow max_seqlen: the cache capacity, as the model's graph runner passes it.
    batch = replace(build_batch([ctx], 1, dev, cache=cache, tables=[[0]], page_size=S), max_seqlen=S)
    model.config.no_graphs = True
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                model.forward_batch(ids, batch, last_id_only=True)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            model.forward_batch(ids, batch, last_id_only=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            g.replay()
            for t in (batch.positions, batch.slots, batch.seqlens):  # views of the packed metadata
                t.add_(1)
        torch.cuda.synchronize()
        return steps / (time.perf_counter() - t0)
    finally:
        model.config.no_graphs = False


def own_graph_decode(model: Any, cache: Any, ctx: int, steps: int) -> float:
    """fp16 cache through model.forward and its own decode graphs (the user's path)."""
    tok = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    for _ in range(3):
        cache.current_seq_len = ctx
        model.forward(tok, cache)
    cache.current_seq_len = ctx
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        model.forward(tok, cache)
    torch.cuda.synchronize()
    return steps / (time.perf_counter() - t0)


def decode_rows(model: Any, ctx: int, steps: int) -> list[str]:
    from exlpy import ExLlamaV2Cache
    from exlpy.cache import ExLlamaV2Cache_8bit, ExLlamaV2Cache_Q4, ExLlamaV2Cache_Q6, ExLlamaV2Cache_Q8

    lines = [f"| cache | decode tokens/s at {ctx:,} context | vs fp16 | K/V MB read per token |", "|---|---|---|---|"]
    c = model.config
    base = 0.0
    for name, cls in (("fp16", ExLlamaV2Cache), ("Q4", ExLlamaV2Cache_Q4), ("Q6", ExLlamaV2Cache_Q6),
                      ("Q8", ExLlamaV2Cache_Q8), ("FP8", ExLlamaV2Cache_8bit)):
        cache = cls(model, batch_size=1, max_seq_len=ctx + steps + 8)
        try:
            tps = graph_decode(model, cache, ctx, steps)
            cell = f"{tps:.1f}"
        except Exception as e:
            tps, cell = 0.0, f"failed: {type(e).__name__}: {str(e)[:120]}"
        base = base or tps
        kv = ctx * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * (
            cls.bytes_per_element_k + cls.bytes_per_element_v) / 1e6
        lines.append(f"| {name} (one captured step) | {cell} | {tps / base if base else 0:.3f} | "
                     f"{kv:,.0f} |")
        print(lines[-1], flush=True)
        if cls is ExLlamaV2Cache:
            tps2 = own_graph_decode(model, cache, ctx, steps)
            lines.append(f"| fp16 (model.forward, its own graphs) | {tps2:.1f} | {tps2 / base:.3f} | {kv:,.0f} |")
            print(lines[-1], flush=True)
        del cache
        gc.collect()
        torch.cuda.empty_cache()
    return lines


def prefill_results(model: Any, lengths: list[int], chunk: int, reps: int
                    ) -> dict[int, list[tuple[float, float] | None]]:
    """Per length: (seconds, peak GB) without the flash kernel, one forward, contiguous and paged chunks."""
    results: dict[int, list[tuple[float, float] | None]] = {}
    for n in lengths:
        row: list[tuple[float, float] | None] = []
        variants: list[tuple[bool, Callable[[], Callable[[], Any]]]] = [
            (False, lambda n=n: contiguous_prefill(model, n, 2048, True)),
            (True, lambda n=n: contiguous_prefill(model, n, n, False)),
            (True, lambda n=n: contiguous_prefill(model, n, chunk, False)),
            (True, lambda n=n: paged_prefill(model, n, chunk))]
        for i, (flash, make) in enumerate(variants):
            if i == 0 and n > 32768:
                row.append(None)
                continue
            try:
                with use_options(replace(options(), flash_attn=flash)):
                    row.append(timed(make(), 1 if (i == 0 and n > 8192) else reps))
            except torch.cuda.OutOfMemoryError:
                row.append((float("nan"), float("nan")))
            finally:
                gc.collect()
                torch.cuda.empty_cache()
            print(n, i, row[-1], flush=True)
        results[n] = row
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2k and 8k prefill, decode at 8k, one rep")
    ap.add_argument("--work", default="/tmp/exlpy_bench")
    ap.add_argument("--lengths", default="2048,8192,32768,65536")
    ap.add_argument("--chunk", type=int, default=2048, help="chunk size of the chunked variants")
    ap.add_argument("--decode-context", type=int, default=32768)
    ap.add_argument("--decode-steps", type=int, default=128)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--skip-prefill", action="store_true", help="only the decode part")
    ap.add_argument("--skip-decode", action="store_true", help="only the prefill part")
    ap.add_argument("--hf-timeout", type=int, default=400)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "prefill_run.md"))
    args = ap.parse_args()
    lengths = [2048, 8192] if args.quick else [int(x) for x in args.lengths.split(",")]
    ctx = 8192 if args.quick else args.decode_context
    steps = 32 if args.quick else args.decode_steps
    reps = 1 if args.quick else 2

    d = write_model(os.path.join(args.work, "llama3-8b-16"), "llama3-8b")
    lines = [f"## Prefill and quantized-cache decode, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} "
             f"UTC on {torch.cuda.get_device_name()}", "",
             f"Command: `python benchmarks/prefill.py {' '.join(sys.argv[1:])}`  ",
             f"torch {torch.__version__}; Llama-3-8B shape fp16, random weights; chunk {args.chunk}", ""]
    if not args.skip_prefill:
        lines += ["| tokens | exlpy, no flash kernel | exlpy, one forward | exlpy, contiguous chunks | "
                  "exlpy, paged chunks | HF SDPA, one forward | one forward / HF | paged chunks / HF |",
                  "|---|---|---|---|---|---|---|---|"]
    model = load_model(d, max(max(lengths), ctx + steps + 16))
    results = {} if args.skip_prefill else prefill_results(model, lengths, args.chunk, reps)
    lines_decode: list[str] = []
    if not args.skip_decode:
        lines_decode = ["", f"### Decode, batch 1, {ctx:,} tokens of context", ""]
        lines_decode += decode_rows(model, ctx, steps)
    model.unload()
    del model
    gc.collect()
    torch.cuda.empty_cache()
    hf = {} if args.no_hf or args.skip_prefill else run_hf(d, lengths, reps, args.hf_timeout)

    def cell(n: int, r: tuple[float, float] | None) -> str:
        if r is None:
            return "–"
        return f"{n / r[0]:,.0f} tok/s ({r[1]:.1f} GB)" if r[0] == r[0] else "out of memory"

    for n in lengths if results else []:
        h = hf.get(n, {"error": "not run"})
        hcell = f"{h['tokens_per_s']:,.0f} tok/s ({h['peak_gb']:.1f} GB)" if "tokens_per_s" in h else h["error"]
        ratios = []
        for r in (results[n][1], results[n][3]):
            ok = r is not None and r[0] == r[0] and "tokens_per_s" in h
            ratios.append(f"{n / r[0] / h['tokens_per_s']:.2f}x" if ok else "–")
        lines.append(f"| {n:,} | " + " | ".join(cell(n, r) for r in results[n]) + f" | {hcell} | "
                     + " | ".join(ratios) + " |")
    if results:
        lines.append("")
        lines.append("Peak GPU memory in parentheses (weights 16 GB included). Target (issue 22): one forward and "
                     "paged chunks each >= 1.2x HF.")
    text = "\n".join(lines + lines_decode) + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
