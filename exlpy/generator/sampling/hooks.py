"""Post-sampling hooks: `settings.post_sampling_hooks` are called in order after the draw with a
`PostSamplingResult`; a hook may replace `sampled_token` / `sampled_prob` (same shapes) to override the
choice, and may clear `feed_filters` to tell the generator not to feed the token to its filters."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PostSamplingResult:
    sampled_token: torch.Tensor  # [B, 1] long
    sampled_prob: torch.Tensor  # [B, 1] float
    candidate_tokens: torch.Tensor  # [B, C] long, the final candidates
    candidate_probs: torch.Tensor  # [B, C] float, their final (normalised) probabilities
    logits: torch.Tensor  # [B, V] logits after penalties, bias, DRY and masks
    feed_filters: bool = True
