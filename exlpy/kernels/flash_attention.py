"""Flash-style causal attention of a query block over the KV cache itself (prefill chunks, verify and decode steps).

One kernel serves contiguous caches ([B, S, Hkv, D] addressed as pages of S rows, block table [[b]]) and paged
ones (block table [B, P], any page size), fp16/bf16 and the quantized formats of kv_tiles (read at their own
width, dequantized in registers), with the K/V of earlier chunks: query row i of sequence b sees the keys
t <= positions[b, i], t < seqlens[b] (and key_mask[b, t] when given).

The G query heads that share a KV head are processed together, so every K/V tile is loaded once per group
(flash_kernel.py describes the work layout). Softmax is online in the log2 domain, accumulation in fp32.

Short query blocks (decode, speculative verification) leave too few programs to fill the GPU, so the key range
is split over `splits` programs whose partial results a second kernel combines (flash-decoding). Every bound is
read from device memory (seqlens, positions) and the launch grid depends only on host ints (shapes,
max_seqlen), so the kernel can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from exlpy.errors import ConfigError
from exlpy.kernels.flash_kernel import _flash_kernel
from exlpy.kernels.kv_tiles import FP8, INT, PLAIN, fmt_code, next_pow2
from exlpy.kernels.paged_attention import _combine_kernel
from exlpy.runtime import options

_LOG2E = 1.4426950408889634

# (BLOCK_M, BLOCK_N, num_warps, num_stages) by head_dim for long query blocks (prefill chunks). Chosen for the
# H100: BLOCK_M = 128 rows feed two warpgroups' wgmma with a [128, D] fp32 accumulator that fits the register
# file next to the [128, BLOCK_N] score tile; BLOCK_N = 64 keeps three K and V stages in shared memory at
# D = 128 (3 x 2 x 64 x 128 x 2 B = 96 KB, plus the q tile). Screened offline with ptxas for sm_90a
# (benchmarks/flash_compile_check.py): D 128 -> 228-254 registers, D 64 with 8 warps -> 174-186, no spills,
# two K/V tiles in flight (D 64 with 4 warps spills, as does BLOCK_N 128 at D 128). Not yet timed on a GPU:
# benchmarks/flash_sweep.py times the alternatives; EXLPY_FLASH_CONFIG="BM,BN,warps,stages" overrides the
# table for a run.
PREFILL_CONFIGS: dict[int, tuple[int, int, int, int]] = {
    64: (128, 64, 8, 3),
    128: (128, 64, 8, 3),
    256: (64, 32, 8, 2),
}
# Long query blocks over quantized caches (prefill chunks with a Q4/Q6/Q8/FP8 cache): the dequantized tiles
# and the fresh rows' second softmax state need registers: BLOCK_N 32 at D 128 (64 spills 144 bytes).
QUANT_PREFILL_CONFIGS: dict[int, tuple[int, int, int, int]] = {
    64: (128, 64, 8, 3),
    128: (128, 32, 8, 3),
    256: (64, 16, 8, 2),
}
# Short query blocks (<= 64 rows per KV head: decode, verify steps) are bound by the K/V read: small M tiles,
# 4 warps, keys split over programs. (BLOCK_N, num_warps, num_stages) per cache format.
DECODE_CONFIGS: dict[str, tuple[int, int, int]] = {"plain": (64, 4, 3), "quant": (64, 4, 3)}
SHORT_ROWS = 64
_MAX_SPLITS = 64
GROUP_PAGES = 8  # block-table entries read at once by the paged interior loop (2,048 keys of 256-token pages)


@dataclass
class KVOperand:
    """One of K or V as the kernel reads it: values (or codes), optional fp16 group scales, the format."""

    values: torch.Tensor
    scales: torch.Tensor | None
    fmt: int
    bits: int

    @property
    def row_stride(self) -> int:
        """Elements (code bytes) from one cache row (token slot) to the next."""
        return self.values.stride(-3) if self.fmt == PLAIN else self.values.stride(-2)

    def kv_heads(self, head_dim: int) -> int:
        if self.fmt == PLAIN:
            return self.values.shape[-2]
        return self.values.shape[-1] * 8 // (self.bits * head_dim)

    @property
    def srow_stride(self) -> int:
        return self.scales.stride(-2) if self.scales is not None else 0


def plain_operand(cache: torch.Tensor) -> KVOperand:
    if not cache.is_contiguous():
        raise ConfigError("attention kernels need contiguous K/V caches")
    return KVOperand(cache, None, PLAIN, 16)


def quant_operand(codes: torch.Tensor, scales: torch.Tensor | None, bits: int) -> KVOperand:
    fmt, bits = fmt_code(scales, bits)
    if not codes.is_contiguous() or (scales is not None and not scales.is_contiguous()):
        raise ConfigError("attention kernels need contiguous quantized K/V tensors")
    return KVOperand(codes, scales, fmt, bits)


@functools.lru_cache(maxsize=16)
def _sm_count(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # interpreter runs: the H100's count, so CPU tests take the same split decisions


def _config(D: int, rows: int, quant: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for this head size and query rows per KV head."""
    if rows <= SHORT_ROWS:
        bn, warps, stages = DECODE_CONFIGS["quant" if quant else "plain"]
        return max(16, next_pow2(rows)), bn, warps, stages
    override = options().flash_config
    if override is not None:
        return override
    table = QUANT_PREFILL_CONFIGS if quant else PREFILL_CONFIGS
    return table.get(next_pow2(max(D, 64)), table[256])


