"""One load shape, two drivers: `exlpy serve` through the openai client, and the dynamic generator driven
directly, so the server's cost over the generator shows in one run.

    # CPU, scaled down (what benchmarks/results/serving.md records as "CPU (2 cores)"):
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/serving_load.py --model exlpy/demo/aidreams260K \\
        --streams 64 --prompts 8,60 --max-tokens 64 --cache-size 16384
    # GPU (8B fp16, the server with its default cache, plus the 16k-prompt stall check):
    PYTHONPATH=. python benchmarks/serving.py --models 8b --parts load --out /tmp/serving_load.md

The workload: `--streams` requests sent at once, random token-id prompts of random length in `--prompts`, each
generating exactly `--max-tokens` tokens (EOS banned, temperature 0). The generator-direct run enqueues the same
jobs at once and iterates until they finish. Both report total tokens/s over the wall time from the first
request to the last token, TTFT median / p99 and inter-token median / p99 (pooled over streams).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.serving_client import Stream, pct, prompt, start_server, stream  # noqa: E402


@dataclass
class Load:
    streams: int = 64
    prompts: tuple[int, int] = (100, 2000)
    max_tokens: int = 256
    seed: int = 0

    def prompt_ids(self, vocab: int) -> list[list[int]]:
        rng = random.Random(self.seed)
        return [prompt(rng, rng.randint(*self.prompts), vocab) for _ in range(self.streams)]


@dataclass
class Figures:
    """What one driver measured over one run of the load."""

    label: str
    wall: float
    tokens: int
    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    failed: int = 0
    cpu: float = float("nan")  # CPU seconds the server process (or the generator's process) used meanwhile
    threads: dict[str, float] = field(default_factory=dict)  # the server's CPU seconds per thread name
    client_cpu: float = float("nan")  # CPU seconds of the client processes

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall

    def line(self) -> str:
        return (f"{self.label}: {self.tok_s:,.1f} tok/s ({self.tokens} tokens in {self.wall:.2f} s); TTFT median "
                f"{statistics.median(self.ttft) * 1e3:.0f} ms, p99 {pct(self.ttft, 0.99) * 1e3:.0f} ms; inter-token "
                f"median {statistics.median(self.gaps) * 1e3:.1f} ms, p99 {pct(self.gaps, 0.99) * 1e3:.1f} ms"
                + f"; CPU {self.cpu * 1e3 / max(self.tokens, 1):.2f} ms per token"
                + (f" (client {self.client_cpu * 1e3 / max(self.tokens, 1):.2f})" if self.client_cpu == self.client_cpu
                   else "")
                + (f" [{self.thread_split()}]" if self.threads else "")
                + (f"; {self.failed} failed" if self.failed else ""))

    def thread_split(self) -> str:
        """CPU ms per token by server thread: the event loop (the main thread), the generator's thread
        (exlpy-generator), the rest (torch's and CUDA's threads, the request handlers' thread pool) together."""
        n = max(self.tokens, 1)
        loop = self.threads.get("main", 0.0)
        gen = self.threads.get("exlpy-generator", 0.0)
        rest = sum(self.threads.values()) - loop - gen
        return f"event loop {loop * 1e3 / n:.3f}, generator thread {gen * 1e3 / n:.3f}, other {rest * 1e3 / n:.3f}"


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) per thread name of a process (threads of one name summed; the main thread,
    the server's event loop, as "main": threads it starts inherit its OS name), from /proc."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = "main" if task.name == str(pid) else (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def figures_of(label: str, streams: list[Stream], wall: float) -> Figures:
    done = [s for s in streams if not s.error and s.chunks]
    return Figures(label, wall, sum(s.tokens for s in done), [s.ttft for s in done],
                   [g for s in done for g in s.gaps()], len(streams) - len(done))


async def _client_streams(port: int, name: str, prompts: list[list[int]], max_tokens: int
                          ) -> tuple[list[Stream], float]:
    """One client process's share of the load: its streams and the CPU seconds it spent on them."""
    import httpx
    import openai

    http = httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1024, max_keepalive_connections=1024))
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", http_client=http,
                                max_retries=0)
    streams = [Stream() for _ in prompts]
    cpu0 = time.process_time()
    await asyncio.gather(*[stream(client, name, ids, max_tokens, s) for ids, s in zip(prompts, streams)])
    cpu = time.process_time() - cpu0
    await http.aclose()
    return streams, cpu


