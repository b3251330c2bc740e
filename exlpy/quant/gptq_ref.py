"""GPTQ in pure torch (spec §3.6): validate qweight/qzeros/scales/g_idx and turn them into a QuantMatrix.

Dequantization itself is shared with EXL2 (exl2_ref.dequant_sorted handles kind "gptq"): a GPTQ matrix is one
4-bit segment whose groups carry fp16 scales and per-column zero points.
"""

from __future__ import annotations

import torch

from exlpy.errors import QuantFormatError
from exlpy.quant.exl2_ref import dequant_dense, unpack_codes
from exlpy.quant.layout import QuantLayout, QuantMatrix, Segment
from exlpy.quant.pack import pack_stream

GPTQ_BITS = 4


def _unpack_cols(words: torch.Tensor) -> torch.Tensor:
    """int32 [G, N/8] -> [G, N] nibbles, nibble j of word c = column 8c + j."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    return ((w[:, :, None] >> (4 * torch.arange(8))) & 15).reshape(w.shape[0], -1)


def build_gptq_matrix(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                      k: int, n: int, prefix: str, gptq_v2: bool = False) -> QuantMatrix:
    """Validate raw GPTQ tensors (CPU) and assemble a sorted-row QuantMatrix on the CPU."""
    qw_name = f"{prefix}.qweight"
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise QuantFormatError(f"expected a 2-D int32 tensor, got {qweight.dtype} {list(qweight.shape)}",
                               tensor=qw_name)
    rows, cols = qweight.shape
    if (rows * 32) % k or rows * 32 // k != GPTQ_BITS:
        bits = rows * 32 / k
        raise QuantFormatError(f"{rows} packed rows for K = {k} means {bits:g}-bit weights; only 4-bit GPTQ is "
                               "supported", tensor=qw_name)
    if cols != n or n % 8:
        raise QuantFormatError(f"has {cols} columns, expected {n} (a multiple of 8)", tensor=qw_name)
    if scales.dim() != 2 or scales.shape[1] != n:
        raise QuantFormatError(f"shape {list(scales.shape)}, expected [groups, {n}]", tensor=f"{prefix}.scales")
    ng = scales.shape[0]
    if tuple(qzeros.shape) != (ng, n // 8) or qzeros.dtype != torch.int32:
        raise QuantFormatError(f"shape {list(qzeros.shape)} {qzeros.dtype}, expected [{ng}, {n // 8}] int32",
                               tensor=f"{prefix}.qzeros")
    gs = 1
    while gs * ng < k:
        gs *= 2
    flat = QuantLayout(k, (GPTQ_BITS,), (0, k), (Segment(GPTQ_BITS, 0, 1, 0, 0),))
    perm = None
    if g_idx is not None and bool((g_idx != 0).any()):
        gi = g_idx.to(torch.int64).flatten()
        if gi.numel() != k or int(gi.min()) < 0 or int(gi.max()) >= ng:
            raise QuantFormatError(f"must hold {k} group indices in [0, {ng})", tensor=f"{prefix}.g_idx")
        # Act order: rows sorted by group (stable), so every group is one contiguous run of packed rows.
        order = torch.argsort(gi, stable=True)
        counts = torch.bincount(gi, minlength=ng)
        bounds = [0] + torch.cumsum(counts, 0).tolist()
        if not torch.equal(order, torch.arange(k)):
            perm = order.to(torch.int32)
            qweight = pack_stream(unpack_codes(qweight, flat)[order], GPTQ_BITS)
    else:
        bounds = [min(g * gs, k) for g in range(ng + 1)]
        if bounds[-1] != k:
            raise QuantFormatError(f"{ng} groups of {gs} rows do not cover K = {k}", tensor=f"{prefix}.scales")
    z = _unpack_cols(qzeros)
    # v1 stores the true zero minus one; v2 stores it unshifted (the reference's qzeros -= 0x11111111 then +1).
    zeros = (z if gptq_v2 else z + 1).to(torch.float16)
    layout = QuantLayout(k, (GPTQ_BITS,) * ng, tuple(bounds), (Segment(GPTQ_BITS, 0, ng, 0, 0),))
    return QuantMatrix("gptq", layout, qweight.contiguous(), scales.to(torch.float16).contiguous(), None, zeros,
                       perm, n)


def gptq_dequant_ref(qm: QuantMatrix) -> torch.Tensor:
    """W [K, N] fp32 in original row order."""
    return dequant_dense(qm)
