"""Classifier-free guidance merge (spec §8.1/§8.3 step 1)."""

from __future__ import annotations

import torch

from exlpy.errors import SamplerError


def cfg_merge(logits: torch.Tensor, scale: float) -> torch.Tensor:
    """[2, V] (positive, negative prompt) -> [1, V]: scale·logsoftmax(l0) + (1 - scale)·logsoftmax(l1)."""
    if logits.shape[0] != 2:
        raise SamplerError(f"cfg_scale needs logits for exactly 2 sequences (positive, negative), "
                           f"got batch {logits.shape[0]}")
    lp = torch.log_softmax(logits, dim=-1)
    return (scale * lp[0] + (1.0 - scale) * lp[1]).unsqueeze(0)
