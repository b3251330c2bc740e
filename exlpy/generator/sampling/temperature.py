"""Temperature in its three places (spec §8.3 step 4): the first softmax (with optional quadratic smoothing),
the post temperature (`temperature_last`), and dynamic temperature from the candidates' entropy.

Post and dynamic temperature work in log space (softmax(log p / T)) instead of p^(1/T): same distribution,
but no underflow to an all-zero row when T is small.
"""

from __future__ import annotations

import torch

MIN_T = 1e-4  # floor for a dynamic temperature that reaches 0 (fully certain rows): avoids 0/0


def softmax_with_temperature(logits: torch.Tensor, temperature: float, smoothing: float) -> torch.Tensor:
    """p ∝ exp(l / T), or with smoothing s > 0: p ∝ exp(-(l - l_max)^2 · s / T)."""
    if smoothing > 0.0:
        lmax = logits.amax(dim=-1, keepdim=True)
        z = -(logits - lmax).square() * (smoothing / temperature)
        z = torch.where(torch.isfinite(logits), z, torch.full_like(z, float("-inf")))
        return torch.softmax(z, dim=-1)
    return torch.softmax(logits / temperature, dim=-1)


def _log(probs: torch.Tensor) -> torch.Tensor:
    return torch.where(probs > 0, probs.clamp_min(1e-45).log(), torch.full_like(probs, float("-inf")))


def apply_temperature(probs: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """p^(1/T) renormalised; `temperature` is a float or a [B, 1] tensor."""
    return torch.softmax(_log(probs) / temperature, dim=-1)


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """[B, 1] natural-log entropy of each row (zeros contribute nothing)."""
    return -(probs * torch.where(probs > 0, _log(probs), torch.zeros_like(probs))).sum(-1, keepdim=True)


def dynamic_temperature(probs: torch.Tensor, min_temp: float, max_temp: float,
                        exponent: float) -> torch.Tensor:
    """T = min + (max - min)·(H / H_max)^exponent with H_max = log(#candidates); one-candidate rows stay."""
    n = (probs > 0).sum(-1, keepdim=True)
    h_max = n.clamp_min(2).float().log()
    ratio = (entropy(probs) / h_max).clamp(0.0, 1.0)
    t = (min_temp + (max_temp - min_temp) * ratio.pow(exponent)).clamp_min(MIN_T)
    return torch.where(n > 1, apply_temperature(probs, t), probs)
