"""Pure-torch references of the sampling ops (exlpy/kernels/sample_top.py): top-k / top-p / top-a / min-p and the
draw in one op, the whole-vocabulary sorted draw, and the Philox counter-based uniforms the kernels draw with.
Re-exported by exlpy/kernels/reference.py, the one namespace the dispatch layer and tests use."""

from __future__ import annotations

import torch

# --- sampling: top-k / top-p / top-a / min-p and the draw in one op (exlpy/kernels/sample_top.py) ----------------
# params [B, 7] float32 columns: temperature, top_k (the vocabulary size when off), top_p, top_a, min_p (0 or
# >= 1: off), exp(-skew), host point r (< 0: draw from Philox of the row's (seed, counter) in rng [B, 2] int64).

_PHILOX = (0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85)
_U32 = 0xFFFFFFFF


def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    # a < 2^32 and m < 2^32 as int64: split m in 16-bit halves so no product leaves int64's range
    lo_part = a * (m & 0xFFFF)
    hi_part = a * (m >> 16)
    full_lo = (lo_part + ((hi_part & 0xFFFF) << 16)) & _U32
    carry = (lo_part + ((hi_part & 0xFFFF) << 16)) >> 32
    hi = ((hi_part >> 16) + carry) & _U32
    return hi, full_lo


def philox_uniform(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """Philox-4x32-10 of the counter (low and high word as c0, c1; c2 = c3 = 0) under the 64-bit key `seed`
    (int64 tensors of one shape); the first output word's top 24 bits as a float32 in [0, 1)."""
    seed, counter = seed.long(), counter.long()
    c0, c1 = counter & _U32, (counter >> 32) & _U32
    c2, c3 = torch.zeros_like(c0), torch.zeros_like(c0)
    k0, k1 = seed & _U32, (seed >> 32) & _U32
    for _ in range(10):
        hi0, lo0 = _mulhilo(c0, _PHILOX[0])
        hi1, lo1 = _mulhilo(c2, _PHILOX[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _PHILOX[2]) & _U32, (k1 + _PHILOX[3]) & _U32
    return (c0 >> 8).float() * (1.0 / 16777216.0)


def sample_top_candidates(logits: torch.Tensor, params: torch.Tensor, rng: torch.Tensor, k_max: int,
                          whole_vocab: bool = True) -> tuple[torch.Tensor, ...]:
    """`sample_top`, plus what the later steps of the chain need (exlpy/generator/sampling/graphed.py): the
    distribution after min-p over the K = min(k_max, V) most likely tokens, descending ([B, K] float32, not
    renormalised; exact for rows whose survivors are among them), their ids [B, K] and each row's (skewed)
    random point [B]. Returns (token, prob, q, ids, r). (`whole_vocab` lets the CUDA kernel leave rows whose
    survivors pass K unfinished; here every row is exact.)"""
    r_host, skew_exp = params[:, 6:7], params[:, 5:6]
    r = torch.where(r_host >= 0, r_host, philox_uniform(rng[:, 0:1], rng[:, 1:2]).to(logits.device))
    r = torch.where(skew_exp == 1.0, r, torch.exp(skew_exp * torch.log(r)))
    tok, prob, q, ids = sorted_draw(logits, params, r.view(-1))
    kc = min(k_max, logits.shape[-1])
    return tok, prob, q[:, :kc], ids[:, :kc], r.view(-1)


def sorted_draw(logits: torch.Tensor, params: torch.Tensor, r: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chain of `sample_top` over the whole sorted vocabulary at given (already skewed) points r [B]:
    (token [B], its probability [B], the final distribution in descending order [B, V], its ids [B, V])."""
    x = logits.float() / params[:, 0:1]
    batch, vocab = x.shape
    m = x.amax(-1, keepdim=True)
    z = torch.where(x > float("-inf"), torch.exp(x - m), torch.zeros_like(x)).sum(-1, keepdim=True)
    xs, ids = x.sort(dim=-1, descending=True, stable=True)
    p = torch.where(xs > float("-inf"), torch.exp(xs - m) / z, torch.zeros_like(xs))
    j = torch.arange(vocab, device=x.device)[None]
    first = j == 0
    top_k, top_p, top_a, min_p = (params[:, i:i + 1] for i in range(1, 5))

    def renorm(v: torch.Tensor) -> torch.Tensor:
        return v / v.sum(-1, keepdim=True)

    q = torch.where(j < top_k, p, torch.zeros_like(p))
    q = torch.where(top_k < vocab, renorm(q), q)
    keep = ((q.cumsum(-1) <= top_p + 1e-6) & (q >= 1e-6)) | first
    q = torch.where((top_p > 0) & (top_p < 1), renorm(torch.where(keep, q, torch.zeros_like(q))), q)
    pmax = q.amax(-1, keepdim=True)
    q = torch.where(top_a > 0, renorm(torch.where((q >= top_a * pmax * pmax) | first, q, torch.zeros_like(q))), q)
    pmax = q.amax(-1, keepdim=True)
    q = torch.where((min_p > 0) & (min_p < 1),
                    renorm(torch.where((q >= min_p * pmax) | first, q, torch.zeros_like(q))), q)
    cum = q.cumsum(-1)
    total = q.sum(-1, keepdim=True)
    idx = (cum <= r.view(batch, 1) * total).sum(-1, keepdim=True)
    last = torch.where(q > 0, j, torch.zeros_like(j)).amax(-1, keepdim=True)
    idx = torch.minimum(idx, last)
    return ids.gather(-1, idx).view(batch), (q.gather(-1, idx) / total).view(batch), q, ids


def sample_top(logits: torch.Tensor, params: torch.Tensor, rng: torch.Tensor, k_max: int,
               whole_vocab: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of logits [B, V] (float32): softmax at the row's temperature, then exllamav2's top-k
    (renormalised when it truncates), top-p (running mass <= p, candidates < 1e-6 dropped), top-a, min-p, each
    keeping the most likely token (ties: the lower id first), and the inverse-CDF draw at r (skewed). Returns
    (token [B] int64, its final probability [B] float32; NaN or 0 when the row had no usable distribution).
    The CUDA kernel keeps k_max candidates and finishes rows without top-k whose survivors pass them over the
    whole vocabulary: the same distribution, but drawn in vocabulary order (kernels/sample_whole.py), so at a
    given point such a row's token may differ from this one's (tests compare histograms); rows with a top-k
    between k_max and the vocabulary size are not supported (the callers send them to the host chain). With
    `whole_vocab` False the kernel leaves rows without top-k whose survivors pass k_max as its candidates make
    them (callers pass it when no row lacks top-k: graphed.py)."""
    tok, prob, _, _, _ = sample_top_candidates(logits, params, rng, k_max)
    return tok, prob


