"""Prefill and decode speed sweeps as exllamav2's test_inference.py runs them (-ps, -s; spec §11)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch


def prefill_lengths(max_seq_len: int) -> list[int]:
    """128, 256, ... 1024 (+128), then +1024 to 4096, +4096 to 16384, +8192 beyond, up to max_seq_len."""
    out, n = [], 128
    while n <= max_seq_len:
        out.append(n)
        n += 128 if n < 1024 else 1024 if n < 4096 else 4096 if n < 16384 else 8192
    return out


def _sync(model: Any) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prefill_speed(model: Any, max_seq_len: int, runs: int = 3, seed: int = 0) -> Iterator[tuple[int, float]]:
    """(prompt length, tokens/s: the best of `runs`) for each length of prefill_lengths(max_seq_len); random ids,
    a fresh cache position each run."""
    from exlpy import ExLlamaV2Cache

    cache = ExLlamaV2Cache(model, max_seq_len=max_seq_len)
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    for n in prefill_lengths(max_seq_len):
        best = float("inf")
        for _ in range(runs):
            ids = torch.randint(0, vocab, (1, n), generator=g)
            cache.current_seq_len = 0
            _sync(model)
            t0 = time.perf_counter()
            model.forward(ids, cache, preprocess_only=True)
            _sync(model)
            best = min(best, time.perf_counter() - t0)
        yield n, n / best


def decode_speed(model: Any, tokenizer: Any, max_seq_len: int, window: int = 128, prompt: str = "X"
                 ) -> Iterator[tuple[int, int, float]]:
    """Greedy decoding from `prompt` to max_seq_len: (window start, window end, tokens/s) per `window`
    positions."""
    from exlpy import ExLlamaV2Cache

    cache = ExLlamaV2Cache(model, max_seq_len=max_seq_len)
    ids = tokenizer.encode(prompt, add_bos=True)
    logits = model.forward(ids[:, :-1], cache, preprocess_only=True) if ids.shape[1] > 1 else None
    del logits
    token = ids[:, -1:]
    pos = cache.current_seq_len
    while pos < max_seq_len:
        start, end = pos, min(max_seq_len, (pos // window + 1) * window)
        _sync(model)
        t0 = time.perf_counter()
        for _ in range(end - start):
            out = model.forward(token, cache, last_id_only=True)
            token = out[:, -1:].argmax(-1)
        _sync(model)
        pos = cache.current_seq_len
        yield start, end - 1, (end - start) / (time.perf_counter() - t0)
