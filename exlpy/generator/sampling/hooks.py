"""Post-sampling hooks: `settings.post_sampling_hooks` are called in order after the draw with a
`PostSamplingResult`; a hook may replace `sampled_token` / `sampled_prob` (same shapes) to override the
choice, and may clear `feed_filters` to tell the generator not to feed the token to its filters."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PostSamplingResult:
    # None defaults as in exllamav2 (where scripts may build one); the sampler always fills every field.
    sampled_token: torch.Tensor | None = None  # [B, 1] long
    sampled_prob: torch.Tensor | None = None  # [B, 1] float
    candidate_tokens: torch.Tensor | None = None  # [B, C] long, the final candidates
    candidate_probs: torch.Tensor | None = None  # [B, C] float, their final (normalised) probabilities
    logits: torch.Tensor | None = None  # [B, V] logits after penalties, bias, DRY and masks
    feed_filters: bool = True
