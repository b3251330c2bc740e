"""Packers that write EXL2 / GPTQ tensors from known codes: test fixtures and benchmark inputs.

They implement the on-disk layouts of spec §3.2 (EXL2 bit streams, 4-bit scale codes) and §3.6 (GPTQ nibbles,
v1/v2 zero conventions, g_idx) independently of the unpacking code, so round trips are real checks.
"""

from __future__ import annotations

import math

import torch


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 -> the same bits as int32."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_stream(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [R, N] (0 <= c < 2^bits) -> int32 [ceil(R*bits/32), N]: value i at stream bits [i*bits, i*bits+bits)."""
    r, n = codes.shape
    words = torch.zeros((r * bits + 31) // 32 + 1, n, dtype=torch.int64)
    bit = torch.arange(r) * bits
    w, off = bit // 32, bit % 32
    c = codes.to(torch.int64)
    words.index_add_(0, w, (c << off[:, None]) & 0xFFFFFFFF)  # bit fields are disjoint: add == or
    words.index_add_(0, w + 1, c >> (32 - off)[:, None])  # high bits of straddling codes (0 otherwise)
    return to_int32(words[:-1])


def pack_nibbles_cols(vals: torch.Tensor) -> torch.Tensor:
    """[G, N] 4-bit values -> int32 [G, N/8], nibble j of word c = column 8c + j."""
    g, n = vals.shape
    v = vals.to(torch.int64).reshape(g, n // 8, 8) << (4 * torch.arange(8))
    return to_int32(v.sum(-1))


def exl2_group_plan(k: int, plan: list[tuple[int, float, int]]) -> list[tuple[int, int]]:
    """(bits, proportion, group size) list in non-increasing bit order -> per-group (bits, rows), spec §3.3:
    width b gets ceil(min(K * p_b, rows left) / gs_b) whole groups, and the last group is cut off at K."""
    groups: list[tuple[int, int]] = []
    left = k
    for bits, p, gs in plan:
        count = math.ceil(max(0.0, min(k * p, left)) / gs)
        for _ in range(count):
            if left <= 0:
                break
            rows = min(gs, left)
            groups.append((bits, rows))
            left -= rows
    if left > 0:  # proportions summing to less than 1: the last width takes the rest
        bits, _, gs = plan[-1]
        while left > 0:
            groups.append((bits, min(gs, left)))
            left -= min(gs, left)
    return groups


def random_words(rows: int, bits: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """What pack_stream writes for uniformly random codes, drawn as words: every bit pattern of a word holds valid
    codes, so random words are random codes; the bits past the group's last code stay zero as pack_stream leaves
    them. ~40x faster than packing (Mixtral-shaped expert stacks for the GPU tests)."""
    total = rows * bits
    words = torch.randint(-2**31, 2**31, ((total + 31) // 32, n), generator=gen, dtype=torch.int64)
    if total % 32:
        words[-1] &= (1 << (total % 32)) - 1
    return to_int32(words & 0xFFFFFFFF)


def random_exl2(k: int, n: int, groups: list[tuple[int, int]], gen: torch.Generator,
                act_order: bool = True, fast: bool = False) -> dict[str, torch.Tensor]:
    """Random EXL2 tensors for a [K, N] linear with the given per-group (bits, rows) layout. fast: the words drawn
    directly (random_words) where N needs no padding columns; the same distribution, other values than packing."""
    assert sum(r for _, r in groups) == k
    n_pad = -(-n // 32) * 32
    q_weight, q_groups, word = [], [], 0
    for bits, rows in groups:
        if fast and n == n_pad:
            packed = random_words(rows, bits, n, gen)
        else:
            codes = torch.randint(0, 2**bits, (rows, n_pad), generator=gen)
            codes[:, n:] = 2 ** (bits - 1)  # padding columns hold zero weight
            packed = pack_stream(codes, bits)
        q_groups += [bits, word]
        word += packed.shape[0]
        q_weight.append(packed)
    ng = len(groups)
    nib = torch.randint(0, 16, (ng, n_pad), generator=gen)
    smax = (torch.rand(ng, generator=gen) * 0.02 + 0.002).to(torch.float16)
    inv = torch.argsort(torch.rand(k, generator=gen)) if act_order else torch.arange(k)
    return {"q_weight": torch.cat(q_weight), "q_invperm": inv.to(torch.int32), "q_scale": pack_nibbles_cols(nib),
            "q_scale_max": smax, "q_groups": torch.tensor(q_groups, dtype=torch.int16)}


def quantize_gptq(w: torch.Tensor, group_size: int, gen: torch.Generator | None = None, act_order: bool = False,
                  v2: bool = False) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Round-to-nearest 4-bit GPTQ of w [K, N] (math layout). Returns (tensors, exact dequantized [K, N] fp32).

    act_order assigns rows to groups through a random permutation (as GPTQ's desc_act does) and writes g_idx.
    v1 stores zero-1 (so true zeros are kept >= 1), v2 stores the zero itself.
    """
    k, n = w.shape
    ng = -(-k // group_size)
    if act_order:
        order = torch.argsort(torch.rand(k, generator=gen))
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[order] = torch.arange(k) // group_size
    else:
        g_idx = torch.arange(k) // group_size
    wf = w.float()
    scales = torch.empty(ng, n)
    zeros = torch.empty(ng, n, dtype=torch.int64)
    for g in range(ng):
        rows = wf[g_idx == g]
        lo = rows.min(0).values.clamp(max=0)
        hi = rows.max(0).values.clamp(min=0)
        s = ((hi - lo) / 15).clamp(min=1e-6).half().float()
        scales[g] = s
        zeros[g] = torch.round(-lo / s).clamp(0 if v2 else 1, 15).long()
    q = (torch.round(wf / scales[g_idx]) + zeros[g_idx]).clamp(0, 15).long()
    dq = (q - zeros[g_idx]).float() * scales[g_idx]
    t = {"qweight": pack_stream(q, 4), "qzeros": pack_nibbles_cols(zeros if v2 else zeros - 1),
         "scales": scales.half()}
    if act_order:
        t["g_idx"] = g_idx.to(torch.int32)
    return t, dq