def _client_process(args: tuple[int, str, list[list[int]], int]) -> tuple[list[Stream], float]:
    return asyncio.run(_client_streams(*args))


async def _drive_server(port: int, name: str, prompts: list[list[int]], max_tokens: int, vocab: int,
                        pid: int | None = None, clients: int = 1) -> Figures:
    """All prompts at once through `clients` processes of the openai client (one process parsing thousands of
    chunks a second would itself be the bottleneck; perf_counter is system-wide, so their times compare)."""
    import httpx
    import openai

    async with httpx.AsyncClient(timeout=600) as http:  # the HTTP path warm
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", http_client=http,
                                    max_retries=0)
        await stream(client, name, prompt(random.Random(1), 32, vocab), 8, Stream())
    cpu0 = process_cpu(pid) if pid else float("nan")
    threads0 = thread_cpu(pid) if pid else {}
    t0 = time.perf_counter()
    if clients <= 1:
        streams, client_cpu = await _client_streams(port, name, prompts, max_tokens)
    else:
        import concurrent.futures
        import multiprocessing

        parts = [(port, name, prompts[k::clients], max_tokens) for k in range(clients)]
        with concurrent.futures.ProcessPoolExecutor(clients, mp_context=multiprocessing.get_context("fork")) as ex:
            done = await asyncio.get_running_loop().run_in_executor(None, lambda: list(ex.map(_client_process, parts)))
        streams = [st for part, _ in done for st in part]
        client_cpu = sum(c for _, c in done)
    ends = [s.chunks[-1] for s in streams if s.chunks]
    wall = (max(ends) if ends else time.perf_counter()) - t0
    out = figures_of(f"exlpy serve (openai client, {clients} process{'es' if clients > 1 else ''})", streams, wall)
    out.cpu = (process_cpu(pid) if pid else float("nan")) - cpu0
    if pid:
        out.threads = {k: v - threads0.get(k, 0.0) for k, v in thread_cpu(pid).items()}
    out.client_cpu = client_cpu
    return out


def health(port: int) -> dict[str, Any]:
    import json
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
        return json.loads(r.read())


