"""Attention of a chunk that holds Gemma 3 image tokens: causal, except that the tokens of one image see each
other in both directions (and a sliding-window layer still sees only its window), as transformers' Gemma 3
masks it. The chunk always holds whole images (exlpy/vision/mm.py moves chunk ends past them), so a token's
later image neighbours are all in the chunk. It runs through the torch reference attention with an explicit
mask: prompts with images pay this once per prefill; decoding never comes here."""

from __future__ import annotations

from typing import Any

import torch

from exlpy.errors import NotSupportedError
from exlpy.kernels import ops


def attend_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Any, layer_idx: int, scale: float,
                  rope: tuple[torch.Tensor, torch.Tensor], window: int, softcap: float) -> torch.Tensor:
    B, T = q.shape[:2]
    blocks = batch.mm.blocks.to(q.device)  # [B, T]
    qpos = batch.positions.to(q.device)  # [B, T] cache positions
    q, k = ops.apply_rope(q, k, rope[0], rope[1], batch.rope_pos)
    cache = batch.cache
    if cache is None:
        keys, values, kpos, kblk = k, v, qpos, blocks
        valid = torch.ones_like(kpos, dtype=torch.bool)
    else:
        if getattr(cache, "layer_codes", None) is not None:
            raise NotSupportedError("Gemma 3 images with a quantized KV cache (Q4/Q6/Q8/FP8) are not supported yet; "
                                    "use an FP16 cache")
        k_cache, v_cache = cache.layer_kv(layer_idx)
        ops.store_kv(k_cache, v_cache, batch.slots, k, v)
        L = batch.max_seqlen
        p = torch.arange(L, device=q.device)
        table = batch.block_table.to(q.device)
        size = batch.page_size
        slots = table[:, p // size] * size + p % size  # [B, L] flat cache rows of positions 0..L-1
        hk, d = k_cache.shape[-2:]
        keys = k_cache.reshape(-1, hk, d)[slots]
        values = v_cache.reshape(-1, hk, d)[slots]
        kpos = p.unsqueeze(0).expand(B, L)
        valid = kpos < batch.seqlens.to(q.device).view(-1, 1)
        # image ids of keys: the chunk's own tokens carry them; earlier keys are in the past anyway
        start = qpos[:, :1]
        kblk = torch.full((B, L), -1, dtype=blocks.dtype, device=q.device)
        inside = (kpos >= start) & (kpos < start + T)
        kblk[inside] = blocks.reshape(-1)[(kpos - start + torch.arange(B, device=q.device).view(-1, 1) * T)[inside]]
    qp, kp = qpos.unsqueeze(-1), kpos.unsqueeze(1)  # [B, T, 1], [B, 1, L]
    same = (blocks.unsqueeze(-1) == kblk.unsqueeze(1)) & (blocks.unsqueeze(-1) >= 0)
    mask = ((kp <= qp) | same) & valid.unsqueeze(1)
    if window:
        mask = mask & (qp - kp < window)
    return ops.sdpa(q, keys, values, scale, mask.unsqueeze(1), softcap=softcap)
