"""Applying the mask-path filters of several jobs to a batch of logits on the device, in one kernel.

The generators call this between the forward pass and the token read-out: each constrained row's bitmask (the
AND of its filters' masks, V/8 bytes, page-locked) goes to the device and `ops.apply_token_bitmask` masks
those rows. A greedy job then takes its argmax on the device like an unconstrained one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from exlpy.generator.filters.base import mask_mode
from exlpy.kernels import ops


def device_maskable(filters: Sequence[Any], prefer_eos: bool) -> bool:
    """Whether these filters can be applied by `mask_rows` (all mask-path filters exposing a bitmask)."""
    return (bool(filters) and not prefer_eos and mask_mode(list(filters))
            and all(hasattr(f, "token_bitmask") for f in filters))


def collect(filters: Sequence[Any]) -> tuple[torch.Tensor, set[int]]:
    """Wait for each filter's mask; returns (bitmask [1, W] int32 on the host, end tokens)."""
    end: set[int] = set()
    mask: torch.Tensor | None = None
    for f in filters:
        f.get_next(mask=True)
        m = f.token_bitmask()
        mask = m if mask is None else mask & m
        if hasattr(f, "mask_end_tokens"):
            end |= set(f.mask_end_tokens())
    assert mask is not None
    return mask, end


def mask_rows(logits: torch.Tensor, rows: list[int], masks: list[torch.Tensor]) -> torch.Tensor:
    """logits [R, V] with rows[i] masked by masks[i] ([1, W]); a new tensor (the input may be a graph output)."""
    bm = masks[0] if len(masks) == 1 else torch.cat(masks)
    if logits.is_cuda and not bm.is_pinned():
        bm = bm.pin_memory()
    bm = bm.to(logits.device, non_blocking=True)
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        return ops.apply_token_bitmask(logits, bm)
    idx = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
    return logits.index_copy(0, idx, ops.apply_token_bitmask(logits.index_select(0, idx), bm))


def premask_jobs(jobs: Sequence[Any], first: list[int], logits: torch.Tensor) -> torch.Tensor:
    """The dynamic generator's step: apply the device-maskable filters of `jobs` (a job's rows start at
    first[k] in logits [R, V]); sets each job's `premask_end` (None for jobs left to the sampler)."""
    rows, masks = [], []
    for k, j in enumerate(jobs):
        j.premask_end = None
        if j.filters and j.device_masked():
            mask, j.premask_end = collect(j.filters)
            rows += [first[k] + r for r in range(len(j.seqs))]
            masks += [mask] * len(j.seqs)
    return mask_rows(logits, rows, masks) if rows else logits
