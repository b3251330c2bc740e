"""XTC, "exclude top choices" (spec §8.3 step 4), with the intended semantics rather than the native code's.

If at least two candidates not in the ignore set have p >= threshold, all of those except the least likely
of them are "top choices". The original algorithm removes them with probability `probability`; we apply the
exact expected result of that coin flip instead, so no extra random number is needed and the draw still
follows the caller's seed: top choices get (1 - probability)·p, every other candidate is scaled by
(1 - (1 - probability)·S) / (1 - S), S = mass of the top choices, so the row still sums to 1.
With probability 1 the top choices are removed outright.
"""

from __future__ import annotations

import torch


def xtc(probs: torch.Tensor, ids: torch.Tensor, probability: float, threshold: float,
        ignore: torch.Tensor | None) -> torch.Tensor:
    """probs/ids [B, C] candidates; ignore bool [V] or None -> reweighted probs (same order)."""
    eligible = (probs >= threshold) & (probs > 0)
    if ignore is not None:
        eligible &= ~ignore[ids]
    least = torch.where(eligible, probs, torch.full_like(probs, float("inf"))).argmin(-1, keepdim=True)
    top = eligible.scatter(-1, least, False) & (eligible.sum(-1, keepdim=True) >= 2)
    mass = torch.where(top, probs, torch.zeros_like(probs)).sum(-1, keepdim=True)
    rest_scale = (1.0 - (1.0 - probability) * mass) / (1.0 - mass).clamp_min(1e-30)
    return torch.where(top, probs * (1.0 - probability), probs * rest_scale)
