"""Whole-vocabulary top-p / top-a / min-p and the draw, for the rows of `sample_top` whose survivors pass its K
candidates (rows without top-k: top-p alone is what the OpenAI server sends). No sort of the vocabulary, no host
sync, a fixed launch sequence (one CUDA graph), several programs per row:

1. `_pass_kernel`, grid (rows, chunks), PASSES launches: the top-p cut as a value interval [lo, hi) of the row's
   scaled logits x = logit / T, narrowed EDGES-fold per pass. Each program reads the previous pass's per-chunk
   sums (a few KB), combines them into the row's new interval (every program of a row computes the same one;
   program 0 stores it), then writes, for its chunk and each of the interval's EDGES edges e_k, the mass and the
   count of its eligible tokens (p >= 1e-6, the top-p rule's floor) with lo <= x < hi and x >= e_k. The
   interval keeps mass(x >= lo) > top_p + 1e-6 >= mass(x >= hi). The first interval spans every eligible token
   (width <= ln(1e6) ~ 13.8, since p >= 1e-6 means x >= max + ln(1e-6 * Z)): four passes of 16 edges leave
   ~2e-4, a few tokens of a 128k vocabulary. Only the last pass counts tokens (the resolve step needs counts).
2. `_resolve_kernel`, grid (rows,): the last interval's tokens (at most CAP, gathered from the chunks that hold
   them) sorted by key (value, then lower id first: the host chain's order, ties included) give the exact cut
   and the top-p mass; rows whose interval holds more (ties of CAP+ tokens) are left to the bisection kernel
   (sample_top.py `_full_kernel`, exact, slower). Without top-p (min-p / top-a alone) there is no cut.
3. `_mass_kernel`, grid (rows, chunks): each chunk's mass of the final survivors (top-p cut, then p above the
   top-a / min-p bound, which is a bound on p once the top-p mass is known).
4. `_draw_kernel`, grid (rows,): inverse CDF at the row's point in vocabulary order: the chunk by a prefix sum of
   the chunk masses, then the token by a prefix sum within the chunk.

Contract: the survivors and their probabilities are the host chain's (`reference.sorted_draw`, up to fp32 sums in
another order at a boundary), so the token has the reference distribution; but the draw runs in vocabulary
order, not in descending order, so a given random point maps to another token than the reference's whenever the
survivors pass the K candidates. Rows within the candidates (every row with top-k <= K) still draw the reference's
token at a given point. Per-row seeds and Philox counters are unchanged (the point comes from `_select_kernel`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

EDGES = 16  # edges of the interval per pass: a pass costs ~3 EDGES operations per token
PASSES = 4  # 16^4: a 13.8-wide first interval ends ~2e-4 wide (~10 tokens of a flat 128k row)
CHUNK = 4096  # tokens per program of the chunked kernels (tests lower it to cover many chunks)
SUB = 256  # tokens per step of a pass program: its edge matrix is [SUB, EDGES]
CAP = 1024  # tokens of the last interval one program sorts; rows with more go to the bisection kernel
DRAW_BLOCK = 1024
KEY_MIN = tl.constexpr(-0x7FFFFFFFFFFFFFFF)


def plan(vocab: int) -> tuple[int, int]:
    """(chunk size, chunks (a power of 2)) of a vocabulary."""
    chunk = min(CHUNK, triton.next_power_of_2(vocab))
    return chunk, triton.next_power_of_2(triton.cdiv(vocab, chunk))


@triton.jit
def _key(x, ids):
    """Sortable int64 of (x, id): the float's bits made order-preserving in the high word, the complemented id
    in the low word (ties: the lower id is the larger key)."""
    bits = x.to(tl.int32, bitcast=True)
    skey = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return (skey.to(tl.int64) << 32) | (0xFFFFFFFF - ids.to(tl.int64))


@triton.jit
def _row_setup(info_ptr, params_ptr, row, NP: tl.constexpr):
    """(this row is for these kernels, max, Z, temperature, top-p bound (2 when off), top-p on)."""
    full = tl.load(info_ptr + row * 4 + 3)
    big_m = tl.load(info_ptr + row * 4 + 0)
    z = tl.load(info_ptr + row * 4 + 1)
    temp = tl.load(params_ptr + row * NP + 0)
    top_p = tl.load(params_ptr + row * NP + 2)
    use_p = (top_p > 0.0) & (top_p < 1.0)
    return full == 1.0, big_m, z, temp, top_p + 1e-6, use_p


@triton.jit
def _combine(st_ptr, edges_ptr, pm_ptr, pc_ptr, row, q, rows, lim, FIRST: tl.constexpr, COUNTS: tl.constexpr,
             NC: tl.constexpr, T: tl.constexpr):
    """The interval after pass q from its stored interval and per-chunk sums: (lo, hi, mass(x >= hi), done, the
    interval's token count, its per-chunk counts [NC]; zeros unless COUNTS). done: every eligible token survives
    top-p (decided by the first pass, whose interval holds them all); then mass(x >= hi) holds their mass."""
    base = q * rows + row
    hi = tl.load(st_ptr + base * 4 + 1)
    m_hi = tl.load(st_ptr + base * 4 + 2)
    done = tl.load(st_ptr + base * 4 + 3)
    c = tl.arange(0, NC)[:, None]
    kk = tl.arange(0, T)
    pm = tl.load(pm_ptr + (base * NC + c) * T + kk[None, :])
    if COUNTS:
        pc = tl.load(pc_ptr + (base * NC + c) * T + kk[None, :])
    else:
        pc = tl.zeros([NC, T], tl.int32)
    above = m_hi + tl.sum(pm, axis=0)  # mass(x >= e_k), non-increasing in k
    cnt = tl.sum(pc, axis=0)  # tokens in [e_k, hi)
    j = tl.maximum(tl.sum((above > lim).to(tl.int32), axis=0) - 1, 0)  # the last edge with mass above > lim
    e = tl.load(edges_ptr + base * T + kk)
    top = j == T - 1
    new_lo = tl.sum(tl.where(kk == j, e, 0.0), axis=0)
    new_hi = tl.where(top, hi, tl.sum(tl.where(kk == j + 1, e, 0.0), axis=0))
    new_m = tl.where(top, m_hi, tl.sum(tl.where(kk == j + 1, above, 0.0), axis=0))
    n_in = tl.sum(tl.where(kk == j, cnt, 0), axis=0) - tl.sum(tl.where(kk == j + 1, cnt, 0), axis=0)
    per_chunk = (tl.sum(tl.where(kk[None, :] == j, pc, 0), axis=1)
                 - tl.sum(tl.where(kk[None, :] == j + 1, pc, 0), axis=1))
    if FIRST:
        all_mass = tl.sum(tl.where(kk == 0, above, 0.0), axis=0)
        now_done = (done != 0.0) | (all_mass <= lim)
        new_m = tl.where(now_done, all_mass, new_m)
    else:
        now_done = done != 0.0
        new_m = tl.where(now_done, m_hi, new_m)
    return new_lo, new_hi, new_m, now_done, n_in, per_chunk


@triton.jit
def _pass_kernel(x_ptr, x_stride, params_ptr, info_ptr, st_ptr, edges_ptr, pm_ptr, pc_ptr, vocab, rows,
                 P: tl.constexpr, LAST: tl.constexpr, NC: tl.constexpr, CH: tl.constexpr, SB: tl.constexpr,
                 T: tl.constexpr, NP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    mine, big_m, z, temp, lim, use_p = _row_setup(info_ptr, params_ptr, row, NP)
    if mine & use_p:
        if P == 0:
            # every eligible token: x >= max + ln(1e-6 Z) (a margin for the rounding of p), x <= max
            lo = big_m + tl.log(1e-6 * z) - 1e-3
            hi = big_m + 1e-3 + tl.abs(big_m) * 1e-6
            m_hi = tl.zeros([], tl.float32)
            done = lo > hi  # never: a typed False
        else:
            lo, hi, m_hi, done, _n, _pc = _combine(st_ptr, edges_ptr, pm_ptr, pc_ptr, row, P - 1, rows, lim,
                                                   P == 1, False, NC, T)
        kk = tl.arange(0, T)
        w = (hi - lo) / T
        e = lo + w * kk.to(tl.float32)
        base = P * rows + row
        if c == 0:
            tl.store(st_ptr + base * 4 + 0, lo)
            tl.store(st_ptr + base * 4 + 1, hi)
            tl.store(st_ptr + base * 4 + 2, m_hi)
            tl.store(st_ptr + base * 4 + 3, done.to(tl.float32))
            tl.store(edges_ptr + base * T + kk, e)
        pm = tl.zeros([T], tl.float32)
        pc = tl.zeros([T], tl.int32)
        if not done:
            x_row = x_ptr + row * x_stride
            for s0 in range(0, CH, SB):
                o = c * CH + s0 + tl.arange(0, SB)
                x = tl.load(x_row + o, mask=o < vocab, other=float("-inf")).to(tl.float32) / temp
                p = tl.exp(x - big_m) / z
                inside = (p >= 1e-6) & (x >= lo) & (x < hi)
                if tl.sum(inside.to(tl.int32), axis=0) > 0:
                    x = tl.where(inside, x, float("-inf"))  # below every edge
                    ge = x[:, None] >= e[None, :]
                    pm += tl.sum(tl.where(ge, p[:, None], 0.0), axis=0)
                    if P == LAST:
                        pc += tl.sum(ge.to(tl.int32), axis=0)
        tl.store(pm_ptr + (base * NC + c) * T + kk, pm)
        tl.store(pc_ptr + (base * NC + c) * T + kk, pc)


@triton.jit
def _resolve_kernel(x_ptr, x_stride, params_ptr, info_ptr, st_ptr, edges_ptr, pm_ptr, pc_ptr, keys_ptr, cut_ptr,
                    thr_ptr, vocab, rows, cap, P: tl.constexpr, NC: tl.constexpr, CH: tl.constexpr,
                    T: tl.constexpr, CAPN: tl.constexpr, NP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    mine, big_m, z, temp, lim, use_p = _row_setup(info_ptr, params_ptr, row, NP)
    if mine:
        cut = tl.full([], KEY_MIN, tl.int64)
        s_p = tl.full([], 1.0, tl.float32)  # without top-p: the softmax itself
        fallback = cut > 0  # a typed False
        if use_p:
            lo, hi, m_hi, done, n_in, per_chunk = _combine(st_ptr, edges_ptr, pm_ptr, pc_ptr, row, P - 1, rows,
                                                           lim, P == 1, True, NC, T)
            s_p = m_hi
            if not done:
                fallback = n_in > cap
                if not fallback:
                    x_row = x_ptr + row * x_stride
                    k_row = keys_ptr + row * CAPN
                    n = tl.zeros([], tl.int32)
                    ch = tl.arange(0, NC)
                    for ci in range(NC):
                        if tl.sum(tl.where(ch == ci, per_chunk, 0), axis=0) > 0:
                            o = ci * CH + tl.arange(0, CH)
                            x = tl.load(x_row + o, mask=o < vocab, other=float("-inf")).to(tl.float32) / temp
                            p = tl.exp(x - big_m) / z
                            inside = (p >= 1e-6) & (x >= lo) & (x < hi)
                            pos = n + tl.cumsum(inside.to(tl.int32), axis=0) - 1
                            tl.store(k_row + pos, _key(x, o), mask=inside & (pos < CAPN))
                            n += tl.sum(inside.to(tl.int32), axis=0)
                    j = tl.arange(0, CAPN)
                    keys = tl.load(k_row + j, mask=j < n, other=KEY_MIN)
                    keys = tl.sort(keys, descending=True)
                    skey = (keys >> 32).to(tl.int32)
                    xs = tl.where(skey >= 0, skey, skey ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
                    ps = tl.where(j < n, tl.exp(xs - big_m) / z, 0.0)
                    cum = m_hi + tl.cumsum(ps, axis=0)
                    first = (j + tl.where(m_hi == 0.0, 0, 1)) == 0  # the row's most likely token: it always stays
                    keep = (j < n) & ((cum <= lim) | first)
                    nk = tl.sum(keep.to(tl.int32), axis=0)
                    hbits = hi.to(tl.int32, bitcast=True)
                    hkey = tl.where(hbits >= 0, hbits, hbits ^ 0x7FFFFFFF).to(tl.int64) << 32  # x >= hi
                    cut = tl.where(nk > 0, tl.sum(tl.where(j == nk - 1, keys, 0), axis=0), hkey)
                    s_p = tl.where(nk > 0, tl.sum(tl.where(j == nk - 1, cum, 0.0), axis=0), m_hi)
        top_a = tl.load(params_ptr + row * NP + 3)
        min_p = tl.load(params_ptr + row * NP + 4)
        p0 = 1.0 / z
        # top-a keeps q >= a q_max^2 of the top-p distribution (q = p / s_p), min-p q >= m q_max: bounds on p
        thr = tl.where(top_a > 0.0, top_a * p0 * p0 / s_p, 0.0)
        thr = tl.maximum(thr, tl.where((min_p > 0.0) & (min_p < 1.0), min_p * p0, 0.0))
        thr = tl.minimum(thr, p0)  # the most likely token always stays
        tl.store(cut_ptr + row, cut)
        tl.store(thr_ptr + row, thr)
        if fallback:
            tl.store(info_ptr + row * 4 + 3, 2.0)  # sample_top.py `_full_kernel` finishes it


@triton.jit
def _survivors(x_row, o, vocab, big_m, z, temp, cut, thr, use_p):
    x = tl.load(x_row + o, mask=o < vocab, other=float("-inf")).to(tl.float32) / temp
    p = tl.where(x > float("-inf"), tl.exp(x - big_m) / z, 0.0)
    keep = (o < vocab) & (p > 0.0) & (p >= thr)
    keep = tl.where(use_p, keep & (p >= 1e-6) & (_key(x, o) >= cut), keep)
    return tl.where(keep, p, 0.0), keep


@triton.jit
def _mass_kernel(x_ptr, x_stride, params_ptr, info_ptr, cut_ptr, thr_ptr, cm_ptr, vocab,
                 NC: tl.constexpr, CH: tl.constexpr, SB: tl.constexpr, NP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    mine, big_m, z, temp, lim, use_p = _row_setup(info_ptr, params_ptr, row, NP)
    if mine:
        cut = tl.load(cut_ptr + row)
        thr = tl.load(thr_ptr + row)
        acc = tl.zeros([SB], tl.float32)
        for s0 in range(0, CH, SB):
            o = c * CH + s0 + tl.arange(0, SB)
            p, _keep = _survivors(x_ptr + row * x_stride, o, vocab, big_m, z, temp, cut, thr, use_p)
            acc += p
        tl.store(cm_ptr + row * NC + c, tl.sum(acc, axis=0))


@triton.jit
def _draw_kernel(x_ptr, x_stride, params_ptr, info_ptr, cut_ptr, thr_ptr, cm_ptr, tok_ptr, prob_ptr, vocab,
                 NC: tl.constexpr, CH: tl.constexpr, SB: tl.constexpr, NP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    mine, big_m, z, temp, lim, use_p = _row_setup(info_ptr, params_ptr, row, NP)
    if mine:
        cut = tl.load(cut_ptr + row)
        thr = tl.load(thr_ptr + row)
        r = tl.load(info_ptr + row * 4 + 2)
        ch = tl.arange(0, NC)
        cm = tl.load(cm_ptr + row * NC + ch)
        total = tl.sum(cm, axis=0)
        if total > 0.0:
            target = r * total
            cum = tl.cumsum(cm, axis=0)
            ci = tl.sum((cum <= target).to(tl.int32), axis=0)
            ci = tl.minimum(ci, tl.max(tl.where(cm > 0.0, ch, 0), axis=0))  # fp32: stay on a chunk with mass
            rest = target - tl.sum(tl.where(ch < ci, cm, 0.0), axis=0)
            acc = tl.zeros([], tl.float32)
            tok = tl.full([], 0x7FFFFFFF, tl.int32)
            last = tl.full([], -1, tl.int32)
            x_row = x_ptr + row * x_stride
            for s0 in range(0, CH, SB):
                o = ci * CH + s0 + tl.arange(0, SB)
                p, keep = _survivors(x_row, o, vocab, big_m, z, temp, cut, thr, use_p)
                run = acc + tl.cumsum(p, axis=0)
                tok = tl.minimum(tok, tl.min(tl.where(keep & (run > rest), o, 0x7FFFFFFF), axis=0))
                last = tl.maximum(last, tl.max(tl.where(keep, o, -1), axis=0))
                acc += tl.sum(p, axis=0)
            tok = tl.maximum(tl.where(tok == 0x7FFFFFFF, last, tok), 0)  # fp32: past the chunk's sum, its last
            x = tl.load(x_row + tok).to(tl.float32) / temp
            tl.store(tok_ptr + row, tok.to(tl.int64))
            tl.store(prob_ptr + row, tl.exp(x - big_m) / z / total)


def finish(x: torch.Tensor, params: torch.Tensor, info: torch.Tensor, tok: torch.Tensor, prob: torch.Tensor,
           np_cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows flagged by `_select_kernel` (info[:, 3] == 1): their token and probability into tok / prob; rows
    this leaves to the bisection kernel get info[:, 3] = 2. Returns what the draw read: the top-p cut (an int64
    key) and the top-a / min-p bound on p per row, and the survivors' mass per chunk [rows, chunks]."""
    rows, vocab = x.shape
    ch, nch = plan(vocab)
    sb = min(SUB, ch)
    dev = x.device
    st = torch.zeros(PASSES, rows, 4, dtype=torch.float32, device=dev)
    edges = torch.empty(PASSES, rows, EDGES, dtype=torch.float32, device=dev)
    pm = torch.empty(PASSES, rows, nch, EDGES, dtype=torch.float32, device=dev)
    pc = torch.empty(PASSES, rows, nch, EDGES, dtype=torch.int32, device=dev)
    capn = triton.next_power_of_2(max(CAP, 1))
    keys = torch.empty(rows, capn, dtype=torch.int64, device=dev)
    cut = torch.empty(rows, dtype=torch.int64, device=dev)
    thr = torch.empty(rows, dtype=torch.float32, device=dev)
    cm = torch.empty(rows, nch, dtype=torch.float32, device=dev)
    for p in range(PASSES):
        _pass_kernel[(rows, nch)](x, x.stride(0), params, info, st, edges, pm, pc, vocab, rows, P=p,
                                  LAST=PASSES - 1, NC=nch, CH=ch, SB=sb, T=EDGES, NP=np_cols, num_warps=4)
    _resolve_kernel[(rows,)](x, x.stride(0), params, info, st, edges, pm, pc, keys, cut, thr, vocab, rows,
                             CAP, P=PASSES, NC=nch, CH=ch, T=EDGES, CAPN=capn, NP=np_cols, num_warps=8)
    _mass_kernel[(rows, nch)](x, x.stride(0), params, info, cut, thr, cm, vocab, NC=nch, CH=ch,
                              SB=min(DRAW_BLOCK, ch), NP=np_cols, num_warps=4)
    _draw_kernel[(rows,)](x, x.stride(0), params, info, cut, thr, cm, tok, prob, vocab, NC=nch, CH=ch,
                          SB=min(DRAW_BLOCK, ch), NP=np_cols, num_warps=8)
    return cut, thr, cm
