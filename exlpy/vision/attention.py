"""What the tokens of a chunk holding Gemma 3 images see: causal attention, except that the tokens of one image
see each other in both directions (a sliding-window layer still counts its window from the query's position).

An image's tokens are consecutive and a chunk always holds whole images (exlpy/vision/mm.py moves chunk ends
past them), so "causal, plus the rest of my image" is "every key up to a per-query limit": the position of the
image's last token for an image token, the token's own position otherwise. The attention kernels take such
limits (`ops.paged_attention(..., limits=)`; the flash kernel reads them from device memory), so a prompt with
images runs the same kernels as a text prompt: no [T, L] mask, no gathered K/V, no host read-back.

`ImageSpans` holds them for one forward pass: how far each token sees past itself is computed on the host from
the token's image ids (which the host has anyway), uploaded once per device without waiting for the GPU, and
shared by every layer.
"""

from __future__ import annotations

import torch

from exlpy.vision.transfer import upload


def extents(blocks: torch.Tensor) -> torch.Tensor:
    """Per token of host `blocks` [B, T] (its image occurrence, -1 for text): how many positions past itself it
    sees, i.e. the distance to the last token of its image in the chunk (0 for text)."""
    B, T = blocks.shape
    if blocks.numel() == 0:
        return torch.zeros(B, T, dtype=torch.long)
    at = torch.arange(T).expand(B, T)
    img = blocks >= 0
    ids = blocks.clamp(min=0).long()
    last = torch.full((B, int(ids.max()) + 1), -1, dtype=torch.long)
    last.scatter_reduce_(1, ids, torch.where(img, at, -1), "amax")
    return torch.where(img, last.gather(1, ids) - at, 0)


class ImageSpans:
    """The per-query key limits of one forward pass whose chunk holds image tokens (host `blocks` [B, T])."""

    def __init__(self, blocks: torch.Tensor) -> None:
        self.extents = extents(blocks)  # [B, T] host int64
        self._device: dict[str, torch.Tensor] = {}
        self._limits: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._masks: dict[tuple[str, int], torch.Tensor] = {}

    def on(self, device: torch.device) -> torch.Tensor:
        """The extents on `device`, uploaded once (queued, no wait for the GPU)."""
        key = str(device)
        if key not in self._device:
            self._device[key] = upload(self.extents, device)
        return self._device[key]

    def limits(self, positions: torch.Tensor) -> torch.Tensor:
        """[B, T] last key position each query sees: positions plus extents (once per device and positions)."""
        key = str(positions.device)
        hit = self._limits.get(key)
        if hit is None or hit[0] is not positions:
            hit = (positions, positions + self.on(positions.device))
            self._limits[key] = hit
        return hit[1]

    def self_mask(self, device: torch.device, window: int, key_mask: torch.Tensor | None) -> torch.Tensor:
        """[B, 1, T, T] keep-mask of a chunk attending only to itself (no cache; the chunk starts the sequence):
        query i sees key j <= i + extent i (and i - j < window); built once per device and window."""
        key = (str(device), window)
        if key not in self._masks:
            ext = self.on(device)
            i = torch.arange(ext.shape[1], device=device)
            keep = i.view(1, 1, -1) <= (i.view(1, -1) + ext).unsqueeze(-1)  # [B, T, T]
            if window:
                keep = keep & (i.view(-1, 1) - i.view(1, -1) < window)
            if key_mask is not None:
                keep = keep & key_mask[:, None, :ext.shape[1]]
            self._masks[key] = keep.unsqueeze(1)
        return self._masks[key]
