"""Tensor-parallel split arithmetic (spec §7.2): pure functions of sizes and per-device budgets.

No torch, no devices: the planner is testable on its own. Budgets are MiB; a split is a list of
`(slot, start, end)` entries, one per slot with a non-zero share, contiguous and covering `[0, total)`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from exlpy.errors import GpuSplitError, TensorParallelError
from exlpy.parallel.costs import ModelShape

Split = list[tuple[int, int, int]]

# Broadcast-type ids: which split a tensor's last dimension follows.
BROADCAST_KV = 0
BROADCAST_ID = 1
BROADCAST_VC = 2
BROADCAST_RS = 3
BROADCAST_Q = 4


def integer_split(x: int, weights: Sequence[float], minimum: int = 0) -> list[int]:
    """Split `x` units over `weights` proportionally; shares below `minimum` are folded into others.

    Largest-remainder rounding first (every share within one unit of its exact proportion), then every share
    under `minimum` is zeroed and its units go one at a time to the currently smallest non-zero share.
    """
    if x < 0:
        raise ValueError(f"integer_split: x must be >= 0, got {x}")
    if not weights or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise GpuSplitError(f"split weights must be non-negative with a positive sum, got {list(weights)}")
    total = float(sum(weights))
    exact = [x * w / total for w in weights]
    parts = [math.floor(e) for e in exact]
    rem = [e - p for e, p in zip(exact, parts)]
    for _ in range(x - sum(parts)):
        i = max(range(len(rem)), key=lambda j: rem[j])
        parts[i] += 1
        rem[i] -= 1.0
    if minimum > 0:
        freed = 0
        for i, p in enumerate(parts):
            if 0 < p < minimum:
                freed += p
                parts[i] = 0
        if freed:
            if not any(parts):
                # Nothing reached the minimum: everything goes to the largest budget.
                parts[max(range(len(weights)), key=lambda j: weights[j])] = freed
            else:
                for _ in range(freed):
                    i = min((j for j, p in enumerate(parts) if p > 0), key=lambda j: parts[j])
                    parts[i] += 1
    return parts


def to_ranges(counts: Sequence[int], unit: int = 1, total: int | None = None) -> Split:
    """Counts per slot -> `(slot, start, end)` ranges in units of `unit`, the last clipped to `total`."""
    out: Split = []
    pos = 0
    for slot, c in enumerate(counts):
        if c <= 0:
            continue
        end = pos + c * unit
        out.append((slot, pos, end if total is None else min(end, total)))
        pos = end
    return out


@dataclass(frozen=True)
class SplitPlan:
    kv: Split
    q: Split
    id: Split
    rs: Split
    vc: Split
    budgets_left: tuple[float, ...]  # MiB per slot after the cache and attention weights


def cache_mib(shape: ModelShape, bytes_per_element: float, tokens: int) -> float:
    """Expected K+V cache size in MiB for `tokens` tokens over all layers and KV heads."""
    return 2 * bytes_per_element * shape.num_kv_heads * shape.head_dim * shape.num_layers * tokens / 1024**2


def plan_split(budgets_mib: Sequence[float], shape: ModelShape, cache_bpe: float, cache_tokens: int,
               attn_weight_bytes: Sequence[int]) -> SplitPlan:
    """The five splits of spec §7.2 for the given per-slot budgets (MiB)."""
    budgets = [float(b) for b in budgets_mib]
    if not budgets:
        raise GpuSplitError("gpu_split is empty")
    for i, b in enumerate(budgets):
        if not math.isfinite(b) or b <= 0:
            raise TensorParallelError(f"gpu_split entry {i} is {b} MiB: every device in a tensor-parallel "
                                      "split needs a positive budget (drop the entry to leave it out)")
    if shape.num_heads % shape.num_kv_heads:
        raise TensorParallelError(f"num_attention_heads {shape.num_heads} is not a multiple of "
                                  f"num_key_value_heads {shape.num_kv_heads}")
    if shape.intermediate_size % 128:
        raise TensorParallelError(f"Model intermediate size must be divisible by 128 (intermediate_size = "
                                  f"{shape.intermediate_size})")
    kv_counts = integer_split(shape.num_kv_heads, budgets)
    for slot, c in enumerate(kv_counts):
        if c == 0:
            raise TensorParallelError(
                f"gpu_split {list(budgets_mib)} leaves device {slot} with no KV head ({shape.num_kv_heads} KV "
                f"heads over {len(budgets)} devices); give it a larger share or use fewer devices")
    groups = shape.num_heads // shape.num_kv_heads
    ratios = [c / shape.num_kv_heads for c in kv_counts]
    cache = cache_mib(shape, cache_bpe, cache_tokens)
    budgets = [max(0.0, b - int(cache * r)) for b, r in zip(budgets, ratios)]
    for wb in attn_weight_bytes:
        budgets = [max(0.0, b - int(wb * r / 1024**2)) for b, r in zip(budgets, ratios)]
    # Everything left may be zero (an over-full plan): split the rest evenly rather than failing here.
    rest = budgets if sum(budgets) > 0 else [1.0] * len(budgets)
    id_counts = integer_split(shape.intermediate_size // 128, rest, minimum=2)
    rs_counts = integer_split(math.ceil(shape.hidden_size / 32), rest, minimum=8)
    vc_counts = integer_split(math.ceil(shape.vocab_size / 32), rest, minimum=16)
    return SplitPlan(
        kv=to_ranges(kv_counts),
        q=to_ranges([c * groups for c in kv_counts]),
        id=to_ranges(id_counts, 128, shape.intermediate_size),
        rs=to_ranges(rs_counts, 32, shape.hidden_size),
        vc=to_ranges(vc_counts, 32, shape.vocab_size),
        budgets_left=tuple(budgets),
    )
