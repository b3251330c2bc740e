"""Skew (spec §8.3 step 4): bends the random sampling point, r' = r^exp(-skew), before the inverse-CDF draw
over candidates sorted by descending probability; skew > 0 favours less likely tokens, < 0 likely ones."""

from __future__ import annotations

import math

import torch


def skew_random(r: torch.Tensor, skew: float) -> torch.Tensor:
    return r.pow(math.exp(-skew))
