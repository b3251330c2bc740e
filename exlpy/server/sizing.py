"""How large `exlpy serve` makes the KV cache when `--cache-size` is not given.

On GPUs the cache takes what is left of `--gpu-memory-utilization` (default 0.9) of each device's memory after
the weights, the activations of the largest step, the outputs of the decode graphs the warm-up captures and a
margin (RUNTIME_MARGIN, more with captured prompt chunks);
the device that fills first (per token, its layers' K/V) sets the size. On the CPU it holds 8 full-length
requests (at least 2048 tokens), at most a quarter of the memory available. Either way it holds at least one
full-length request, or the server refuses to start and says what to change.

`plan_tokens` is the arithmetic alone (plain numbers in, tested on CPU); `measure_and_size` takes them from a
loaded model whose placeholder cache (sized as one context) reserved room during placement.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from exlpy.config.values import MAX_POSITIONS
from exlpy.errors import ConfigError
from exlpy.runtime import options

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# Kept free beyond the measured reserve, as a share of each GPU's memory: cuBLAS handles and workspaces (created
# with plain cudaMalloc), the captured sampler's buffers, allocator fragmentation. Captured prompt chunks
# (EXLPY_PREFILL_GRAPHS=1) keep their graphs' activations too. On an H100 with an 8B fp16 model (2026-11-26) the
# graph pools held 4.05 GiB with captured chunks where the reserve counted ~1 GiB of graph outputs, and the
# allocator 2.8 GiB of free blocks: the cache left 8 MiB, and every job failed to create a cuBLAS handle.
RUNTIME_MARGIN = 0.02
CHUNK_GRAPHS_MARGIN = 0.04
CPU_FULL_REQUESTS = 8  # a CPU default cache holds this many full-length requests
CPU_MEMORY_SHARE = 0.25  # ...but takes at most this share of the memory available


@dataclass(frozen=True)
class DeviceBudget:
    """One device's figures, in bytes: total memory, free now, what the placeholder cache holds there (freed
    before the real cache is allocated), what steps will still need on top (activations, graph outputs), and
    its layers' K/V bytes per token."""

    name: str
    total: int
    free: int
    placeholder: int
    reserve: int
    kv_per_token: float


