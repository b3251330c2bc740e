"""Batched decode through `model.forward_batch` over a paged cache: the dynamic generator's decode step."""

from __future__ import annotations

import time
from typing import Any

import torch

from exlpy.cli.bench import DecodeResult, kv_bytes_per_token, weight_bytes_read
from exlpy.model.batch import ForwardBatch


def time_paged_decode(model: Any, batch: int, context: int, gen_len: int, page_size: int = 256,
                      warmup: int = 3) -> DecodeResult:
    """`batch` sequences whose pages are scattered over one pool, each with `context` tokens already cached.

    The cache holds zeros where a prefill would have written K/V: decode speed does not depend on the values.
    """
    from exlpy import ExLlamaV2Cache

    pages_per_seq = (context + gen_len + warmup + page_size - 1) // page_size
    n_pages = batch * pages_per_seq
    pool = ExLlamaV2Cache(model, batch_size=n_pages, max_seq_len=page_size)  # [pages, page_size, H, D]
    dev = torch.device("cuda:0")
    bt = torch.randperm(n_pages, device=dev).view(batch, pages_per_seq).int()
    g = torch.Generator(device="cuda").manual_seed(0)
    tok = torch.randint(0, model.config.vocab_size, (batch, 1), device=dev, generator=g)

    def step(pos: int, tok: torch.Tensor) -> torch.Tensor:
        positions = torch.full((batch, 1), pos, dtype=torch.long, device=dev)
        slots = bt[:, pos // page_size].long().view(batch, 1) * page_size + pos % page_size
        fb = ForwardBatch(batch, 1, positions, cache=pool, slots=slots, block_table=bt, page_size=page_size,
                          seqlens=torch.full((batch,), pos + 1, dtype=torch.int32, device=dev),
                          max_seqlen=pos + 1)
        logits = model.forward_batch(tok, fb)
        return logits[:, -1].argmax(-1, keepdim=True)

    for i in range(warmup):
        tok = step(context + i, tok)
    out = torch.empty(batch, gen_len, dtype=torch.long, device=dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(gen_len):
        tok = step(context + i, tok)
        out[:, i:i + 1] = tok
    out.cpu()
    dt = time.perf_counter() - t0
    step_bytes = weight_bytes_read(model) + batch * (context + (gen_len + 1) / 2) * kv_bytes_per_token(model)
    return DecodeResult(batch, context, gen_len, dt, step_bytes)
