"""`exlpy bench`: decode and prefill speed of a model directory, against the memory-bandwidth limit.

Decode at batch 1 reads every weight once per token, so tokens/s is bounded by bandwidth ÷ bytes read
(weights, less the embedding table of which one row is gathered, plus the K/V read so far). The timing
functions here are also what benchmarks/decode.py reports.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

import torch

from exlpy.errors import ConfigError, DeviceError


@dataclass
class DecodeResult:
    batch: int
    prompt_len: int
    gen_len: int
    seconds: float
    bytes_per_step: float  # average bytes a step reads (weights + K/V)

    @property
    def tokens_per_s(self) -> float:
        return self.batch * self.gen_len / self.seconds

    def bandwidth(self) -> float:
        """Achieved bytes/s: bytes read per step × steps ÷ time."""
        return self.bytes_per_step * self.gen_len / self.seconds


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="decode/prefill tokens/s of a model and its fraction of the bandwidth limit")
    p.add_argument("--model", "-m", required=True, help="model directory (fp16, EXL2 or GPTQ)")
    p.add_argument("--batch", type=int, nargs="+", default=[1], help="decode batch sizes (default: 1)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=256)
    p.add_argument("--prefill", type=int, default=2048, help="prefill length to time (0: skip)")
    p.add_argument("--no-graphs", action="store_true", help="eager decode (no CUDA graphs)")
    p.set_defaults(_run=run)


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise DeviceError("exlpy bench needs a CUDA device")
    if args.prompt_len < 1 or args.gen_len < 1 or min(args.batch) < 1:
        raise ConfigError("--prompt-len, --gen-len and --batch must be positive")
    bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth: {bw / 1e12:.2f} TB/s")
    seq = max(args.prompt_len + args.gen_len + 16, args.prefill)
    model = load_model(args.model, seq, max(args.batch), args.no_graphs)
    print(f"{'batch':>5} {'prompt':>6} {'gen':>5} {'tok/s':>9} {'ms/step':>8} {'TB/s':>6} {'of limit':>8}")
    for b in args.batch:
        r = time_decode(model, b, args.prompt_len, args.gen_len)
        print(f"{b:>5} {args.prompt_len:>6} {args.gen_len:>5} {r.tokens_per_s:>9.1f} "
              f"{1e3 * r.seconds / r.gen_len:>8.3f} {r.bandwidth() / 1e12:>6.2f} {r.bandwidth() / bw:>8.1%}")
    if args.prefill:
        tps = time_prefill(model, args.prefill)
        print(f"prefill {args.prefill} tokens: {tps:,.0f} tokens/s")
    return 0


def load_model(path: str, max_seq_len: int, max_batch: int = 1, no_graphs: bool = False) -> Any:
    from exlpy import ExLlamaV2, ExLlamaV2Config

    config = ExLlamaV2Config(path)
    config.max_seq_len = max_seq_len
    config.max_batch_size = max_batch
    config.no_graphs = no_graphs
    model = ExLlamaV2(config)
    dev = torch.device("cuda:0")
    for i in range(len(model.modules)):  # everything on one GPU: the case the bandwidth limit describes
        model.place_module(i, dev)
    model.loaded = True
    return model


def weight_bytes_read(model: Any) -> int:
    """Weight bytes one token of a decode step reads: everything but the embedding table (one row of it is
    gathered), an MoE block's k routed experts rather than all of them (at batch 1 the bandwidth limit)."""
    return sum(m.active_weight_bytes() for m in model.modules[1:])


def kv_bytes_per_token(model: Any, bytes_per_element: float = 2.0) -> float:
    c = model.config
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * bytes_per_element


def copy_bandwidth(gib: float = 2.0, reps: int = 10) -> float:
    """Device-to-device copy rate (bytes read + written per second): the practical ceiling."""
    n = int(gib * 2**30) // 2
    a = torch.empty(n, dtype=torch.float16, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        b.copy_(a)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    del a, b
    return 2 * n * 2 * reps / dt


def time_decode(model: Any, batch: int, prompt_len: int, gen_len: int, warmup: int = 4) -> DecodeResult:
    """Greedy decode of `gen_len` tokens after a random `prompt_len` prompt, `batch` rows, via model.forward.

    Argmax stays on the GPU and tokens are read back once at the end, so the host can run ahead of the GPU.
    """
    from exlpy import ExLlamaV2Cache

    cache = ExLlamaV2Cache(model, batch_size=batch, max_seq_len=prompt_len + gen_len + warmup)
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), device="cuda", generator=g)
    logits = model.forward(ids, cache, last_id_only=True)
    first = logits[:, -1].argmax(-1, keepdim=True)
    tok = first
    for _ in range(warmup):  # captures the graph for this batch size
        tok = model.forward(tok, cache)[:, -1].argmax(-1, keepdim=True)
    cache.current_seq_len = prompt_len
    out = torch.empty(batch, gen_len, dtype=torch.long, device="cuda")
    tok = first
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(gen_len):
        tok = model.forward(tok, cache)[:, -1].argmax(-1, keepdim=True)
        out[:, i:i + 1] = tok
    out.cpu()
    dt = time.perf_counter() - t0
    avg_ctx = prompt_len + (gen_len + 1) / 2
    step_bytes = weight_bytes_read(model) + batch * avg_ctx * kv_bytes_per_token(model)
    del cache
    return DecodeResult(batch, prompt_len, gen_len, dt, step_bytes)


def time_prefill(model: Any, n_tokens: int, reps: int = 3) -> float:
    """Tokens/s of one forward over `n_tokens` into an empty cache (only the last position's logits)."""
    from exlpy import ExLlamaV2Cache

    cache = ExLlamaV2Cache(model, batch_size=1, max_seq_len=n_tokens)
    ids = torch.randint(0, model.config.vocab_size, (1, n_tokens), device="cuda")
    best = float("inf")
    for _ in range(reps + 1):
        cache.current_seq_len = 0
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.forward(ids, cache, last_id_only=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    del cache
    return n_tokens / best
