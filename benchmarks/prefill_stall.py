"""A/B of how prompt chunks run next to decoding jobs, in one process (no server): the dynamic generator with
`decoders` jobs decoding while a long prompt arrives, its prompt chunks inside the decode step (mode `mixed`: one
eager pass over the decode rows and the chunk, `generator.mixed_step`, EXLPY_MIXED_STEP), or as passes of their own
after it, captured (`captured`: exlpy/engine/graphs.py `run_chunk`, the default; not with EXLPY_PREFILL_GRAPHS=0)
or eager (`eager`).

    PYTHONPATH=. python benchmarks/prefill_stall.py --model 8b    # ~4 minutes on an H100
    PYTHONPATH=. python benchmarks/prefill_stall.py --model ../shared/models/aidreams260K --long 4096   # CPU

After one unmeasured round of each mode (compiles, captures; none on the CPU), per round (alone, mixed, captured,
eager; on the CPU alone, mixed and eager; `--modes` picks some): the decoders' inter-token gaps (median / p99)
measured where each token reaches its job (`job.new_tokens` after `iterate()`), the long prompt's time to its first
token, the prompt tokens per iteration,
and the generator thread's CPU time per iteration while the prompt was prefilled. That CPU time is split into
exclusive parts. The prompt chunks (`model.prefill_chunk` or an eager `forward_batch(preprocess_only=True)`: on a
GPU their kernel launches or graph replays), the decode steps, and the wait for the previous step's tokens
(`Launched.read`: on CUDA the thread spins in cudaEventSynchronize, so GPU time shows up here as CPU time); in the
mixed mode the chunks are inside the decode steps, so "chunks" is ~0 and "decode" holds both. Then the
generator's own bookkeeping, itself split into admission, the prompt's host work (chunk metadata, page marks), the
decode pages, the step's inputs, sampling (launches; on the CPU the sampler itself), tokens to results (stop checks,
detokenization), host-sampled rows and the rest of `iterate()`, with the garbage collector's share. On CUDA also the
mean GPU span of a chunk and of a decode step (events around the calls).

Then the five slowest iterations with the same split (on CUDA also their chunks' and decode step's GPU spans, which
say whether the device or the host made them slow), every iteration in which a decoding job got no token (none is
expected: the generator gives each one a token per iteration), the loop iterations around the largest gaps (time
inside `iterate()` and outside it, in this script), and the tokens whose result the text stream held back. The
synthetic byte-level tokenizer of the random models has 128 lone high bytes (incomplete UTF-8): their text waits
for the next token, so a streaming client sees that job's gap doubled ("result gaps"; about 0.1% of tokens on the
8B: enough to set a p99 over ~3,400 gaps). The token gaps are what the scheduler decides, and are the figure
compared with the run alone.

Exactness: the long prompt's K/V rows after a mixed or captured prefill against an eager one (the same prompt),
relative error, and its first token; the rows are gathered on the device when the prompt is prefilled (no wait for the
device) and read back after the round, so that the read-back (512 MB on the 8B) does not land in the gaps. The
model: the random-weight Llama-3-8B of benchmarks/serving.py (written once under --work), or a model directory (any
device).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import threading
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.serving import model_dir  # noqa: E402
from benchmarks.serving_client import pct, prompt  # noqa: E402

# Exclusive parts of the generator thread's CPU time; "gc" (Python's collector) may fall inside any of them.
PARTS = ("chunk", "decode", "wait")  # the model's passes and the wait for tokens
HOST = ("admit", "prefill", "pages", "inputs", "sample", "results", "host", "event")  # the bookkeeping's parts
HOST_LABELS = {"admit": "admission", "prefill": "prompt host work", "pages": "decode pages", "inputs": "step inputs",
               "sample": "sampling", "results": "tokens to results", "host": "host-sampled rows",
               "event": "other event waits"}  # CUDA: waits on an event other than the token read (staging buffers)


class Meter:
    """Thread CPU time of the generator thread in the parts named by PARTS and HOST (see the module docstring), each
    exclusive of the parts called inside it, by wrapping the functions `iterate()` calls: the model's two entry
    points, `Launched.read`, the scheduler's admission and decode pages, `run_prefill` and the decode stepper's
    methods. Cheap: a dozen wrapped calls an iteration."""

    def __init__(self, gen: Any) -> None:
        from exlpy.generator.dynamic import decode, scheduler
        from exlpy.generator.dynamic import generator as genmod

        self.spent = dict.fromkeys((*PARTS, *HOST, "gc"), 0.0)
        self._gc_start = 0.0
        self._stack: list[list[Any]] = []  # per open call: [its start, CPU of the parts called inside it, part]
        self.cuda = gen.device().type == "cuda"
        self.active = False  # inside the measured window: GPU spans are recorded
        self.events: dict[str, list[tuple[Any, Any]]] = {"chunk": [], "decode": []}
        # (owner, attribute, original, whether the original was the owner's own attribute) to restore in close()
        self._patched: list[tuple[Any, str, Any, bool]] = []
        model, stepper = gen.model, gen.stepper
        self._wrap(model, "forward_batch", lambda k: "chunk" if k.get("preprocess_only") else "decode")
        self._wrap(model, "prefill_chunk", "chunk")
        self._wrap(decode.Launched, "read", "wait")
        self._wrap(scheduler, "admit", "admit")
        self._wrap(scheduler, "decode_pages", "pages")
        self._wrap(genmod, "run_prefill", "prefill")
        for name, part in (("forward", "inputs"), ("sample", "sample"), ("finish", "results"),
                           ("sample_host", "host")):
            self._wrap(stepper, name, part)
        if self.cuda:  # an event wait inside the token read is that read's; any other one is a part of its own
            self._wrap(torch.cuda.Event, "synchronize",
                       lambda k: "wait" if self._stack and self._stack[-1][2] == "wait" else "event")
        gc.callbacks.append(self.on_gc)

    def _wrap(self, owner: Any, attr: str, part: Any) -> None:
        own = attr in vars(owner)
        fn = getattr(owner, attr)
        meter = self

        def call(*a: Any, **k: Any) -> Any:
            name = part(k) if callable(part) else part
            ev = None
            if meter.cuda and meter.active and name in meter.events:  # its GPU span, read at the round end
                ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                ev[0].record()
            meter._stack.append([time.thread_time(), 0.0, name])
            try:
                return fn(*a, **k)
            finally:
                if ev is not None:
                    ev[1].record()
                    meter.events[name].append(ev)
                start, inner, _ = meter._stack.pop()
                took = time.thread_time() - start
                meter.spent[name] += took - inner
                if meter._stack:
                    meter._stack[-1][1] += took

        self._patched.append((owner, attr, vars(owner)[attr] if own else None, own))
        setattr(owner, attr, call)

    def on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # the generator runs on the main thread here
        if phase == "start":
            self._gc_start = time.thread_time()
        else:
            self.spent["gc"] += time.thread_time() - self._gc_start

    def gpu_spans(self) -> dict[str, list[float]]:
        """The GPU span (ms) of each chunk and decode call recorded so far, in call order (then forgotten): from the
        stream reaching the call's first kernel to its last one's end (an eager chunk's span includes the GPU
        waiting for its launches). Empty lists on the CPU."""
        if self.cuda:
            torch.cuda.synchronize()
        spans = {name: [a.elapsed_time(b) for a, b in evs] for name, evs in self.events.items()}
        for evs in self.events.values():
            evs.clear()
        return spans

    def marks(self) -> dict[str, int]:
        """How many calls of each kind have a GPU span so far (slice gpu_spans() by two marks: one iteration)."""
        return {name: len(evs) for name, evs in self.events.items()}

    def snapshot(self) -> dict[str, float]:
        return dict(self.spent)

    def close(self) -> None:
        gc.callbacks.remove(self.on_gc)
        for owner, attr, original, own in reversed(self._patched):
            if own:
                setattr(owner, attr, original)
            else:
                delattr(owner, attr)  # the instance attribute: the class's method again


def split_ms(total: float, parts: dict[str, float], n: int = 1) -> str:
    booked = total - sum(parts[k] for k in PARTS)
    rest = booked - sum(parts[k] for k in HOST)
    ms = {k: 1e3 * v / n for k, v in parts.items()}
    host = " + ".join(f"{HOST_LABELS[k]} {ms[k]:.2f}" for k in HOST if ms[k] >= 0.005)
    return (f"{1e3 * total / n:.2f} ms CPU = chunks {ms['chunk']:.2f} + decode {ms['decode']:.2f} + token wait "
            f"{ms['wait']:.2f} + bookkeeping {1e3 * booked / n:.2f} ({host} + rest of iterate() {1e3 * rest / n:.2f};"
            f" garbage collector within all of them: {ms['gc']:.2f})")


def run_once(gen: Any, decoders: int, shape: tuple[int, int], long_prompt: list[int] | None, mode: str,
             seed: int) -> dict[str, Any]:
    """`decoders` jobs; once each has 32 tokens the long prompt (if any) is enqueued; gaps until it is prefilled
    (or, alone, over the same stretch of tokens). `mode`: how the prompt's chunks run (see the module docstring)."""
    meter = Meter(gen)
    try:
        return _run_once(gen, decoders, shape, long_prompt, mode, seed, meter)
    finally:
        meter.close()


