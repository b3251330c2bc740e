"""Truncation samplers on sorted candidates (spec §8.3 step 4).

Every step takes `probs` [B, C], the candidates of each row in descending order (entries already excluded
are 0), and returns a renormalised copy with more entries set to 0. At least one candidate (the most likely)
always survives. Top-k happens earlier, when the candidates are extracted (see `chain.candidates`).
"""

from __future__ import annotations

import torch

TOP_P_DROP = 1e-6  # exllamav2 drops candidates below this during top-p
TOP_P_TOL = 1e-6  # float slack so that a prefix summing exactly to p is kept despite rounding


def renormalize(probs: torch.Tensor) -> torch.Tensor:
    return probs / probs.sum(-1, keepdim=True)


def keep_where(probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    keep = keep.clone()
    keep[:, 0] = True  # the most likely candidate always survives
    return renormalize(torch.where(keep, probs, torch.zeros_like(probs)))


def top_p(probs: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the most likely tokens while their cumulative mass stays <= p: the token that would cross p is
    excluded (exllamav2 semantics, unlike HF which includes it); candidates below 1e-6 are dropped."""
    cum = probs.cumsum(-1)
    return keep_where(probs, (cum <= p + TOP_P_TOL) & (probs >= TOP_P_DROP))


def top_a(probs: torch.Tensor, a: float) -> torch.Tensor:
    """Keep p >= a · p_max^2."""
    pmax = probs[:, :1]
    return keep_where(probs, probs >= a * pmax * pmax)


def min_p(probs: torch.Tensor, m: float) -> torch.Tensor:
    """Keep p >= min_p · p_max."""
    return keep_where(probs, probs >= m * probs[:, :1])


def tail_free(probs: torch.Tensor, z: float) -> torch.Tensor:
    """TFS: d_i = |p_i - 2 p_{i+1} + p_{i+2}| over the n sorted candidates (i < n - 2), normalised; with k the
    number of leading d whose running sum stays <= z, keep k + 1 tokens. Rows with < 3 candidates stay."""
    batch, c = probs.shape
    if c < 3:
        return probs
    n = (probs > 0).sum(-1, keepdim=True)
    d = (probs[:, :-2] - 2 * probs[:, 1:-1] + probs[:, 2:]).abs()
    d = torch.where(torch.arange(c - 2, device=probs.device)[None] < n - 2, d, torch.zeros_like(d))
    dsum = d.sum(-1, keepdim=True)
    cum = (d / dsum.clamp_min(1e-30)).cumsum(-1)
    k = torch.minimum((cum <= z).sum(-1, keepdim=True), n - 2)
    keep_n = torch.where((n < 3) | (dsum <= 0), n, k + 1)
    return keep_where(probs, torch.arange(c, device=probs.device)[None] < keep_n)


def typical(probs: torch.Tensor, mass: float) -> torch.Tensor:
    """Locally typical sampling: order candidates by |surprise - entropy|, keep the smallest prefix of that
    order whose mass reaches `mass` (the token that reaches it is included)."""
    logp = torch.where(probs > 0, probs.clamp_min(1e-45).log(), torch.zeros_like(probs))
    h = -(probs * logp).sum(-1, keepdim=True)
    dev = torch.where(probs > 0, (-logp - h).abs(), torch.full_like(probs, float("inf")))
    order = dev.argsort(dim=-1, stable=True)
    p_ord = probs.gather(-1, order)
    before = p_ord.cumsum(-1) - p_ord
    keep_ord = (before < mass) & (p_ord > 0)
    keep_ord[:, 0] = True
    keep = torch.zeros_like(keep_ord).scatter_(-1, order, keep_ord)
    # the most likely token may not be the most typical one: do not force it in like the other steps
    return renormalize(torch.where(keep, probs, torch.zeros_like(probs)))
