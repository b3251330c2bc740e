"""Quantizer results -> the EXL2 tensors of spec §3.1-3.4, and the check that exlpy's reader gets them back.

Bit streams and nibble packing are exlpy.quant.pack's; the reader is exlpy.quant.exl2_ref. After packing, every
matrix is read back through the reader and must equal what the quantizer intended exactly (the quantizer
computes its dequantized values with the reader's own arithmetic), else the job stops (spec §4.6 step 5).
"""

from __future__ import annotations

import torch

from exlpy.convert.gptq import QuantResult
from exlpy.errors import ConvertError
from exlpy.quant.exl2_ref import build_exl2_matrix, dequant_dense
from exlpy.quant.pack import pack_nibbles_cols, pack_stream


def pack_exl2(res: QuantResult, prefix: str, bias: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """On-disk tensors of one quantized linear (CPU)."""
    codes = res.codes.cpu().to(torch.int64)
    k, n = codes.shape
    n_pad = -(-n // 32) * 32
    words, q_groups, word, r = [], [], 0, 0
    for bits, rows in res.groups:
        block = torch.full((rows, n_pad), 2 ** (bits - 1), dtype=torch.int64)  # padding columns: zero weight
        block[:, :n] = codes[r:r + rows]
        packed = pack_stream(block, bits)
        q_groups += [bits, word]
        word += packed.shape[0]
        words.append(packed)
        r += rows
    nib = torch.zeros(len(res.groups), n_pad, dtype=torch.int64)
    nib[:, :n] = res.qscale.cpu() - 1
    out = {
        f"{prefix}.q_weight": torch.cat(words),
        f"{prefix}.q_invperm": torch.argsort(res.perm.cpu()).to(torch.int32),
        f"{prefix}.q_scale": pack_nibbles_cols(nib),
        f"{prefix}.q_scale_max": res.scale_max.cpu().to(torch.float16).contiguous(),
        f"{prefix}.q_groups": torch.tensor(q_groups, dtype=torch.int16),
    }
    if bias is not None:
        out[f"{prefix}.bias"] = bias.detach().to("cpu", torch.float16).contiguous()
    return out


def read_back(tensors: dict[str, torch.Tensor], prefix: str, k: int, n: int) -> torch.Tensor:
    """W [K, N] fp32 as exlpy's EXL2 reader dequantizes the packed tensors."""
    t = {p: tensors[f"{prefix}.{p}"] for p in ("q_weight", "q_invperm", "q_scale", "q_scale_max", "q_groups")}
    qm = build_exl2_matrix(t["q_weight"], t["q_invperm"], t["q_scale"], t["q_scale_max"], t["q_groups"], k, n,
                           prefix)
    return dequant_dense(qm)


def check_packed(tensors: dict[str, torch.Tensor], res: QuantResult, prefix: str) -> float:
    """Max |reader - quantizer| over the matrix; the job stops if it is not (near) zero."""
    k, n = res.codes.shape
    got = read_back(tensors, prefix, k, n)
    want = res.dense().cpu()
    diff = float((got - want).abs().max()) if got.numel() else 0.0
    ref = float(want.abs().max()) if want.numel() else 1.0
    if not diff <= 1e-6 * max(ref, 1e-30):
        raise ConvertError(f"Quantization error (2): {prefix} reads back with max difference {diff:.3g} from "
                           "what the quantizer wrote (a packing bug; please report it)")
    return diff
