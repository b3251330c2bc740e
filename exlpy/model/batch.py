"""Per-forward metadata: positions and where each token's K/V lives in the cache."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch


@dataclass
class ForwardBatch:
    """Everything a forward pass needs besides the hidden state, built once per call.

    Caches are addressed as flat rows: a contiguous cache [batch, S, H, D] is a paged cache whose page size is
    S and whose block table for sequence b is [b]. So one attention path serves both.
    """

    batch_size: int
    q_len: int
    positions: torch.Tensor  # [B, T] int64 absolute positions
    cache: object | None = None
    slots: torch.Tensor | None = None  # [B, T] int64 flat cache rows to write
    block_table: torch.Tensor | None = None  # [B, P] int32 pages of each sequence
    page_size: int = 0
    seqlens: torch.Tensor | None = None  # [B] int32 valid keys after this step
    max_seqlen: int = 0  # host-side bound of seqlens, sizes the reference path
    past_len: int | None = None  # uniform past length of a contiguous cache: enables the slicing fast path
    key_mask: torch.Tensor | None = None  # [B, >=max_seqlen] bool, False = padding key
    # RoPE positions when they differ from the cache positions (left-padded rows start at position 0 while
    # their tokens sit further right in the cache); None means `positions`.
    rope_positions: torch.Tensor | None = None
    _per_device: dict[str, ForwardBatch] = field(default_factory=dict, repr=False)

    @property
    def rope_pos(self) -> torch.Tensor:
        return self.positions if self.rope_positions is None else self.rope_positions

    def on(self, device: torch.device) -> ForwardBatch:
        """This batch with its tensors on `device` (copied once per device, then reused by every layer)."""
        if self.positions.device == device:
            return self
        key = str(device)
        if key not in self._per_device:
            mv = lambda t: None if t is None else t.to(device, non_blocking=True)
            self._per_device[key] = replace(
                self, positions=mv(self.positions), slots=mv(self.slots), block_table=mv(self.block_table),
                seqlens=mv(self.seqlens), key_mask=mv(self.key_mask), rope_positions=mv(self.rope_positions),
                _per_device={})
        return self._per_device[key]


def contiguous_batch(batch_size: int, q_len: int, past_len: int, cache: object | None, seq_stride: int,
                     device: torch.device, key_mask: torch.Tensor | None = None,
                     row_offset: int = 0) -> ForwardBatch:
    """Batch for a non-paged cache where every row has the same past length."""
    pos = torch.arange(past_len, past_len + q_len, device=device).unsqueeze(0).expand(batch_size, -1)
    if cache is None:
        return ForwardBatch(batch_size, q_len, pos, key_mask=key_mask, max_seqlen=q_len, past_len=0)
    rows = torch.arange(row_offset, row_offset + batch_size, device=device)
    slots = rows.unsqueeze(1) * seq_stride + pos
    total = past_len + q_len
    return ForwardBatch(
        batch_size, q_len, pos, cache=cache, slots=slots, block_table=rows.int().unsqueeze(1),
        page_size=seq_stride, seqlens=torch.full((batch_size,), total, dtype=torch.int32, device=device),
        max_seqlen=total, past_len=past_len, key_mask=key_mask)
