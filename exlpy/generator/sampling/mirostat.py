"""Mirostat (v2-style, exllamav2 semantics; spec §8.3 step 4).

Before the draw: keep candidates with p >= 2^-mu (at least the most likely). After the draw:
mu += eta · (tau - surprise), surprise = -log2(p of the drawn token in the final distribution).
mu is per row and is kept by the caller in `settings.mirostat_mu` (a list, one entry per row).
"""

from __future__ import annotations

from typing import Any

import torch

from exlpy.errors import SamplerError
from exlpy.generator.sampling.truncation import keep_where


def mu_tensor(mu: list[Any] | None, batch: int, tau: float, device: torch.device) -> torch.Tensor:
    """[B, 1] float32 mu from the settings list (None, or entries 0 -> 2·tau as in exllamav2)."""
    if mu is None:
        return torch.full((batch, 1), 2.0 * tau, device=device)
    if len(mu) != batch:
        raise SamplerError(f"sampler setting mirostat_mu has {len(mu)} entries but the batch has "
                           f"{batch} rows")
    vals = torch.stack([torch.as_tensor(m, dtype=torch.float32).to(device, non_blocking=True).reshape(())
                        for m in mu]).reshape(batch, 1)
    return torch.where(vals == 0, torch.full_like(vals, 2.0 * tau), vals)


def mirostat_truncate(probs: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    return keep_where(probs, probs >= torch.pow(2.0, -mu))


def mirostat_update(mu: torch.Tensor, drawn_prob: torch.Tensor, tau: float, eta: float) -> torch.Tensor:
    surprise = -torch.log2(drawn_prob.clamp_min(1e-45))
    return mu + eta * (tau - surprise)
