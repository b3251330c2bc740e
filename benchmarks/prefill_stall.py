"""A/B of captured prompt chunks next to decoding jobs, in one process (no server): the dynamic generator with
`decoders` jobs decoding while a long prompt arrives, its prompt chunks captured (exlpy/engine/graphs.py
`run_chunk`) or eager (`generator.prefill_graphs = False`, what EXLPY_PREFILL_GRAPHS=0 does for every generator).

    PYTHONPATH=. python benchmarks/prefill_stall.py --model 8b          # ~3 minutes on an H100
    PYTHONPATH=. python benchmarks/prefill_stall.py --model ../shared/models/aidreams260K --long 4096   # CPU

After one unmeasured round of each mode (compiles, captures; none on the CPU), per round (alone, captured, eager;
on the CPU alone and eager): the decoders' inter-token gaps (median / p99) where iterate() hands out each token, the
long prompt's time to its first token, the prompt tokens per iteration, and the generator thread's CPU time per
iteration while the prompt was prefilled, split into: prompt chunks (`model.prefill_chunk` or an eager
`forward_batch(preprocess_only=True)`: on a GPU their kernel launches or graph replays), decode steps, waiting for
the previous step's tokens (`Launched.read`: on CUDA the thread spins in cudaEventSynchronize, so GPU time shows up
here as CPU time) and the rest, the generator's own bookkeeping (scheduling, pages, tokens, results), with the
garbage collector's share; on CUDA also the mean GPU span of a chunk and of a decode step (events around the calls).
Then the five slowest iterations of the round with the same split. Exactness: the long prompt's K/V rows after a
captured prefill against an eager one (the same prompt), relative error, and its first token. The model: the
random-weight Llama-3-8B of benchmarks/serving.py (written once under --work), or a model directory (any device).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.serving import model_dir  # noqa: E402
from benchmarks.serving_client import pct, prompt  # noqa: E402

PARTS = ("chunk", "decode", "wait")  # disjoint; "gc" (Python's collector) may fall inside any of them


class Meter:
    """Thread CPU time of the generator thread inside prompt chunks, decode steps and token waits (see the module
    docstring), by wrapping the model's two entry points the generator calls and `Launched.read`."""

    def __init__(self, gen: Any) -> None:
        from exlpy.generator.dynamic import decode

        self.spent = dict.fromkeys((*PARTS, "gc"), 0.0)
        self._gc_start = 0.0
        self.model, self.launched = gen.model, decode.Launched
        self._read = decode.Launched.read
        self._fb, self._pc = gen.model.forward_batch, gen.model.prefill_chunk
        meter = self

        self.cuda = gen.device().type == "cuda"
        self.active = False  # inside the measured window: GPU spans are recorded
        self.events: dict[str, list[tuple[Any, Any]]] = {"chunk": [], "decode": []}

        def timed(part: Any, fn: Any) -> Any:
            def call(*a: Any, **k: Any) -> Any:
                name = part(k) if callable(part) else part
                t = time.thread_time()
                ev = None
                if self.cuda and self.active and name in self.events:  # its GPU span, read at the round end
                    ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                    ev[0].record()
                try:
                    return fn(*a, **k)
                finally:
                    if ev is not None:
                        ev[1].record()
                        self.events[name].append(ev)
                    meter.spent[name] += time.thread_time() - t
            return call

        self.model.forward_batch = timed(lambda k: "chunk" if k.get("preprocess_only") else "decode", self._fb)
        self.model.prefill_chunk = timed("chunk", self._pc)
        self.launched.read = timed("wait", self._read)
        gc.callbacks.append(self.on_gc)

    def on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # the generator runs on the main thread here
        if phase == "start":
            self._gc_start = time.thread_time()
        else:
            self.spent["gc"] += time.thread_time() - self._gc_start

    def gpu_ms(self) -> str:
        """Mean GPU span (ms) of the chunk and decode calls so far: from the stream reaching the call's first
        kernel to its last one's end (an eager chunk's span includes the GPU waiting for its launches)."""
        if not self.cuda:
            return ""
        torch.cuda.synchronize()
        out = []
        for name, evs in self.events.items():
            if evs:
                out.append(f"{name} {sum(a.elapsed_time(b) for a, b in evs) / len(evs):.2f} ms ({len(evs)} calls)")
            evs.clear()
        return "GPU span per call: " + ", ".join(out)

    def snapshot(self) -> dict[str, float]:
        return dict(self.spent)

    def close(self) -> None:
        gc.callbacks.remove(self.on_gc)
        del self.model.forward_batch, self.model.prefill_chunk  # the instance attributes: the methods again
        self.launched.read = self._read


