"""Diagnostics for benchmarks/tp.py: where prefill and decode time goes, on one GPU and tensor-parallel.

- `flop_model`: GEMM + attention FLOPs of a prefill and the bytes a decode step must read, per device.
- `single_phases`: one-GPU prefill timed per module with CUDA events (embedding, attention, MLP, head).
- `sync_check`: runs a callable under `torch.cuda.set_sync_debug_mode("warn")` and reports every host sync.
- `top_kernels`: the torch profiler's most expensive CUDA kernels of one call.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from exlpy.model import run_module
from exlpy.model.attention import Attention
from exlpy.model.batch import contiguous_batch
from exlpy.model.embedding import Embedding
from exlpy.model.mlp import MLP


def flop_model(cfg: Any, tokens: int, n: int) -> dict[str, Any]:
    """FLOPs of a `tokens`-long prefill (last-row head) and the weight bytes of a decode step, for n devices."""
    h, i, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    hq, hk = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    params_layer = h * (hq + 2 * hk) + hq * h + 3 * h * i
    gemm = 2 * params_layer * L * tokens
    attn = 2 * 2 * hq * tokens * tokens // 2 * L  # QK^T and PV, causal half
    head = 2 * h * cfg.vocab_size
    total = gemm + attn + head
    weight_bytes = 2 * (params_layer * L + h * cfg.vocab_size)
    allreduce_bytes = 2 * tokens * h
    return {"prefill_tflop": round(total / 1e12, 2), "prefill_tflop_per_device": round(total / n / 1e12, 2),
            "decode_weight_GB": round(weight_bytes / 1e9, 2), "decode_weight_GB_per_device":
            round(weight_bytes / n / 1e9, 2), "allreduces_per_forward": 2 * L,
            "allreduce_MiB_prefill": round(allreduce_bytes / 2**20, 1)}


@torch.inference_mode()
def single_phases(model: Any, cache: Any, ids: torch.Tensor, repeats: int = 3) -> dict[str, Any]:
    """One-GPU prefill (last-row head) with an event around every module; the fastest of `repeats` runs."""
    dev = model.modules[0].device
    ids = ids.to(dev)
    B, T = ids.shape
    best: dict[str, Any] | None = None
    for _ in range(repeats):
        cache.current_seq_len = 0
        batch = contiguous_batch(B, T, 0, cache, cache.max_seq_len, dev)
        evs: list[tuple[str, Any, Any]] = []
        x = ids
        for idx, m in enumerate(model.modules):
            if idx == model.head_layer_idx - 1:
                x = x[:, -1:]
            kind = ("embed" if isinstance(m, Embedding) else "attn" if isinstance(m, Attention) else
                    "mlp" if isinstance(m, MLP) else "head")
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            x = run_module(m, x, batch)
            b.record()
            evs.append((kind, a, b))
        torch.cuda.synchronize(dev)
        kinds: dict[str, float] = {}
        for kind, a, b in evs:
            kinds[kind] = kinds.get(kind, 0.0) + a.elapsed_time(b)
        total = evs[0][1].elapsed_time(evs[-1][2])
        res = {"total_ms": round(total, 3), "by_kind_ms": {k: round(v, 3) for k, v in kinds.items()}}
        if best is None or total < best["total_ms"]:
            best = res
    cache.current_seq_len = 0
    assert best is not None
    return best


def _sync_all(n: int) -> None:
    for i in range(n):
        torch.cuda.synchronize(i)


def sync_check(fn: Callable[[], Any], n: int) -> dict[str, Any]:
    """Host synchronisations inside `fn` (each one stalls the one Python thread that feeds every GPU)."""
    _sync_all(n)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    msgs = [str(w.message).splitlines()[0][:200] for w in caught if "synchroniz" in str(w.message).lower()]
    _sync_all(n)
    return {"syncs": len(msgs), "first": msgs[:3]}


def top_kernels(fn: Callable[[], Any], n: int, rows: int = 12) -> list[dict[str, Any]]:
    """The `rows` CUDA kernels with the most device time in one call of `fn` (summed over devices)."""
    from torch.profiler import ProfilerActivity, profile

    _sync_all(n)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        _sync_all(n)
    out = []
    evs = [e for e in prof.key_averages() if getattr(e, "device_time_total", 0) > 0 and e.key[:5] != "aten:"]
    for e in sorted(evs, key=lambda e: -e.device_time_total)[:rows]:
        out.append({"kernel": e.key[:90], "calls": e.count, "ms": round(e.device_time_total / 1e3, 3)})
    return out


def host_ms(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3