async def _first_requests(port: int, name: str, vocab: int, context: int) -> tuple[Stream, Stream]:
    """Two requests one after the other (512-token prompt, 256 tokens; less in a short context) on a server that
    has served nothing."""
    import httpx
    import openai

    rng = random.Random(11)
    http = httpx.AsyncClient(timeout=600)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", http_client=http,
                                max_retries=0)
    n, new = min(512, context // 2), min(256, context // 4)
    first = await stream(client, name, prompt(rng, n, vocab), new, Stream())
    second = await stream(client, name, prompt(rng, n, vocab), new, Stream())
    await http.aclose()
    return first, second


async def _stall_check(port: int, name: str, vocab: int, decoders: int, long_prompt: int, shape: tuple[int, int]
                       ) -> tuple[list[float], list[float], Stream, list[float]]:
    """Inter-token gaps of `decoders` streams (`shape`: prompt length, tokens) alone, then with a `long_prompt`
    prompt arriving once each had 32 tokens (gaps while it was prefilled), then alone again: the baseline moves
    between runs (the 32 streams alone: p99 16.5-64 ms on H100s), so it is measured before and after."""
    import httpx
    import openai

    rng = random.Random(7)
    http = httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1024, max_keepalive_connections=1024))
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", http_client=http,
                                max_retries=0)
    out: dict[str, Any] = {}
    for label in ("alone", "long", "after"):
        dec = [Stream() for _ in range(decoders)]
        tasks = [asyncio.ensure_future(stream(client, name, prompt(rng, shape[0], vocab), shape[1], s)) for s in dec]
        extra = Stream()
        if label == "long":
            while min(len(s.chunks) for s in dec) < min(32, shape[1] // 4) and not all(t.done() for t in tasks):
                await asyncio.sleep(0.005)
            await stream(client, name, prompt(rng, long_prompt, vocab), 8, extra)
        await asyncio.gather(*tasks)
        end = extra.chunks[0] if extra.chunks else float("inf")
        out[label] = [g for s in dec for g in (s.gaps(extra.sent, end) if label == "long" else s.gaps())]
        out[label + "_extra"] = extra
    await http.aclose()
    return out["alone"], out["long"], out["long_extra"], out["after"]


def run_server(model: str, load: Load, port: int, cache_size: int | None, max_seq_len: int | None,
               log: str, extra: list[str] | None = None, stall: tuple[int, int, tuple[int, int]] | None = None,
               clients: int = 1, crowd: int = 0) -> tuple[Figures, dict[str, Any]]:
    """The load through a fresh `exlpy serve`; with `stall` = (decoders, long prompt, (decoder prompt, decoder
    tokens)) also the stall check; with `crowd` also that many streams of the load's shape on fresh prompts (issue
    29: with the default cache all complete, none refused while the cache has room).
    Returns the figures and facts for the report (startup time, cache, compiles while serving)."""
    from exlpy import ExLlamaV2Config

    config = ExLlamaV2Config(model)
    name = os.path.basename(os.path.normpath(model))
    t0 = time.perf_counter()
    proc = start_server(model, port, cache_size, max_seq_len or config.max_seq_len, log, extra)
    facts: dict[str, Any] = {"startup_s": time.perf_counter() - t0, "health_start": health(port)}
    try:
        if stall is not None:  # the very first request after startup, then the same again
            facts["first"] = asyncio.run(_first_requests(port, name, config.vocab_size,
                                                         max_seq_len or config.max_seq_len))
        fig = asyncio.run(_drive_server(port, name, load.prompt_ids(config.vocab_size), load.max_tokens,
                                        config.vocab_size, proc.pid, clients))
        if crowd:
            facts["health_before_crowd"] = health(port)
            many = Load(crowd, load.prompts, load.max_tokens, seed=load.seed + 1)  # other prompts: no prefix hits
            facts["crowd"] = asyncio.run(_drive_server(port, name, many.prompt_ids(config.vocab_size),
                                                       many.max_tokens, config.vocab_size, proc.pid, clients))
            facts["health_crowd"] = health(port)
        if stall is not None:
            facts["stall"] = asyncio.run(_stall_check(port, name, config.vocab_size, *stall))
        facts["health_end"] = health(port)
        return fig, facts
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except Exception:
            proc.kill()


def run_generator(gen: Any, load: Load, vocab: int) -> Figures:
    """The same requests enqueued at once into `gen`; times taken where iterate() returns each token."""
    import torch

    from exlpy.generator import ExLlamaV2DynamicJob, ExLlamaV2Sampler

    bias = torch.zeros(vocab)
    bias[2] = -100.0  # EOS banned, as the server client does
    settings = ExLlamaV2Sampler.Settings.greedy()
    settings.token_bias = bias
    warm = ExLlamaV2DynamicJob(torch.tensor([prompt(random.Random(1), 32, vocab)]), 8, stop_conditions=[],
                               gen_settings=settings)
    gen.enqueue(warm)
    while gen.num_remaining_jobs():
        gen.iterate()
    jobs = [ExLlamaV2DynamicJob(torch.tensor([ids]), load.max_tokens, stop_conditions=[], gen_settings=settings)
            for ids in load.prompt_ids(vocab)]
    streams = {j: Stream() for j in jobs}
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    for j in jobs:
        streams[j].sent = t0
        gen.enqueue(j)
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            if r["stage"] == "streaming" and r["token_ids"].shape[-1]:
                s = streams[r["job"]]
                s.chunks.append(time.perf_counter())
                s.tokens += int(r["token_ids"].shape[-1])
    wall = time.perf_counter() - t0
    out = figures_of("generator driven directly", list(streams.values()), wall)
    out.cpu = time.process_time() - cpu0
    return out


def stall_lines(alone: list[float], long: list[float], extra: Stream, long_prompt: int, decoders: int,
                shape: tuple[int, int], after: list[float] | None = None) -> list[str]:
    """The stall check's report: the baseline (the streams alone) measured before and after the run with the long
    prompt, each with its p99 and median; the target (p99 <= 3x) judged against both baselines' gaps pooled, and
    the median's ratio beside it (the p99 of a few hundred gaps moves with one slow step, the median does not)."""
    after = after or []
    base = alone + after
    p_base, p_long = pct(base, 0.99), pct(long, 0.99)
    m_base, m_long = statistics.median(base), statistics.median(long)
    ttft = f"{extra.ttft:.2f} s" if extra.chunks else f"none ({extra.error})"

    def fig(gaps: list[float]) -> str:
        return f"p99 {pct(gaps, 0.99) * 1e3:.1f} / median {statistics.median(gaps) * 1e3:.1f} ms"

    alone_text = f"before {fig(alone)}" + (f", after {fig(after)}" if after else "")
    prefill = "captured chunks" if options_prefill_graphs() else "eager chunks (EXLPY_PREFILL_GRAPHS=0)"
    return [f"- {decoders} decoding streams ({shape[0]}-token prompts, {shape[1]} tokens) alone: {alone_text}; "
            f"while a {long_prompt}-token prompt was prefilled ({prefill}; its TTFT {ttft}; {len(long)} gaps): "
            f"{fig(long)}: p99 {p_long / p_base:.2f}x the baseline's {p_base * 1e3:.1f} ms (both runs alone pooled; "
            f"target <= 3x: {'met' if p_long <= 3 * p_base else '**missed**'}), median {m_long / m_base:.2f}x"]


def options_prefill_graphs() -> bool:
    """Whether the server (which inherits this environment) runs captured prompt chunks (EXLPY_PREFILL_GRAPHS)."""
    return os.environ.get("EXLPY_PREFILL_GRAPHS", "1") != "0"


def part_load(model: str, key: str, port: int, load: Load, max_seq_len: int, decoders: int,
              long_prompt: int, shape: tuple[int, int] = (512, 384), server_args: list[str] | None = None,
              clients: int = 4, crowd: int = 128) -> list[str]:
    """benchmarks/serving.py's `load` part: the server (default cache) and the generator on the same load, the
    stall check, one report section."""
    import gc

    import torch

    from exlpy import ExLlamaV2Config

    lo, hi = load.prompts
    fig_s, facts = run_server(model, load, port, None, max_seq_len, f"/tmp/exlpy_serve_{key}.log",
                              extra=server_args, stall=(decoders, long_prompt, shape), clients=clients,
                              crowd=crowd)
    print(fig_s.line(), flush=True)
    h0, h1 = facts["health_start"], facts["health_end"]
    cache = load.streams * (hi + load.max_tokens)
    gen = load_generator(model, -(-cache // 256) * 256, max_seq_len, None)
    fig_g = run_generator(gen, load, ExLlamaV2Config(model).vocab_size)
    print(fig_g.line(), flush=True)
    del gen
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    ratio = fig_s.tok_s / fig_g.tok_s
    ttft_ok = statistics.median(fig_s.ttft) <= 2.0 and pct(fig_s.ttft, 0.99) <= 6.0
    lines = [f"## Load: {load.streams} streams, prompts {lo}-{hi} tokens, max_tokens {load.max_tokens} ({key})", "",
             f"Server: `exlpy serve --model {model} --max-seq-len {max_seq_len} {' '.join(server_args or [])}` "
             "with its default cache: "
             f"{h0.get('cache_tokens', '?'):,} tokens ({h0.get('cache_source', '?')}; "
             f"{h0.get('cache_full_length_requests', '?')} full-length requests), batch up to "
             f"{h0.get('max_batch_size', '?')}; ready in {facts['startup_s']:.0f} s (warm-up included), "
             f"{h0.get('kernel_compiles_startup', '?')} Triton compiles at startup, "
             f"{h1.get('kernel_compiles_serving', '?')} while serving "
             f"{h1.get('kernel_compiles_serving_last') or ''}; preemptions {h1.get('preemptions', '?')}.", "",
             f"- {fig_s.line()}", f"- {fig_g.line()}",
             f"- server / generator: {ratio:.1%} (target >= 75%: {'met' if ratio >= 0.75 else '**missed**'}); "
             f"server TTFT p50 <= 2 s and p99 <= 6 s: {'met' if ttft_ok else '**missed**'}"]
    first, second = facts["first"]
    if first.chunks and second.chunks:
        r1, r2 = first.decode_rate(), second.decode_rate()
        ctx = max_seq_len
        lines.append(f"- first request after startup ({min(512, ctx // 2)}-token prompt, {min(256, ctx // 4)} "
                     f"tokens): {r1:,.1f} tok/s, TTFT "
                     f"{first.ttft * 1e3:.0f} ms; the next one {r2:,.1f} tok/s: {r1 / r2:.1%} (target >= 95%: "
                     f"{'met' if r1 >= 0.95 * r2 else '**missed**'})")
    else:
        lines.append(f"- first request after startup failed: {first.error or second.error}")
    if "crowd" in facts:
        lines.append(crowd_line(facts["crowd"], crowd, load, facts.get("health_crowd", {}),
                                facts.get("health_before_crowd", {})))
    alone, long, extra, after = facts["stall"]
    lines += stall_lines(alone, long, extra, long_prompt, decoders, shape, after) + [""]
    print("\n".join(lines), flush=True)
    return lines


def crowd_line(fig: Figures, n: int, load: Load, h: dict[str, Any], before: dict[str, Any]) -> str:
    """The report line of the crowd: how many of its streams completed, failed (typed errors) or were refused, the
    preemptions it caused, and whether the cache could hold them all at once."""
    lo, hi = load.prompts
    need = n * (hi + load.max_tokens)
    cache = h.get("cache_tokens")
    fits = isinstance(cache, int) and cache >= need
    pre = h.get("preemptions", 0) - before.get("preemptions", 0) if isinstance(h.get("preemptions"), int) else "?"
    ok = fig.failed == 0
    return (f"- {n} streams (prompts {lo}-{hi}, max_tokens {load.max_tokens}) with the default cache: "
            f"{n - fig.failed} completed, {fig.failed} failed; {fig.tok_s:,.1f} tok/s, TTFT p50 "
            f"{statistics.median(fig.ttft) if fig.ttft else float('nan'):.2f} s; preemptions {pre}; the cache "
            f"({cache if cache is not None else '?'} tokens) {'holds' if fits else 'does not hold'} all of them at "
            f"their longest ({need:,}) (target: all complete, none refused while the cache has room: "
            f"{'met' if ok else '**missed**'})")


def load_generator(model_dir: str, cache_size: int, max_seq_len: int | None, max_batch_size: int | None) -> Any:
    from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Tokenizer
    from exlpy.generator import ExLlamaV2DynamicGenerator

    config = ExLlamaV2Config(model_dir)
    if max_seq_len:
        config.max_seq_len = max_seq_len
    model = ExLlamaV2(config)
    cache = ExLlamaV2Cache(model, max_seq_len=cache_size, lazy=True)
    model.load_autosplit(cache, progress=False)
    chunk = max(256, config.max_input_len // 256 * 256)
    gen = ExLlamaV2DynamicGenerator(model, cache, ExLlamaV2Tokenizer(config), max_batch_size=max_batch_size,
                                    max_chunk_size=chunk)
    gen.warmup()
    return gen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--prompts", default="100,2000", help="prompt length range LO,HI")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--cache-size", type=int, default=None, help="both runs' cache (default for the generator: "
                    "every request's prompt and tokens; for the server: its own default)")
    ap.add_argument("--max-seq-len", type=int, default=None)
    ap.add_argument("--port", type=int, default=8766)
    ap.add_argument("--parts", default="server,generator")
    ap.add_argument("--clients", type=int, default=1, help="client processes sharing the streams")
    ap.add_argument("--server-args", action="append", default=[],
                    help="more `exlpy serve` arguments as one string; repeat the option to run the server part once "
                         "per string (A/B in one session), e.g. --server-args '' --server-args "
                         "'--max-prefill-per-step 2048'")
    args = ap.parse_args()
    lo, hi = (int(x) for x in args.prompts.split(","))
    load = Load(args.streams, (lo, hi), args.max_tokens)
    out = []
    if "server" in args.parts:
        for extra in args.server_args or [""]:
            fig, _ = run_server(args.model, load, args.port, args.cache_size, args.max_seq_len,
                                "/tmp/exlpy_serve_load.log", extra=extra.split(), clients=args.clients)
            out.append((extra, fig))
            print(f"server args '{extra}':", fig.line(), flush=True)
    if "generator" in args.parts:
        cache = args.cache_size or -(-(args.streams * (hi + args.max_tokens)) // 256) * 256
        from exlpy import ExLlamaV2Config

        gen = load_generator(args.model, cache, args.max_seq_len, None)
        direct = run_generator(gen, load, ExLlamaV2Config(args.model).vocab_size)
        print(direct.line(), flush=True)
        for extra, fig in out:
            print(f"server args '{extra}' / generator: {fig.tok_s / direct.tok_s:.1%}")


if __name__ == "__main__":
    main()
