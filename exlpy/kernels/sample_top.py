"""Top-k / top-p / top-a / min-p sampling of many rows in two launches, without sorting the vocabulary.

The captured decode step samples here (exlpy/generator/sampling/graphed.py). A full sort of a 128k vocabulary
per row costs more than the rest of the sampler; the truncation samplers only ever look at the head of the
sorted distribution, so:

1. `_chunk_kernel`, grid (rows, chunks): each program reads one chunk of a row's logits (divided by the row's
   temperature), and writes the chunk's max, its sum of exp(x - max) (the softmax normaliser, combined in 2)
   and its `KC` largest entries as sortable int64 keys (float bits made order-preserving in the high word, the
   complemented token id in the low word: ties go to the lower id, as torch's argmax does).
2. `_select_kernel`, grid (rows,): merges the chunks' keys into the row's `K` most likely tokens (descending),
   computes their exact probabilities from the combined normaliser and applies, in exllamav2's order, top-k
   (renormalised), top-p, top-a and min-p, then draws at the row's point r by inverse CDF over the survivors.

The result equals sorting the whole distribution whenever top-k is at most K (the caller only sends such
rows, or a vocabulary of at most K tokens). Rows without top-k whose survivors pass the K candidates (or whose
top-p cut does, under top-a) are flagged and finished by kernels/sample_whole.py over the whole vocabulary: the
same survivors and probabilities, drawn in vocabulary order, so their token follows the reference's distribution
but not, at a given point, the reference's token (ties of more than its CAP tokens in the last top-p interval go
to `_full_kernel` here, a bisection that draws the reference's token).

The random point is either given by the host (`params` column R_HOST >= 0, e.g. drawn from a seeded job's
torch.Generator) or drawn in the kernel from Philox-4x32-10 of (seed, counter): counter-based, so a replayed
CUDA graph draws fresh numbers as the counter advances. `reference.sample_top` is the same computation in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from exlpy.kernels import sample_whole

# params [B, NPARAM] float32 columns
TEMP, TOP_K, TOP_P, TOP_A, MIN_P, SKEW_EXP, R_HOST = range(7)
NPARAM = 7
PHILOX_A = tl.constexpr(0xD2511F53)
PHILOX_B = tl.constexpr(0xCD9E8D57)
PHILOX_KA = tl.constexpr(0x9E3779B9)
PHILOX_KB = tl.constexpr(0xBB67AE85)
FULL_BLOCK = 2048  # tokens per step of the whole-vocabulary kernel's scans
MAX_CHUNK = 4096  # vocabulary entries per program of the first kernel (tests lower it to cover many chunks)


def plan(vocab: int, k_max: int) -> tuple[int, int, int, int]:
    """(chunk size, chunks (a power of 2), keys kept per chunk, candidates K) for a vocabulary."""
    chunk = min(MAX_CHUNK, triton.next_power_of_2(vocab))
    chunks = triton.next_power_of_2(triton.cdiv(vocab, chunk))
    kc = min(k_max, chunk)
    return chunk, chunks, kc, min(k_max, chunks * kc)


@triton.jit
def _mul32(a, b: tl.constexpr):
    p = a.to(tl.uint64) * tl.full([], b, tl.uint64)
    return (p >> 32).to(tl.uint32), (p & 0xFFFFFFFF).to(tl.uint32)


@triton.jit
def _philox_uniform(seed, counter):
    """Philox-4x32-10 of counter (c0, c1 = its low, high words; c2 = c3 = 0) under key seed; first word -> [0, 1)."""
    c0 = (counter & 0xFFFFFFFF).to(tl.uint32)
    c1 = ((counter >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c2 = c0 * 0
    c3 = c0 * 0
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    for _ in tl.static_range(10):
        hi0, lo0 = _mul32(c0, PHILOX_A)
        hi1, lo1 = _mul32(c2, PHILOX_B)
        n0 = hi1 ^ c1 ^ k0
        n2 = hi0 ^ c3 ^ k1
        c0, c1, c2, c3 = n0, lo1, n2, lo0
        k0 = ((k0.to(tl.uint64) + tl.full([], PHILOX_KA, tl.uint64)) & 0xFFFFFFFF).to(tl.uint32)
        k1 = ((k1.to(tl.uint64) + tl.full([], PHILOX_KB, tl.uint64)) & 0xFFFFFFFF).to(tl.uint32)
    return (c0 >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _chunk_kernel(x_ptr, x_stride, params_ptr, keys_ptr, stats_ptr, vocab, chunks,
                  CH: tl.constexpr, KC: tl.constexpr, NP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CH + tl.arange(0, CH)
    inside = offs < vocab
    t = tl.load(params_ptr + row * NP + 0)
    x = tl.load(x_ptr + row * x_stride + offs, mask=inside, other=float("-inf")).to(tl.float32) / t
    m = tl.max(x, axis=0)
    live = inside & (x > float("-inf"))
    s = tl.sum(tl.where(live, tl.exp(x - m), 0.0), axis=0)
    bits = x.to(tl.int32, bitcast=True)
    skey = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    low = (0xFFFFFFFF - offs.to(tl.int64))
    key = (skey.to(tl.int64) << 32) | low
    top = tl.topk(key, KC)
    tl.store(keys_ptr + (row * chunks + c) * KC + tl.arange(0, KC), top)
    tl.store(stats_ptr + (row * chunks + c) * 2 + 0, m)
    tl.store(stats_ptr + (row * chunks + c) * 2 + 1, s)


@triton.jit
def _select_kernel(keys_ptr, stats_ptr, params_ptr, rng_ptr, tok_ptr, prob_ptr, info_ptr, cq_ptr, cid_ptr, vocab,
                   NCH: tl.constexpr, KC: tl.constexpr, K: tl.constexpr, NP: tl.constexpr, CAND: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ch = tl.arange(0, NCH)
    ms = tl.load(stats_ptr + (row * NCH + ch) * 2 + 0)
    ss = tl.load(stats_ptr + (row * NCH + ch) * 2 + 1)
    big_m = tl.max(ms, axis=0)
    z = tl.sum(tl.where(ss > 0.0, ss * tl.exp(ms - big_m), 0.0), axis=0)
    keys = tl.load(keys_ptr + row * NCH * KC + tl.arange(0, NCH * KC))
    if K < NCH * KC:
        keys = tl.topk(keys, K)
    else:
        keys = tl.sort(keys, descending=True)
    ids = 0xFFFFFFFF - (keys & 0xFFFFFFFF)
    skey = (keys >> 32).to(tl.int32)
    x = tl.where(skey >= 0, skey, skey ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
    j = tl.arange(0, K)
    valid = (ids < vocab) & (x > float("-inf"))
    p = tl.where(valid, tl.exp(x - big_m) / z, 0.0)

    top_k = tl.load(params_ptr + row * NP + 1).to(tl.int32)
    top_p = tl.load(params_ptr + row * NP + 2)
    top_a = tl.load(params_ptr + row * NP + 3)
    min_p = tl.load(params_ptr + row * NP + 4)
    skew_exp = tl.load(params_ptr + row * NP + 5)
    r_host = tl.load(params_ptr + row * NP + 6)
    first = j == 0
    # top-k, renormalised (only when it truncates: exllamav2 renormalises the top-k slice)
    q = tl.where(j < top_k, p, 0.0)
    q = tl.where(top_k < vocab, q / tl.sum(q, axis=0), q)
    # top-p: keep while the running mass stays <= p (the crossing token is excluded), drop < 1e-6
    cum = tl.cumsum(q, axis=0)
    keep = ((cum <= top_p + 1e-6) & (q >= 1e-6)) | first
    qp = tl.where(keep, q, 0.0)
    q = tl.where((top_p > 0.0) & (top_p < 1.0), qp / tl.sum(qp, axis=0), q)
    # top-a's bound depends on the mass top-p keeps: past the candidates, the candidates' mass is not it
    tail_p = tl.sum(tl.where(j == K - 1, q, 0.0), axis=0) > 0.0
    # top-a: p >= a * p_max^2
    pmax = tl.max(q, axis=0)
    qa = tl.where((q >= top_a * pmax * pmax) | first, q, 0.0)
    q = tl.where(top_a > 0.0, qa / tl.sum(qa, axis=0), q)
    # min-p: p >= m * p_max
    pmax = tl.max(q, axis=0)
    qm = tl.where((q >= min_p * pmax) | first, q, 0.0)
    q = tl.where((min_p > 0.0) & (min_p < 1.0), qm / tl.sum(qm, axis=0), q)

    seed = tl.load(rng_ptr + row * 2 + 0)
    counter = tl.load(rng_ptr + row * 2 + 1)
    r = tl.where(r_host >= 0.0, r_host, _philox_uniform(seed, counter))
    r = tl.where(skew_exp == 1.0, r, tl.exp(skew_exp * tl.log(r)))
    cum = tl.cumsum(q, axis=0)
    total = tl.sum(q, axis=0)
    idx = tl.sum((cum <= r * total).to(tl.int32), axis=0)
    last = tl.max(tl.where(q > 0.0, j, 0), axis=0)
    idx = tl.minimum(idx, last)
    tok = tl.sum(tl.where(j == idx, ids, 0), axis=0)
    pr = tl.sum(tl.where(j == idx, q, 0.0), axis=0) / total
    tl.store(tok_ptr + row, tok)
    tl.store(prob_ptr + row, pr)
    if CAND:  # the candidates for the steps that follow in torch (graphed.py: TFS, typical, ...)
        tl.store(cq_ptr + row * K + j, q)
        tl.store(cid_ptr + row * K + j, ids)
    # Without top-k, a row whose K-th candidate survived every step keeps tokens past the candidates: the
    # third kernel samples it from the whole vocabulary.
    tail = tl.sum(tl.where(j == K - 1, q, 0.0), axis=0) > 0.0
    full = (top_k >= vocab) & (K < vocab) & (tail | (tail_p & (top_a > 0.0)))
    tl.store(info_ptr + row * 4 + 0, big_m)
    tl.store(info_ptr + row * 4 + 1, z)
    tl.store(info_ptr + row * 4 + 2, r)
    tl.store(info_ptr + row * 4 + 3, full.to(tl.float32))


@triton.jit
def _key(x, ids):
    bits = x.to(tl.int32, bitcast=True)
    skey = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return (skey.to(tl.int64) << 32) | (0xFFFFFFFF - ids.to(tl.int64))


@triton.jit
def _scan(x_row, idx_row, n, t, thr, big_m, z, temp, BLOCK: tl.constexpr, KMIN: tl.constexpr):
    """Over the n compacted tokens: (mass of those with key >= t and p >= thr, their smallest key (KMIN, else
    the int64 max: the bisections' scans go without, which keeps the kernel within its registers), their count)."""
    acc = tl.zeros([], tl.float32)
    kmin = tl.full([], 0x7FFFFFFFFFFFFFFF, tl.int64)
    cnt = tl.zeros([], tl.int32)
    for s0 in range(0, n, BLOCK):
        o = s0 + tl.arange(0, BLOCK)
        inb = o < n
        ids = tl.load(idx_row + o, mask=inb, other=0)
        x = tl.load(x_row + ids, mask=inb, other=float("-inf")).to(tl.float32) / temp
        p = tl.exp(x - big_m) / z
        key = _key(x, ids)
        sel = inb & (key >= t) & (p >= thr)
        acc += tl.sum(tl.where(sel, p, 0.0), axis=0)
        if KMIN:
            kmin = tl.minimum(kmin, tl.min(tl.where(sel, key, 0x7FFFFFFFFFFFFFFF), axis=0))
        cnt += tl.sum(sel.to(tl.int32), axis=0)
    return acc, kmin, cnt


@triton.jit
def _mid(lo, hi):
    return (lo >> 1) + (hi >> 1) + (lo & hi & 1)


@triton.jit
def _full_kernel(x_ptr, x_stride, params_ptr, info_ptr, idx_ptr, tok_ptr, prob_ptr, vocab,
                 NP: tl.constexpr, BLOCK: tl.constexpr):
    """Rows flagged by `_select_kernel`: the same chain over the whole vocabulary. Tokens that can survive are
    compacted first (p >= 1e-6 under top-p, else the min-p / top-a bounds); the top-p cut and the draw are then
    bisections over the int64 keys (value, then lower id first: the host's sorted order, ties included). A
    bisection stops as soon as one token is left between its bounds (counted by each scan): about log2 of the
    survivors' count steps on flat rows instead of the key width's 64."""
    row = tl.program_id(0).to(tl.int64)
    full = tl.load(info_ptr + row * 4 + 3)
    if full == 2.0:  # left by sample_whole.py (a last interval of more than its CAP tokens: ties)
        big_m = tl.load(info_ptr + row * 4 + 0)
        z = tl.load(info_ptr + row * 4 + 1)
        r = tl.load(info_ptr + row * 4 + 2)
        temp = tl.load(params_ptr + row * NP + 0)
        top_p = tl.load(params_ptr + row * NP + 2)
        top_a = tl.load(params_ptr + row * NP + 3)
        min_p = tl.load(params_ptr + row * NP + 4)
        use_p = (top_p > 0.0) & (top_p < 1.0)
        use_a = top_a > 0.0
        use_m = (min_p > 0.0) & (min_p < 1.0)
        p0 = 1.0 / z
        low = tl.where(use_p, 1e-6, tl.maximum(tl.where(use_m, min_p * p0, 0.0), tl.where(use_a, top_a * p0 * p0,
                                                                                              0.0)))
        x_row = x_ptr + row * x_stride
        idx_row = idx_ptr + row * vocab
        n = tl.zeros([], tl.int32)
        kmax = tl.full([], -0x7FFFFFFFFFFFFFFF, tl.int64)
        for s0 in range(0, vocab, BLOCK):
            o = s0 + tl.arange(0, BLOCK)
            inb = o < vocab
            x = tl.load(x_row + o, mask=inb, other=float("-inf")).to(tl.float32) / temp
            p = tl.where(inb & (x > float("-inf")), tl.exp(x - big_m) / z, 0.0)
            keep = (p >= low) & (p > 0.0)
            pos = n + tl.cumsum(keep.to(tl.int32), axis=0) - 1
            tl.store(idx_row + pos, o, mask=keep)
            n += tl.sum(keep.to(tl.int32), axis=0)
            kmax = tl.maximum(kmax, tl.max(tl.where(keep, _key(x, o), -0x7FFFFFFFFFFFFFFF), axis=0))
        # top-p: the smallest key t with mass(key >= t) <= p + 1e-6 (the most likely token always stays)
        t_p = tl.full([], -0x7FFFFFFFFFFFFFFF, tl.int64)
        s_all, kmin, c_all = _scan(x_row, idx_row, n, t_p, 0.0, big_m, z, temp, BLOCK, True)
        s_p = s_all
        if use_p:
            lim = top_p + 1e-6
            if s_all > lim:
                # mass(key >= lo) > lim >= mass(key >= hi); c_lo, c_hi: tokens at or above each bound. With one
                # token k between them, every t in (k, hi] selects what hi does: hi is the cut.
                lo = kmin
                hi = kmax + 1
                c_lo = c_all
                c_hi = tl.zeros([], tl.int32)
                while (lo + 1 < hi) & (c_lo - c_hi > 1):
                    mid = _mid(lo, hi)
                    m_mid, _k, c_mid = _scan(x_row, idx_row, n, mid, 0.0, big_m, z, temp, BLOCK, False)
                    if m_mid <= lim:
                        hi = mid
                        c_hi = c_mid
                    else:
                        lo = mid
                        c_lo = c_mid
                t_p = tl.minimum(hi, kmax)
                s_p, _k, _c = _scan(x_row, idx_row, n, t_p, 0.0, big_m, z, temp, BLOCK, False)
        else:
            s_p = tl.full([], 1.0, tl.float32)  # no top-p: the softmax itself (sums to 1)
        thr = tl.where(use_a, top_a * p0 * p0 / s_p, 0.0)
        thr = tl.maximum(thr, tl.where(use_m, min_p * p0, 0.0))
        thr = tl.minimum(thr, p0)  # the most likely token always stays
        s_f, kmin, c_f = _scan(x_row, idx_row, n, t_p, thr, big_m, z, temp, BLOCK, True)
        target = r * s_f
        # the draw in descending order: the largest key t with mass(key >= t) > target. Always in this order,
        # however many tokens survive: drawing flat rows in vocabulary order would keep the distribution but
        # not the token at a given point, and seeded jobs must draw the host chain's tokens (issue 30).
        # mass(key >= lo) > target >= mass(key >= hi); once one token is left in [lo, hi) (or hi = lo + 1) the
        # draw is the smallest key at or above lo. mass(key >= kmin) is s_f itself (the same tokens, same order).
        lo = kmin
        hi = kmax + 1
        c_lo = c_f
        c_hi = tl.zeros([], tl.int32)
        if s_f > target:
            while (lo + 1 < hi) & (c_lo - c_hi > 1):
                mid = _mid(lo, hi)
                m_mid, _k, c_mid = _scan(x_row, idx_row, n, mid, thr, big_m, z, temp, BLOCK, False)
                if m_mid > target:
                    lo = mid
                    c_lo = c_mid
                else:
                    hi = mid
                    c_hi = c_mid
            _m, lo, _c = _scan(x_row, idx_row, n, lo, thr, big_m, z, temp, BLOCK, True)
        tok = 0xFFFFFFFF - (lo & 0xFFFFFFFF)
        skey = (lo >> 32).to(tl.int32)
        xv = tl.where(skey >= 0, skey, skey ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
        pr = tl.exp(xv - big_m) / z / s_f
        tl.store(tok_ptr + row, tok)
        tl.store(prob_ptr + row, pr)


def _launch(logits: torch.Tensor, params: torch.Tensor, rng: torch.Tensor, k_max: int, cand: bool,
            whole: bool) -> tuple[torch.Tensor, ...]:
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    rows, vocab = x.shape
    ch, nch, kc, k = plan(vocab, k_max)
    keys = torch.empty(rows, nch * kc, dtype=torch.int64, device=x.device)
    stats = torch.empty(rows, nch, 2, dtype=torch.float32, device=x.device)
    tok = torch.empty(rows, dtype=torch.int64, device=x.device)
    prob = torch.empty(rows, dtype=torch.float32, device=x.device)
    info = torch.empty(rows, 4, dtype=torch.float32, device=x.device)
    cq = torch.empty(rows, k if cand else 1, dtype=torch.float32, device=x.device)
    cid = torch.empty(rows, k if cand else 1, dtype=torch.int64, device=x.device)
    if rows == 0:
        return tok, prob, cq, cid, info[:, 2]
    params = params.contiguous()
    rng = rng.contiguous()
    _chunk_kernel[(rows, nch)](x, x.stride(0), params, keys, stats, vocab, nch, CH=ch, KC=kc, NP=NPARAM,
                               num_warps=8 if ch >= 2048 else 4)
    _select_kernel[(rows,)](keys, stats, params, rng, tok, prob, info, cq, cid, vocab, NCH=nch, KC=kc, K=k,
                            NP=NPARAM, CAND=cand, num_warps=4)
    if k < vocab and whole:
        sample_whole.finish(x, params, info, tok, prob, NPARAM)
        idx = torch.empty(rows, vocab, dtype=torch.int32, device=x.device)
        _full_kernel[(rows,)](x, x.stride(0), params, info, idx, tok, prob, vocab, NP=NPARAM, BLOCK=FULL_BLOCK,
                              num_warps=8)
    return tok, prob, cq, cid, info[:, 2]


def sample_top(logits: torch.Tensor, params: torch.Tensor, rng: torch.Tensor, k_max: int,
               whole_vocab: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `reference.sample_top`."""
    tok, prob, _, _, _ = _launch(logits, params, rng, k_max, False, whole_vocab)
    return tok, prob


def sample_top_candidates(logits: torch.Tensor, params: torch.Tensor, rng: torch.Tensor, k_max: int,
                          whole_vocab: bool = True) -> tuple[torch.Tensor, ...]:
    """Same contract as `reference.sample_top_candidates`."""
    return _launch(logits, params, rng, k_max, True, whole_vocab)
