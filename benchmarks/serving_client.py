"""The `exlpy serve` half of benchmarks/serving.py: a server subprocess driven by the official openai client.

Every request is a streamed /v1/completions call with a token-id prompt (exact lengths), temperature 0 and the
EOS token banned (random weights would otherwise end streams at random), so every stream runs to max_tokens.
Times are taken where the client receives each chunk; inter-token latency is the gap between consecutive
chunks of one stream, pooled over streams.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NO_EOS = {"2": -100}


@dataclass
class Sizes:
    """Request shapes of the server scenarios."""

    one_prompt: int = 512
    one_tokens: int = 256
    many: int = 64
    many_prompts: tuple[int, int] = (100, 2000)
    many_tokens: int = 256
    decoders: int = 32
    decoder_prompt: int = 512
    decoder_tokens: int = 384
    long_prompt: int = 16384
    cache_tokens: int = 163840
    context: int = 20480


FULL = Sizes()
QUICK = Sizes(many=16, many_prompts=(100, 500), decoders=8, long_prompt=2048, cache_tokens=32768, context=4096)


@dataclass
class Stream:
    sent: float = 0.0
    chunks: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.chunks[0] - self.sent

    def gaps(self, start: float = 0.0, end: float = float("inf")) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:]) if start <= b <= end]

    def decode_rate(self) -> float:
        """Tokens per second after the first chunk (a chunk may carry several tokens when the server's stream
        fell behind the generator and merged them)."""
        n = self.tokens if self.tokens else len(self.chunks)
        return (n - 1) / (self.chunks[-1] - self.chunks[0])


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def start_server(model: str, port: int, cache_tokens: int | None, max_seq_len: int, log: str,
                 extra: list[str] | None = None) -> subprocess.Popen:
    """`exlpy serve` in a subprocess, returned once /health says ok; `cache_tokens` None: the server's default
    cache (sized from free GPU memory)."""
    cmd = [sys.executable, "-m", "exlpy", "serve", "--model", model, "--port", str(port), "--max-seq-len",
           str(max_seq_len), "--max-queue", "1024", "--log-level", "warning", *(extra or [])]
    if cache_tokens is not None:
        cmd += ["--cache-size", str(cache_tokens)]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env={**os.environ})
    t0 = time.time()
    while time.time() - t0 < 600:
        if proc.poll() is not None:
            tail = Path(log).read_text(errors="replace")[-3000:]
            raise RuntimeError(f"exlpy serve exited ({proc.returncode}); {log} ends with:\n{tail}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if json.loads(r.read())["status"] == "ok":
                    return proc
        except OSError:
            time.sleep(1.0)
    proc.kill()
    raise RuntimeError(f"exlpy serve did not come up in 600 s; see {log}")


async def stream(client: Any, model: str, ids: list[int], max_tokens: int, out: Stream) -> Stream:
    out.sent = time.perf_counter()
    try:
        s = await client.completions.create(model=model, prompt=ids, max_tokens=max_tokens, temperature=0,
                                            logit_bias=NO_EOS, stream=True, stream_options={"include_usage": True})
        async for chunk in s:
            if chunk.choices and chunk.choices[0].text:
                out.chunks.append(time.perf_counter())
            if chunk.usage is not None:
                out.tokens = chunk.usage.completion_tokens
    except Exception as e:  # reported, not raised: "all streams complete" is one of the results
        out.error = f"{type(e).__name__}: {e}"
    return out


def prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


async def scenarios(port: int, name: str, vocab: int, z: Sizes) -> dict[str, Any]:
    import httpx
    import openai

    rng = random.Random(0)
    http = httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256, max_keepalive_connections=256))
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", http_client=http,
                                max_retries=0)
    res: dict[str, Any] = {}
    await stream(client, name, prompt(rng, 64, vocab), 16, Stream())  # warm the server path
    res["one"] = await stream(client, name, prompt(rng, z.one_prompt, vocab), z.one_tokens, Stream())

    t0 = time.perf_counter()
    many = [Stream() for _ in range(z.many)]
    await asyncio.gather(*[stream(client, name, prompt(rng, rng.randint(*z.many_prompts), vocab), z.many_tokens, s)
                           for s in many])
    res["many"], res["many_wall"] = many, time.perf_counter() - t0

    for label in ("baseline", "long"):
        dec = [Stream() for _ in range(z.decoders)]
        tasks = [asyncio.ensure_future(stream(client, name, prompt(rng, z.decoder_prompt, vocab), z.decoder_tokens, s))
                 for s in dec]
        extra = Stream()
        if label == "long":
            while min(len(s.chunks) for s in dec) < 32 and not all(t.done() for t in tasks):
                await asyncio.sleep(0.005)
            await stream(client, name, prompt(rng, z.long_prompt, vocab), 8, extra)
        await asyncio.gather(*tasks)
        res[label], res[label + "_extra"] = dec, extra
    await http.aclose()
    return res


def part_server(model: str, key: str, port: int, gen_speed: float | None, quick: bool,
                sizes: Sizes | None = None) -> list[str]:
    from exlpy import ExLlamaV2Config

    z = sizes or (QUICK if quick else FULL)
    vocab = ExLlamaV2Config(model).vocab_size
    log = f"/tmp/exlpy_serve_{key}.log"
    proc = start_server(model, port, z.cache_tokens, z.context, log)
    try:
        r = asyncio.run(scenarios(port, os.path.basename(os.path.normpath(model)), vocab, z))
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return report(r, z, model, key, log, gen_speed)


def report(r: dict[str, Any], z: Sizes, model: str, key: str, log: str, gen_speed: float | None) -> list[str]:
    one, many = r["one"], r["many"]
    lines = [f"## `exlpy serve` driven by AsyncOpenAI (streaming), {key}", "",
             f"Server: `exlpy serve --model {model} --cache-size {z.cache_tokens} --max-seq-len {z.context}`; "
             f"log {log}.", ""]
    rate = one.decode_rate() if not one.error and len(one.chunks) > 1 else float("nan")
    target = (f"{rate / gen_speed:.1%} of the generator's batch-1 greedy {gen_speed:,.1f} tok/s (target >= 95%: "
              f"{'met' if rate >= 0.95 * gen_speed else '**missed**'})") if gen_speed else "(run part gen to compare)"
    lines += [f"- one stream, {z.one_prompt}-token prompt, {z.one_tokens} tokens: {rate:,.1f} tok/s after the first "
              f"token, TTFT {one.ttft * 1e3 if one.chunks else float('nan'):.0f} ms; {target}"
              + (f"; error {one.error}" if one.error else "")]
    done = [s for s in many if not s.error and s.tokens == z.many_tokens and s.chunks]
    gaps = [g for s in done for g in s.gaps()]
    ttft = [s.ttft for s in done]
    lo, hi = z.many_prompts
    if done:
        lines.append(f"- {len(many)} concurrent streams, prompts of {lo}-{hi} tokens, max_tokens {z.many_tokens}: "
                     f"{len(done)}/{len(many)} complete; total {sum(s.tokens for s in done) / r['many_wall']:,.1f} "
                     f"tok/s; TTFT median {statistics.median(ttft) * 1e3:.0f} ms, p99 {pct(ttft, 0.99) * 1e3:.0f} "
                     f"ms; inter-token median {statistics.median(gaps) * 1e3:.1f} ms, p99 "
                     f"{pct(gaps, 0.99) * 1e3:.1f} ms")
    else:
        lines.append(f"- {len(many)} concurrent streams: none completed ({many[0].error})")
    for s in many:
        if s not in done:
            lines.append(f"  - a stream failed: {s.error or f'{s.tokens} tokens'}")
    base = [g for s in r["baseline"] for g in s.gaps()]
    extra: Stream = r["long_extra"]
    end = extra.chunks[0] if extra.chunks else float("inf")
    long_all = [g for s in r["long"] for g in s.gaps()]
    window = [g for s in r["long"] for g in s.gaps(extra.sent, end)]
    p_base, p_win = pct(base, 0.99), pct(window, 0.99)
    ttft_long = f"{extra.ttft:.2f} s" if extra.chunks else "none"
    met = "met" if p_win < 3 * p_base else "**missed**"
    lines += [f"- {z.decoders} decoding streams ({z.decoder_prompt}-token prompts, {z.decoder_tokens} tokens): "
              f"inter-token p99 {p_base * 1e3:.1f} ms (median {statistics.median(base) * 1e3:.1f} ms) alone; with a "
              f"{z.long_prompt}-token prompt arriving once each had 32 tokens: p99 {p_win * 1e3:.1f} ms while it was "
              f"prefilled ({len(window)} gaps; its TTFT {ttft_long}), {pct(long_all, 0.99) * 1e3:.1f} ms over the "
              f"whole run: {p_win / p_base:.2f}x (target < 3x: {met})"
              + (f"; long prompt error {extra.error}" if extra.error else ""), ""]
    print("\n".join(lines), flush=True)
    return lines
