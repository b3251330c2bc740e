"""EXL2 in pure torch: validate the on-disk tensors (spec §3.1-3.4) and dequantize exactly (spec §3.5).

This is the CPU execution path and the oracle for the Triton kernels. Validation happens once, here, so the
kernels can trust the layout.
"""

from __future__ import annotations

import torch

from exlpy.errors import QuantFormatError
from exlpy.quant.layout import QuantLayout, QuantMatrix, segments_of

EXL2_BITS = (2, 3, 4, 5, 6, 8)


def parse_exl2_groups(q_groups: torch.Tensor, words: int, k: int, prefix: str) -> QuantLayout:
    """Turn q_groups (bits, first q_weight row) pairs into row/word boundaries, checking every invariant."""
    name = f"{prefix}.q_groups"
    qg = q_groups.to(torch.int64).flatten().tolist()
    if len(qg) == 0 or len(qg) % 2:
        raise QuantFormatError(f"q_groups must hold (bits, row) pairs, got {len(qg)} values", tensor=name)
    bits, starts = qg[0::2], qg[1::2]
    for b in bits:
        if b not in EXL2_BITS:
            raise QuantFormatError(f"group bit width {b} not in {list(EXL2_BITS)}", tensor=name)
    if starts[0] != 0:
        raise QuantFormatError(f"first group starts at q_weight row {starts[0]}, expected 0", tensor=name)
    rows = [0]
    for g, b in enumerate(bits):
        if g + 1 < len(bits):
            w = starts[g + 1] - starts[g]
            if w <= 0 or (w * 32) % b:
                raise QuantFormatError(f"group {g} spans {w} q_weight rows, not a whole number of {b}-bit rows",
                                       tensor=name)
            rows.append(rows[-1] + w * 32 // b)
            if rows[-1] >= k:
                raise QuantFormatError(f"q_groups rows reach {rows[-1]} before the last group, but K = {k}",
                                       tensor=name)
        else:
            w = words - starts[g]
            r = k - rows[-1]
            # The last group is cut off at K; its packed stream is padded to whole words.
            if w <= 0 or w != (r * b + 31) // 32:
                raise QuantFormatError(
                    f"q_groups rows do not sum to K = {k}: last group has {w} q_weight rows of {b} bits for "
                    f"{r} remaining rows (q_weight has {words} rows)", tensor=name)
            rows.append(k)
    return QuantLayout(k, tuple(bits), tuple(rows), segments_of(bits, rows, starts))


def invperm_to_perm(q_invperm: torch.Tensor, k: int, prefix: str) -> torch.Tensor:
    """q_perm = argsort(q_invperm), after checking q_invperm is a permutation of range(K)."""
    name = f"{prefix}.q_invperm"
    inv = q_invperm.to(torch.int64).flatten()
    if inv.numel() != k:
        raise QuantFormatError(f"has {inv.numel()} entries, expected K = {k}", tensor=name)
    if not torch.equal(torch.sort(inv).values, torch.arange(k)):
        raise QuantFormatError("is not a permutation of 0..K-1", tensor=name)
    return torch.argsort(inv).to(torch.int32)


def build_exl2_matrix(q_weight: torch.Tensor, q_invperm: torch.Tensor, q_scale: torch.Tensor,
                      q_scale_max: torch.Tensor, q_groups: torch.Tensor, k: int, n: int, prefix: str,
                      prescale: float = 1.0) -> QuantMatrix:
    """Validate raw EXL2 tensors (on the CPU) and assemble a QuantMatrix on the CPU."""
    if q_weight.dtype != torch.int32 or q_weight.dim() != 2:
        raise QuantFormatError(f"expected a 2-D int32 tensor, got {q_weight.dtype} {list(q_weight.shape)}",
                               tensor=f"{prefix}.q_weight")
    words, n_pad = q_weight.shape
    if n_pad < n or n_pad - n >= 32 or n_pad % 8:
        raise QuantFormatError(f"has {n_pad} columns for {n} output features (expected N padded to 32)",
                               tensor=f"{prefix}.q_weight")
    layout = parse_exl2_groups(q_groups, words, k, prefix)
    g = layout.num_groups
    if tuple(q_scale.shape) != (g, n_pad // 8) or q_scale.dtype != torch.int32:
        raise QuantFormatError(f"shape {list(q_scale.shape)} {q_scale.dtype}, expected [{g}, {n_pad // 8}] "
                               f"int32 for {g} groups", tensor=f"{prefix}.q_scale")
    if q_scale_max.numel() != g:
        raise QuantFormatError(f"has {q_scale_max.numel()} entries for {g} groups", tensor=f"{prefix}.q_scale_max")
    perm = invperm_to_perm(q_invperm, k, prefix)
    # prescale/256 is folded into the per-group max once. Kept in fp32: in fp16, q_scale_max/256 of a small
    # matrix is subnormal and loses up to ~1% (checked against the reference dequantization).
    smax = q_scale_max.flatten().to(torch.float32) * (prescale / 256.0)
    return QuantMatrix("exl2", layout, q_weight.contiguous(), q_scale.contiguous(), smax, None, perm, n)


def unpack_codes(q_weight: torch.Tensor, layout: QuantLayout, rows: slice | None = None) -> torch.Tensor:
    """Stored codes of sorted rows `rows` (default all) as int64 [R, Np]."""
    word, off = layout.row_words()
    bits = layout.row_bits()
    if rows is not None:
        word, off, bits = word[rows], off[rows], bits[rows]
    w64 = q_weight.to(torch.int64) & 0xFFFFFFFF
    w64 = torch.cat([w64, torch.zeros_like(w64[:1])])  # a straddler of the last word reads a zero word
    both = w64[word] | (w64[word + 1] << 32)
    return (both >> off[:, None]) & ((1 << bits[:, None]) - 1)


def exl2_scales(qm: QuantMatrix) -> torch.Tensor:
    """Per-group, per-column scale [G, Np] fp32: (nibble + 1)^2 * q_scale_max'."""
    assert qm.scale_max is not None
    q = qm.scales.to(torch.int64) & 0xFFFFFFFF
    nib = (q[:, :, None] >> (4 * torch.arange(8))) & 15  # [G, Np/8, 8]
    code = nib.reshape(q.shape[0], -1)
    return ((code + 1) ** 2).to(torch.float32) * qm.scale_max.cpu()[:, None]


def dequant_sorted(qm: QuantMatrix, chunk_rows: int = 4096) -> torch.Tensor:
    """W_sorted [K, Np] fp32: (q - z) * s per spec §3.5 (EXL2) / §3.6 (GPTQ), in fp32 throughout."""
    cpu = qm.to("cpu")
    lay = cpu.layout
    bits = lay.row_bits()
    grp = lay.row_group()
    if cpu.kind == "exl2":
        scale = exl2_scales(cpu).float()
        zero = None
    else:
        assert cpu.zeros is not None
        scale, zero = cpu.scales.float(), cpu.zeros.float()
    out = torch.empty(lay.k, cpu.q_weight.shape[1], dtype=torch.float32)
    for r0 in range(0, lay.k, chunk_rows):  # bounded temporaries for large heads
        sl = slice(r0, min(r0 + chunk_rows, lay.k))
        q = unpack_codes(cpu.q_weight, lay, sl).float()
        g = grp[sl]
        z = (2.0 ** (bits[sl] - 1))[:, None] if zero is None else zero[g]
        out[sl] = (q - z) * scale[g]
    return out


def dequant_dense(qm: QuantMatrix) -> torch.Tensor:
    """W [K, N] fp32 in original input-feature order (y = x @ W), padding columns dropped."""
    ws = dequant_sorted(qm)[:, :qm.n]
    if qm.perm is None:
        return ws
    w = torch.empty_like(ws)
    w[qm.perm.cpu().long()] = ws
    return w


def exl2_matmul_ref(x: torch.Tensor, qm: QuantMatrix) -> torch.Tensor:
    """y = x @ W for x [..., K]: [..., N] in x's dtype (fp32 math)."""
    w = dequant_dense(qm).to(x.device)
    return (x.float() @ w).to(x.dtype)