def _run_once(gen: Any, decoders: int, shape: tuple[int, int], long_prompt: list[int] | None, mode: str,
              seed: int, meter: Meter) -> dict[str, Any]:
    from exlpy.generator import ExLlamaV2DynamicJob, ExLlamaV2Sampler

    gen.reset_page_table()  # each round computes its prompts: no prefix left cached by an earlier round
    gen.prefill_graphs = mode == "captured"
    gen.mixed_step = mode == "mixed"
    mixed0 = gen.mixed_steps
    vocab = gen.model_vocab
    rng = random.Random(seed)
    greedy = ExLlamaV2Sampler.Settings.greedy()
    jobs = [ExLlamaV2DynamicJob(torch.tensor([prompt(rng, shape[0], vocab)]), shape[1], stop_conditions=[],
                                gen_settings=greedy) for _ in range(decoders)]
    gen.enqueue(jobs)
    long_ids = torch.tensor([long_prompt]) if long_prompt is not None else None  # made before the clock runs
    last: dict[Any, float] = {}  # per decoder: when its last token reached it
    shown: dict[Any, float] = {}  # ... and when its last result with tokens came out of iterate()
    counts: dict[Any, int] = {j: 0 for j in jobs}
    gaps: list[float] = []  # token gaps
    result_gaps: list[float] = []  # what a streaming client sees: a held token doubles its job's gap
    held = 0
    chunks: list[int] = []
    long_job = None
    t_sent = t_first = None
    cpu = 0.0
    iters = 0
    parts = dict.fromkeys(meter.spent, 0.0)
    # wall, CPU, prompt tokens, position, parts, synchronizing CUDA calls (where), GPU span marks before and after
    per_iter: list[tuple[float, float, int, int, dict[str, float], list[str], dict[str, int], dict[str, int]]] = []
    syncs: Counter[str] = Counter()
    starved: list[str] = []  # iterations in which a decoding job got no token
    loops: list[tuple[float, float, float, int, str]] = []  # largest gap, iterate() wall, loop wall, index, state
    kv: list[torch.Tensor] | None = None
    first_token = None
    window = False
    runner = gen.model.strategy_for_forward().graph_cache.get("runner")
    replays0 = runner.chunks_run if runner is not None else 0
    prev_now = None
    while gen.num_remaining_jobs():
        if long_job is None and long_ids is not None and min(counts.values()) >= 32:
            long_job = ExLlamaV2DynamicJob(long_ids, 2, stop_conditions=[], gen_settings=greedy)
            gen.enqueue(long_job)
            t_sent = time.perf_counter()
        if long_ids is None and not window and min(counts.values()) >= 32:
            window = True
            t_sent = time.perf_counter()
        measuring = (long_job is not None and t_first is None) or (window and min(counts.values()) < 32 + 64)
        pos = long_job.seqs[0].prefill_pos if long_job is not None and long_job.seqs else 0
        state = ("queued" if long_job is not None and not long_job.started else
                 f"prefill at {pos}" if long_job is not None and not long_job.is_prefilled() else
                 "decoding" if long_job is not None else "-")
        meter.active = measuring
        before = {j: j.new_tokens for j in jobs}
        g0 = meter.marks()
        p0, m0, w0, c0 = gen.prefill_tokens, meter.snapshot(), time.perf_counter(), time.thread_time()
        results, synced = iterate_watched(gen) if measuring and meter.cuda else (gen.iterate(), [])
        w1 = time.perf_counter()
        syncs.update(synced)
        if measuring:
            c = time.thread_time() - c0
            cpu += c
            iters += 1
            spent = {k: v - m0[k] for k, v in meter.snapshot().items()}
            for k in parts:
                parts[k] += spent[k]
            per_iter.append((w1 - w0, c, gen.prefill_tokens - p0, pos, spent, synced, g0, meter.marks()))
            if gen.prefill_tokens > p0:
                chunks.append(gen.prefill_tokens - p0)
        if long_job is not None and kv is None and long_job.is_prefilled():
            kv = kv_rows(gen, long_job, len(long_prompt or []))
        now = time.perf_counter()
        with_tokens = set()
        for r in results:
            if r["stage"] != "streaming" or not r["token_ids"].shape[-1]:
                continue
            j = r["job"]
            if j is long_job:
                if t_first is None:
                    t_first = now
                    first_token = int(r["token_ids"].view(-1)[0])
                continue
            with_tokens.add(j)
            if j in shown and measuring:
                result_gaps.append(now - shown[j])
            shown[j] = now
        got, worst = 0, 0.0
        for j in jobs:
            if j.new_tokens == before[j]:
                continue
            got += 1
            counts[j] = j.new_tokens
            if j in last and measuring:
                gaps.append(now - last[j])
                worst = max(worst, now - last[j])
                held += j not in with_tokens
            last[j] = now
        if measuring:
            live = sum(1 for j in jobs if not j.finished or before[j] < j.new_tokens)
            if got < live:
                starved.append(f"iteration {iters - 1}: {live - got} of {live} decoding jobs got no token "
                               f"(long prompt: {state})")
            if prev_now is not None:
                loops.append((worst, w1 - w0, now - prev_now, iters - 1, state))
        prev_now = now
    if kv is not None:
        kv = [x.float().cpu() for x in kv]
    out = {"gaps": gaps, "result_gaps": result_gaps, "held": held, "chunks": chunks, "iters": iters,
           "cpu_ms_per_iter": 1e3 * cpu / max(iters, 1),
           "captured": (runner.chunks_run if runner is not None else 0) - replays0, "mixed": gen.mixed_steps - mixed0,
           "split": split_ms(cpu, parts, max(iters, 1)), "starved": starved, "syncs": syncs,
           "largest": sorted(loops, key=lambda r: -r[0])[:3]}
    spans = meter.gpu_spans()
    out["gpu"] = "GPU span per call: " + ", ".join(
        f"{name} {sum(v) / len(v):.2f} ms ({len(v)} calls)" for name, v in spans.items() if v) if meter.cuda else ""
    out["slowest"] = [(*r[:6], {name: sum(spans[name][r[6][name]:r[7][name]]) for name in spans})
                      for r in sorted(per_iter, key=lambda r: -r[0])[:5]]
    if long_job is not None:
        out.update(ttft=(t_first or float("nan")) - (t_sent or 0.0), kv=kv, first=first_token)
    return out


