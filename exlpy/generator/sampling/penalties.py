"""Repetition, frequency and presence penalties over a (decaying) window of the context (spec §8.3 step 2).

Semantics (exllamav2's): scanning back from the newest token, the newest `range` tokens count fully
(`range` -1 = the whole context); the `decay` tokens before them count with weight 1 - k/decay (k = 0 for
the first of them), older tokens not at all. For a token t with weights w over its occurrences:
  l_t -> l_t / r if l_t > 0 else l_t * r,  r = 1 + (rep - 1)·max(w)   (its newest occurrence)
  l_t -= presence·max(w) + frequency·sum(w)
Vectorised with two scatters, O(B·L) work, no host sync.
"""

from __future__ import annotations

import torch


def context_weights(length: int, rep_range: int, decay: int, device: torch.device) -> torch.Tensor:
    """[length] float weights of context positions (oldest first) for the penalty window."""
    dist = torch.arange(length - 1, -1, -1, device=device, dtype=torch.float32)  # 0 = newest token
    if rep_range < 0:
        return torch.ones(length, device=device)
    full = (dist < rep_range).float()
    if decay <= 0:
        return full
    fade = (1.0 - (dist - rep_range) / decay).clamp(0.0, 1.0)
    return torch.where(dist < rep_range, full, fade)


def apply_penalties(logits: torch.Tensor, sequence_ids: torch.Tensor, repetition: float, rep_range: int,
                    decay: int, frequency: float, presence: float) -> torch.Tensor:
    """logits [B, V], sequence_ids [B, L] (ids outside [0, V) ignored) -> penalised copy of logits."""
    batch, vocab = logits.shape
    seq = sequence_ids.to(logits.device, non_blocking=True).long()
    w = context_weights(seq.shape[1], rep_range, decay, logits.device).expand(batch, -1)
    valid = (seq >= 0) & (seq < vocab)
    w = w * valid
    ids = seq.clamp(0, vocab - 1)
    wmax = torch.zeros_like(logits).scatter_reduce_(1, ids, w, reduce="amax")
    wsum = torch.zeros_like(logits).scatter_add_(1, ids, w)
    r = 1.0 + (repetition - 1.0) * wmax
    out = torch.where(logits > 0, logits / r, logits * r)
    return out - presence * wmax - frequency * wsum