def split_ms(total: float, parts: dict[str, float], n: int = 1) -> str:
    rest = total - sum(parts[k] for k in PARTS)
    return (f"{1e3 * total / n:.2f} ms CPU = chunks {1e3 * parts['chunk'] / n:.2f} + decode "
            f"{1e3 * parts['decode'] / n:.2f} + token wait {1e3 * parts['wait'] / n:.2f} + bookkeeping "
            f"{1e3 * rest / n:.2f} (garbage collector within them: {1e3 * parts['gc'] / n:.2f})")


def run_once(gen: Any, decoders: int, shape: tuple[int, int], long_prompt: list[int] | None, captured: bool,
             seed: int) -> dict[str, Any]:
    """`decoders` jobs; once each has 32 tokens the long prompt (if any) is enqueued; gaps until it is prefilled
    (or, alone, over the same stretch of tokens)."""
    meter = Meter(gen)
    try:
        return _run_once(gen, decoders, shape, long_prompt, captured, seed, meter)
    finally:
        meter.close()


def _run_once(gen: Any, decoders: int, shape: tuple[int, int], long_prompt: list[int] | None, captured: bool,
              seed: int, meter: Meter) -> dict[str, Any]:
    from exlpy.generator import ExLlamaV2DynamicJob, ExLlamaV2Sampler

    gen.prefill_graphs = captured
    vocab = gen.model_vocab
    rng = random.Random(seed)
    greedy = ExLlamaV2Sampler.Settings.greedy()
    jobs = [ExLlamaV2DynamicJob(torch.tensor([prompt(rng, shape[0], vocab)]), shape[1], stop_conditions=[],
                                gen_settings=greedy) for _ in range(decoders)]
    gen.enqueue(jobs)
    last: dict[Any, float] = {}
    counts: dict[Any, int] = {j: 0 for j in jobs}
    gaps: list[float] = []
    chunks: list[int] = []
    long_job = None
    t_sent = t_first = None
    cpu = 0.0
    iters = 0
    parts = dict.fromkeys((*PARTS, "gc"), 0.0)
    per_iter: list[tuple[float, float, int, int, dict[str, float]]] = []  # wall, CPU, tokens, position, parts
    kv: list[torch.Tensor] | None = None
    first_token = None
    window = False
    runner = gen.model.strategy_for_forward().graph_cache.get("runner")
    replays0 = runner.chunks_run if runner is not None else 0
    while gen.num_remaining_jobs():
        if long_job is None and long_prompt is not None and min(counts.values()) >= 32:
            long_job = ExLlamaV2DynamicJob(torch.tensor([long_prompt]), 2, stop_conditions=[], gen_settings=greedy)
            gen.enqueue(long_job)
            t_sent = time.perf_counter()
        if long_prompt is None and not window and min(counts.values()) >= 32:
            window = True
            t_sent = time.perf_counter()
        measuring = (long_job is not None and t_first is None) or (window and min(counts.values()) < 32 + 64)
        pos = long_job.seqs[0].prefill_pos if long_job is not None and long_job.seqs else 0
        meter.active = measuring
        p0, m0, w0, c0 = gen.prefill_tokens, meter.snapshot(), time.perf_counter(), time.thread_time()
        results = gen.iterate()
        if measuring:
            c = time.thread_time() - c0
            cpu += c
            iters += 1
            spent = {k: v - m0[k] for k, v in meter.snapshot().items()}
            for k in parts:
                parts[k] += spent[k]
            per_iter.append((time.perf_counter() - w0, c, gen.prefill_tokens - p0, pos, spent))
            if gen.prefill_tokens > p0:
                chunks.append(gen.prefill_tokens - p0)
        if long_job is not None and kv is None and long_job.is_prefilled():
            rows = torch.cat([torch.arange(p * gen.page_size, (p + 1) * gen.page_size)
                              for p in long_job.seqs[0].page_ids()])[:len(long_prompt)]
            kv = [t.view(-1, *t.shape[2:])[rows.to(t.device)].float().cpu() for t in gen.cache.all_tensors()[::8]]
        now = time.perf_counter()
        for r in results:
            if r["stage"] != "streaming" or not r["token_ids"].shape[-1]:
                continue
            j = r["job"]
            if j is long_job:
                if t_first is None:
                    t_first = now
                    first_token = int(r["token_ids"].view(-1)[0])
                continue
            if j in last and measuring:
                gaps.append(now - last[j])
            last[j] = now
            counts[j] += int(r["token_ids"].shape[-1])
    out = {"gaps": gaps, "chunks": chunks, "cpu_ms_per_iter": 1e3 * cpu / max(iters, 1), "iters": iters,
           "captured": (runner.chunks_run if runner is not None else 0) - replays0,
           "split": split_ms(cpu, parts, max(iters, 1)), "slowest": sorted(per_iter, key=lambda r: -r[0])[:5],
           "gpu": meter.gpu_ms()}
    if long_job is not None:
        out.update(ttft=(t_first or float("nan")) - (t_sent or 0.0), kv=kv, first=first_token)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="8b", help="a key of benchmarks/serving.py MODELS, or a model directory")
    ap.add_argument("--work", default="/tmp/exlpy_bench")
    ap.add_argument("--decoders", type=int, default=32)
    ap.add_argument("--long", type=int, default=16384)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--full-warmup", action="store_true", help="the serving warm-up first (~100 s on an 8B) instead of "
                    "one unmeasured round of each mode")
    ap.add_argument("--new-tokens", type=int, default=512, help="tokens each decoding job generates")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not Path(args.model).is_dir():
        raise SystemExit("without a CUDA device, pass a small model directory as --model (the CPU runs it)")
    from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Tokenizer
    from exlpy.engine.graphs import CHUNK_BUCKETS
    from exlpy.generator import ExLlamaV2DynamicGenerator

    t0 = time.perf_counter()
    path = args.model if Path(args.model).is_dir() else model_dir(args.work, args.model)
    shape = (512, args.new_tokens)
    cache_tokens = -(-(args.decoders * sum(shape) + args.long + 8) // 256) * 256 + 2048
    config = ExLlamaV2Config(path)
    config.max_seq_len = max(20480, args.long + 1024)
    model = ExLlamaV2(config)
    cache = ExLlamaV2Cache(model, max_seq_len=cache_tokens, lazy=True)
    model.load_autosplit(cache, progress=False)
    gen = ExLlamaV2DynamicGenerator(model, cache, ExLlamaV2Tokenizer(config), max_batch_size=args.decoders + 1,
                                    max_chunk_size=max(256, config.max_input_len // 256 * 256))
    gen.warmup(full=args.full_warmup)
    long_prompt = prompt(random.Random(99), args.long, gen.model_vocab)
    labels = ("alone", "captured", "eager") if cuda else ("alone", "eager")  # no graphs on the CPU
    if not args.full_warmup and cuda:
        for captured in (True, False):
            run_once(gen, args.decoders, shape, long_prompt, captured, 100)
    print(f"model written, loaded and warmed in {time.perf_counter() - t0:.0f} s; captured chunk sizes: "
          f"{gen.chunk_buckets()} (of {CHUNK_BUCKETS})", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
    for k in range(args.rounds):
        for label in labels:
            r = run_once(gen, args.decoders, shape, None if label == "alone" else long_prompt, label != "eager", k)
            runs[label].append(r)
            g = r["gaps"]
            extra = f", TTFT {r['ttft']:.2f} s" if "ttft" in r else ""
            print(f"round {k} {label}: {len(g)} gaps, median {statistics.median(g) * 1e3:.1f} ms, p99 "
                  f"{pct(g, 0.99) * 1e3:.1f} ms; generator thread {r['cpu_ms_per_iter']:.2f} ms CPU per iteration "
                  f"({r['iters']} iterations){extra}; {r['captured']} captured chunks; prompt tokens per iteration: "
                  f"{sorted(set(r['chunks']))[:8]}", flush=True)
            print(f"  per iteration: {r['split']}" + (f"; {r['gpu']}" if r["gpu"] else ""), flush=True)
            for wall, c, n, pos, sp in r["slowest"]:
                print(f"  slow iteration: {wall * 1e3:.1f} ms wall, {n} prompt tokens at position {pos}; "
                      f"{split_ms(c, sp)}", flush=True)
    base = [g for r in runs["alone"] for g in r["gaps"]]
    device = torch.cuda.get_device_name() if cuda else f"CPU ({torch.get_num_threads()} threads)"
    print(f"\n{args.decoders} decoding streams ({shape[0]}-token prompts) on {device}, a "
          f"{args.long}-token prompt arriving:")
    for label in labels:
        g = [x for r in runs[label] for x in r["gaps"]]
        ttft = [r["ttft"] for r in runs[label] if "ttft" in r]
        med, p99 = statistics.median(g), pct(g, 0.99)
        print(f"  {label:9s} median {med * 1e3:6.1f} ms ({med / statistics.median(base):.2f}x)  p99 "
              f"{p99 * 1e3:6.1f} ms ({p99 / pct(base, 0.99):.2f}x)"
              + (f"  TTFT {statistics.median(ttft):.2f} s" if ttft else ""))
    if not cuda:
        return
    a, b = runs["captured"][0], runs["eager"][0]
    if a.get("kv") and b.get("kv"):
        err = max(float((x - y).norm() / y.norm().clamp_min(1e-12)) for x, y in zip(a["kv"], b["kv"]))
        print(f"exactness: K/V of the prompt (every 8th cache tensor), captured vs eager: max relative error "
              f"{err:.2e}; first token {a['first']} vs {b['first']}")


if __name__ == "__main__":
    main()