def num_splits(programs: int, bound: int, block_n: int, sms: int) -> int:
    """Key-range splits for `programs` (query tiles x KV heads): none once two waves are busy, else enough to
    fill about four waves, about no more than there are key blocks. A power of two, so that the combine
    kernel (which takes the count as a constexpr) has a handful of variants to compile, not one per length."""
    if programs >= 2 * sms:
        return 1
    n = min(triton.cdiv(4 * sms, max(programs, 1)), triton.cdiv(max(bound, 1), block_n), _MAX_SPLITS)
    return min(next_pow2(n), _MAX_SPLITS)


def flash_attention_launch(q: torch.Tensor, k: KVOperand, v: KVOperand, block_table: torch.Tensor,
                           page_size: int, seqlens: torch.Tensor, max_seqlen: int, positions: torch.Tensor,
                           scale: float, key_mask: torch.Tensor | None = None,
                           k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
                           config: tuple[int, int, int, int] | None = None, splits: int | None = None,
                           tma: bool | None = None, window: int = 0, softcap: float = 0.0,
                           limits: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q [B, T, Hq, D] over the cache operands; [B, T, Hq, D] in q's dtype.

    `max_seqlen` (a host-side bound of seqlens, or the cache capacity) only sizes the key-range split;
    `k_new`/`v_new` [B, T, Hkv, D]: this step's own K/V, read instead of the cache for keys at positions
    >= positions[b, 0] (the step's tokens sit at consecutive positions); `config` / `splits` override the
    tables (benchmarks/flash_sweep.py), `tma` the EXLPY_FLASH_TMA choice. `window` > 0: a sliding window
    (keys t > positions[b, i] - window); `softcap` > 0: scores soft-capped, cap * tanh(score / cap);
    `limits` [B, T]: query i sees keys up to limits[b, i] >= positions[b, i] (Gemma 3's image tokens).
    """
    B, T, hq, D = q.shape
    hk = k.kv_heads(D)
    if hk < 1 or hq % hk or v.kv_heads(D) != hk:
        raise ConfigError(f"{hq} query heads do not match the caches' K/V heads ({hk}, {v.kv_heads(D)})")
    G = hq // hk
    if (k.fmt == INT or v.fmt == INT) and (D < 32 or D & (D - 1)):
        raise ConfigError(f"quantized K/V caches need a power-of-two head_dim >= 32, got {D}")
    if not (q.stride(-1) == 1 and q.stride(-2) == D):
        q = q.contiguous()
    out = torch.empty((B, T, hq, D), dtype=q.dtype, device=q.device)
    if B * T == 0:
        return out
    bt = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    if bt.data_ptr() % 16:
        # A row of a larger table (one job's prefill chunk) can start off a 16-byte boundary, and Triton compiles
        # another variant for a pointer that is not 16-aligned: the serving warm-up cannot foresee which rows
        # those are (a request's compile stall, tests/test_serving_gpu.py). The copy is a few hundred bytes.
        bt = bt.clone()
    rows = T * G
    bm, bn, warps, stages = config or _config(D, rows, k.fmt != PLAIN or v.fmt != PLAIN)
    m_tiles = triton.cdiv(rows, bm)
    capacity = bt.shape[1] * page_size
    bound = max_seqlen if 0 < max_seqlen <= capacity else capacity
    n_split = splits or num_splits(m_tiles * B * hk, bound, bn, _sm_count(str(q.device)))
    part = lse = out
    if n_split > 1:
        part = torch.empty((B * T * hq * n_split, D), dtype=torch.float32, device=q.device)
        lse = torch.empty((B * T * hq * n_split,), dtype=torch.float32, device=q.device)
    mask = seqlens
    mask_len = mask_stride = 0
    if key_mask is not None:
        mask = key_mask if key_mask.stride(-1) == 1 else key_mask.contiguous()
        mask = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
        mask_len, mask_stride = mask.shape[-1], mask.stride(0)
    kn = vn = q
    new_bstride = new_tstride = 0
    if k_new is not None and v_new is not None:
        kn, vn = k_new, v_new
        if not (kn.stride() == vn.stride() and kn.stride(-1) == 1 and kn.stride(-2) == D):
            kn, vn = kn.contiguous(), vn.contiguous()
        new_bstride, new_tstride = kn.stride(0), kn.stride(1)
    lim = positions
    if limits is not None:
        if limits.shape != (B, T):
            raise ConfigError(f"attention limits {tuple(limits.shape)} must be [B, T] = [{B}, {T}]")
        lim = limits if limits.stride(-1) == 1 else limits.contiguous()
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    # Contiguous caches (one page per sequence, which holds every key) read no block table in the loop;
    # pages holding whole key blocks are looked up per group of pages; other page sizes per key.
    paging = 0 if bt.shape[1] == 1 else (1 if page_size % bn == 0 else 2)
    ks = k.scales if k.scales is not None else k.values
    vs = v.scales if v.scales is not None else v.values
    # Interior K/V tiles as TMA bulk copies (Hopper): the cache as a [rows, Hkv*D] matrix, box [BLOCK_N, D] at
    # column kvh*D. Off by default until an H100 run shows it faster (EXLPY_FLASH_TMA=1; flash_sweep.py).
    use_tma = options().flash_tma if tma is None else tma
    use_tma = use_tma and k.fmt == v.fmt == PLAIN and paging != 2 and D == next_pow2(D)
    k_desc, v_desc = k.values, v.values
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        k_desc, v_desc = (TensorDescriptor(t.values, [t.values.numel() // (hk * D), hk * D], [hk * D, 1], [bn, D])
                          for t in (k, v))
    _flash_kernel[(m_tiles, B * hk, n_split)](
        q, k.values, v.values, ks, vs, k_desc, v_desc, bt, seqlens, positions, lim, mask, out, part, lse, kn, vn,
        q.stride(0), q.stride(1), positions.stride(0), positions.stride(1), lim.stride(0), bt.stride(0), mask_stride,
        mask_len,
        new_bstride, new_tstride, T, hq, hk, page_size, k.row_stride, v.row_stride, k.srow_stride, v.srow_stride,
        scale * _LOG2E, m_tiles, n_split, window, scale / softcap if softcap else 0.0,
        softcap / scale if softcap else 0.0, G=G, D=D, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=max(16, next_pow2(D)),
        SPLIT=n_split > 1,
        K_FMT=k.fmt, K_BITS=k.bits, V_FMT=v.fmt, V_BITS=v.bits, PAGING=paging, GROUP_PAGES=GROUP_PAGES,
        USE_TMA=use_tma,
        HAS_MASK=key_mask is not None, HAS_NEW=k_new is not None, PREC=prec, WINDOW=window > 0,
        SOFTCAP=softcap > 0, HAS_LIMITS=limits is not None, num_warps=warps, num_stages=stages)
    if n_split > 1:
        _combine_kernel[(B * T * hq,)](part, lse, out, D=D, BLOCK_D=next_pow2(D), SPLITS=n_split,
                                       BLOCK_S=max(2, next_pow2(n_split)), num_warps=4)
    return out


def flash_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    page_size: int, seqlens: torch.Tensor, max_seqlen: int, positions: torch.Tensor, scale: float,
                    key_mask: torch.Tensor | None = None, window: int = 0, softcap: float = 0.0,
                    limits: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `reference.flash_attention` (= `reference.paged_attention`); caches [rows, S, Hkv, D]."""
    return flash_attention_launch(q, plain_operand(k_cache), plain_operand(v_cache), block_table, page_size,
                                  seqlens, max_seqlen, positions, scale, key_mask, window=window, softcap=softcap,
                                  limits=limits)


def quant_attention(q: torch.Tensor, k_codes: torch.Tensor, k_scales: torch.Tensor | None, v_codes: torch.Tensor,
                    v_scales: torch.Tensor | None, block_table: torch.Tensor, page_size: int, seqlens: torch.Tensor,
                    max_seqlen: int, positions: torch.Tensor, scale: float, k_bits: int, v_bits: int,
                    key_mask: torch.Tensor | None = None, k_new: torch.Tensor | None = None,
                    v_new: torch.Tensor | None = None, limits: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `reference.quant_attention`: K/V read as codes [rows, S, W] (+ scales [rows, S, E/32])."""
    return flash_attention_launch(q, quant_operand(k_codes, k_scales, k_bits),
                                  quant_operand(v_codes, v_scales, v_bits), block_table, page_size, seqlens,
                                  max_seqlen, positions, scale, key_mask, k_new, v_new, limits=limits)


__all__ = ["FP8", "INT", "PLAIN", "KVOperand", "flash_attention", "flash_attention_launch", "quant_attention"]