def iterate_watched(gen: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """`gen.iterate()` with torch's sync debug mode on: (its results, where it called a synchronizing CUDA operation,
    as file:line). Such a call (an `.item()` or `.tolist()` of a device tensor, a synchronous copy) makes the host
    wait for the device's queue, a step or more, and shows up as bookkeeping CPU (CUDA spins); the wait for the
    step's tokens is an event wait, not counted here."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            results = gen.iterate()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = []
    for w in caught:
        if "synchroniz" in str(w.message):
            sites.append(f"{Path(w.filename).name}:{w.lineno}")
        else:  # any other warning of the step (a failed capture...) is shown as usual
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return results, sites


def kv_rows(gen: Any, job: Any, n: int) -> list[torch.Tensor]:
    """The job's first `n` K/V rows of every 8th cache tensor, gathered on the device without waiting for it (the
    page index through pinned memory); read back after the round."""
    device = gen.device()
    pages = torch.tensor(job.seqs[0].page_ids(), dtype=torch.long)
    if device.type == "cuda":
        pages = pages.pin_memory().to(device, non_blocking=True)
    rows = (pages.view(-1, 1) * gen.page_size + torch.arange(gen.page_size, device=device)).view(-1)[:n]
    return [t.view(-1, *t.shape[2:]).index_select(0, rows.to(t.device, non_blocking=True))
            for t in gen.cache.all_tensors()[::8]]


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
    ap.add_argument("--modes", default="alone,mixed,captured,eager", help="rounds to run, of alone (no long prompt), "
                    "mixed (chunks inside the decode step), captured, eager (chunks as passes of their own); the CPU "
                    "skips captured")
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
    # whole pages per job (a decoder of 512 + 200 tokens holds 3 pages, 768 tokens), and room for the admission's
    # growth reserve
    cache_tokens = (args.decoders * -(-sum(shape) // 256) + -(-(args.long + 8) // 256)) * 256 + 2048
    config = ExLlamaV2Config(path)
    config.max_seq_len = max(20480, args.long + 1024)
    model = ExLlamaV2(config)
    cache = ExLlamaV2Cache(model, max_seq_len=cache_tokens, lazy=True)
    model.load_autosplit(cache, progress=False)
    gen = ExLlamaV2DynamicGenerator(model, cache, ExLlamaV2Tokenizer(config), max_batch_size=args.decoders + 1,
                                    max_chunk_size=max(256, config.max_input_len // 256 * 256))
    gen.warmup(full=args.full_warmup)
    long_prompt = prompt(random.Random(99), args.long, gen.model_vocab)
    labels = [m for m in args.modes.split(",") if m and (cuda or m != "captured")]  # no graphs on the CPU
    unknown = set(labels) - {"alone", "mixed", "captured", "eager"}
    if unknown or "alone" not in labels:
        raise SystemExit(f"--modes: alone and any of mixed, captured, eager (got {args.modes})")
    if not args.full_warmup and cuda:
        for mode in labels[1:]:
            run_once(gen, args.decoders, shape, long_prompt, mode, 100)
    print(f"model written, loaded and warmed in {time.perf_counter() - t0:.0f} s; captured chunk sizes: "
          f"{gen.chunk_buckets()} (of {CHUNK_BUCKETS})", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
    for k in range(args.rounds):
        for label in labels:
            r = run_once(gen, args.decoders, shape, None if label == "alone" else long_prompt, label, k)
            runs[label].append(r)
            g = r["gaps"]
            extra = f", TTFT {r['ttft']:.2f} s" if "ttft" in r else ""
            print(f"round {k} {label}: {len(g)} gaps, median {statistics.median(g) * 1e3:.1f} ms, p99 "
                  f"{pct(g, 0.99) * 1e3:.1f} ms; generator thread {r['cpu_ms_per_iter']:.2f} ms CPU per iteration "
                  f"({r['iters']} iterations){extra}; {r['captured']} captured chunks, {r['mixed']} mixed steps "
                  f"(decode steps carrying a chunk); prompt tokens per iteration: "
                  f"{sorted(set(r['chunks']))[:8]}", flush=True)
            print(f"  per iteration: {r['split']}" + (f"; {r['gpu']}" if r["gpu"] else ""), flush=True)
            for wall, c, n, pos, sp, synced, gpu in r["slowest"]:
                print(f"  slow iteration: {wall * 1e3:.1f} ms wall, {n} prompt tokens at position {pos}; "
                      f"{split_ms(c, sp)}" + (f"; synchronizing CUDA calls: {synced}" if synced else "")
                      + (f"; GPU spans: chunks {gpu['chunk']:.2f} ms, decode {gpu['decode']:.2f} ms" if cuda else ""),
                      flush=True)
            if cuda:
                print(f"  synchronizing CUDA calls inside iterate(): {dict(r['syncs']) or 'none'}", flush=True)
            print(f"  iterations in which a decoding job got no token: {len(r['starved'])}"
                  + "".join(f"\n    {s}" for s in r["starved"][:10]), flush=True)
            for gap, inside, loop, i, state in r["largest"]:
                print(f"  largest gap {gap * 1e3:.1f} ms, ending at iteration {i} (long prompt: {state}): the loop "
                      f"took {loop * 1e3:.1f} ms, iterate() {inside * 1e3:.1f} ms of it", flush=True)
            rg = r["result_gaps"]
            print(f"  results: {r['held']} tokens held back a step by the text stream (incomplete UTF-8); result "
                  f"gaps median {statistics.median(rg) * 1e3:.1f} ms, p99 {pct(rg, 0.99) * 1e3:.1f} ms", flush=True)
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
              + (f"  TTFT {statistics.median(ttft):.2f} s" if ttft else "")
              + f"  (result gaps p99 {pct([x for r in runs[label] for x in r['result_gaps']], 0.99) * 1e3:.1f} ms)")
    if "eager" not in runs:
        return
    b = runs["eager"][0]
    for label in ("mixed", "captured"):
        a = runs[label][0] if label in runs else {}
        if a.get("kv") and b.get("kv"):
            err = max(float((x - y).norm() / y.norm().clamp_min(1e-12)) for x, y in zip(a["kv"], b["kv"]))
            print(f"exactness: K/V of the prompt (every 8th cache tensor), {label} vs eager: max relative error "
                  f"{err:.2e}; first token {a['first']} vs {b['first']}")


if __name__ == "__main__":
    main()