@dataclass(frozen=True)
class CachePlan:
    tokens: int
    source: str  # "--cache-size", "free GPU memory (utilization 0.9)", "CPU default"
    bytes: int
    max_seq_len: int
    page_size: int = 256

    @property
    def full_requests(self) -> int:
        """Requests of the full context length that fit at once (each holds whole pages)."""
        return (self.tokens // self.page_size) // -(-self.max_seq_len // self.page_size)

    def describe(self) -> str:
        page_size = self.page_size
        size = f"{self.bytes / 2**30:.2f} GiB" if self.bytes >= 2**30 else f"{self.bytes / 2**20:.1f} MiB"
        return (f"KV cache {self.tokens:,} tokens ({self.tokens // page_size} pages of {page_size}, "
                f"{size}; {self.source}): {self.full_requests} request(s) of the full "
                f"{self.max_seq_len}-token context fit at once, more shorter ones")

    def as_dict(self) -> dict[str, Any]:
        return {"cache_source": self.source, "cache_bytes": self.bytes,
                "cache_full_length_requests": self.full_requests}


def round_down(tokens: float, page_size: int) -> int:
    return int(tokens) // page_size * page_size


def plan_tokens(devices: list[DeviceBudget], utilization: float, page_size: int) -> int:
    """Tokens the cache may hold: per device, (utilization x total) minus what is in use (total - free) plus the
    placeholder that goes away, minus the reserve, over that device's K/V bytes per token; the smallest device
    decides. Whole pages; may be 0 (the caller says why that is not enough)."""
    if not 0 < utilization <= 1:
        raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    best: float | None = None
    for d in devices:
        if d.kv_per_token <= 0:
            continue
        room = utilization * d.total - (d.total - d.free) + d.placeholder - d.reserve
        t = max(0.0, room) / d.kv_per_token
        best = t if best is None else min(best, t)
    return round_down(best or 0, page_size)


def cpu_default_tokens(max_seq_len: int, kv_per_token: float, available: int, page_size: int,
                       floor: int = 2048) -> int:
    """CPU_FULL_REQUESTS full-length requests, at most CPU_MEMORY_SHARE of `available` bytes, at least one
    request and `floor` tokens (whole pages)."""
    want = max(CPU_FULL_REQUESTS * max_seq_len, floor)
    cap = CPU_MEMORY_SHARE * available / kv_per_token if kv_per_token > 0 else want
    one = -(-max_seq_len // page_size) * page_size
    return max(one, round_down(min(want, cap), page_size))


def available_ram() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30


def graph_output_bytes(rows_and_widths: list[tuple[int, int]], vocab: int, hidden: int) -> int:
    """Memory the captured decode graphs keep for their static outputs (fp32 logits and a hidden state per
    row), one set per captured (rows, width) shape."""
    return sum(rows * (vocab * 4 + hidden * 4) for rows, _ in rows_and_widths)


def caches_per_token(caches: list[Any]) -> dict[str, float]:
    """K/V bytes per token on each device, over the caches given (a model's and its draft model's)."""
    out: dict[str, float] = {}
    for c in caches:
        for dev, n in c.footprint().items():
            out[dev] = out.get(dev, 0.0) + n / c.max_seq_len
    return out


def measure_prefill_peak(model: Any, cache: Any, chunk: int, page_size: int) -> dict[str, int]:
    """Activation bytes a prompt chunk of `chunk` tokens needs on each device beyond what is allocated now
    (one prefill forward through the placeholder cache, at its end)."""
    from exlpy.model.batch import paged_batch

    devs = sorted({str(t.device) for t in cache.all_tensors()})
    base = {d: torch.cuda.memory_allocated(d) for d in devs}
    for d in devs:
        torch.cuda.reset_peak_memory_stats(d)
    pages = cache.max_seq_len // page_size
    end = min(cache.max_seq_len, model.config.max_seq_len)
    chunk = max(1, min(chunk, end - 1))
    start = max(0, end - chunk - 1)
    ids = torch.randint(3, model.config.vocab_size, (1, chunk))
    first = torch.device(devs[0]) if devs else torch.device("cuda")
    with torch.inference_mode():
        model.forward_batch(ids, paged_batch([(list(range(pages)), start, chunk)], cache, first, page_size),
                            preprocess_only=True)
    out = {}
    for d in devs:
        torch.cuda.synchronize(d)
        out[d] = max(0, torch.cuda.max_memory_allocated(d) - base[d])
    torch.cuda.empty_cache()
    return out


def measure_and_size(model: Any, caches: list[Any], utilization: float, page_size: int, chunk: int,
                     decode_shapes: list[tuple[int, int]], max_seq_len: int) -> CachePlan:
    """The cache size for a model loaded on GPUs with placeholder `caches` (the first is the model's own)."""
    per_token = caches_per_token(caches)
    peak = measure_prefill_peak(model, caches[0], chunk, page_size)
    head = str(model.modules[model.head_layer_idx].device)
    cfg = model.config
    budgets = []
    for dev, kv in per_token.items():
        free, total = torch.cuda.mem_get_info(torch.device(dev))
        placeholder = sum(c.footprint().get(dev, 0) for c in caches)
        reserve = peak.get(dev, 0) + (graph_output_bytes(decode_shapes, cfg.vocab_size, cfg.hidden_size)
                                      if dev == head else 0)
        reserve += (RUNTIME_MARGIN + (CHUNK_GRAPHS_MARGIN if options().prefill_graphs else 0.0)) * total
        budgets.append(DeviceBudget(dev, int(total), int(free), placeholder, int(reserve), kv))
    tokens = plan_tokens(budgets, utilization, page_size)
    if tokens < max_seq_len:
        detail = "; ".join(f"{b.name}: {b.free / 2**30:.1f} of {b.total / 2**30:.1f} GiB free, "
                           f"{b.reserve / 2**30:.2f} GiB kept for activations and graphs" for b in budgets)
        raise ConfigError(f"the KV cache that fits (--gpu-memory-utilization {utilization}) holds {tokens} tokens, "
                          f"less than one request of the {max_seq_len}-token context ({detail}). Pass a smaller "
                          "--max-seq-len, a higher --gpu-memory-utilization, or --cache-size explicitly")
    source = f"free GPU memory, utilization {utilization}"
    if tokens > MAX_POSITIONS:  # a small model on a large GPU: a cache holds at most this many positions
        tokens = round_down(MAX_POSITIONS, page_size)
        source += f", capped at {tokens:,} tokens (the cache's limit)"
    total_bytes = int(sum(per_token.values()) * tokens)
    return CachePlan(tokens, source, total_bytes, max_seq_len, page_size)
