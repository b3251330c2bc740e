"""Perplexity as exllamav2's test_inference.py measures it (spec §11).

Rows are the first rows·length tokens of the dataset's text; with an architecture that needs BOS, each row
starts with BOS and drops its last token. The score of a row is the log-probability (fp32 log-softmax of the
logits + 1e-10 as exllamav2 adds it) of each next token; perplexity is exp(−mean) over all scored tokens.

- `perplexity`: one forward per row (chunked through a cache when the row is longer than max_input_len).
- `perplexity_streamed`: a model loaded for layer streaming (load(lazy=True)), scored layer-major as
  test_inference.py -sl does: every row through one module before the next module is read (2 rows at a time).
- `perplexity_token_by_token`: the row goes through the cache one token at a time, so every position reads the
  keys and values that the cache stored (quantized for Q4/Q6/Q8/FP8): the cache's own effect on quality
  (test_inference.py -et / -e8 / -eq4 / -eq6 / -eq8).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from exlpy.errors import CalibrationDataError, ConfigError


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    tokens: int  # scored tokens
    rows: int
    length: int


def dataset_rows(path: str, tokenizer: Any, rows: int, length: int, add_bos: bool = False) -> torch.Tensor:
    """[rows, length] token ids from a .parquet (every column of a row joined with spaces, as exllamav2 reads
    it), .txt or .jsonl ({"text": ...} or {"input_ids": [...]} lines) file. With `add_bos` each row starts with
    BOS and its last token is dropped."""
    from exlpy.convert.caldata import file_rows

    if rows < 1 or length < 2:
        raise ConfigError(f"perplexity needs at least 1 row of 2 tokens, got {rows} rows of {length}")
    try:
        ids = file_rows(path, tokenizer, rows, length, tokenizer.get_vocab_size())
    except CalibrationDataError as e:  # the converter's reader speaks of calibration data: say what this is
        raise CalibrationDataError(str(e).replace("calibration file", "evaluation dataset")
                                   .replace("-r/-l (-mr/-ml for measurement)", "-er/-el")) from None
    if add_bos:
        bos = torch.full((rows, 1), int(tokenizer.bos_token_id), dtype=torch.long)
        ids = torch.cat([bos, ids[:, :-1]], dim=1)
    return ids


def _row_logprob_sum(logits: torch.Tensor, ids: torch.Tensor) -> float:
    """Sum of log p(ids[i+1] | ..i) for logits [n, V] of positions 0..n-1 (the last one unused)."""
    lp = torch.log_softmax(logits[:-1].float() + 1e-10, dim=-1)
    return float(lp.gather(-1, ids[1:].to(lp.device).unsqueeze(-1)).sum())


def perplexity(model: Any, ids: torch.Tensor, progress: Callable[[int, int], None] | None = None
               ) -> PerplexityResult:
    """One forward per row; rows longer than config.max_input_len go through a cache in chunks."""
    from exlpy import ExLlamaV2Cache

    rows, length = ids.shape
    cache = ExLlamaV2Cache(model, max_seq_len=length) if length > model.config.max_input_len else None
    total, count = 0.0, 0
    for r in range(rows):
        if cache is not None:
            cache.current_seq_len = 0
        logits = model.forward(ids[r:r + 1], cache)[0]
        total += _row_logprob_sum(logits, ids[r])
        count += length - 1
        if progress is not None:
            progress(r + 1, rows)
    return PerplexityResult(math.exp(-total / count), count, rows, length)


def perplexity_streamed(model: Any, ids: torch.Tensor, rows_per_pass: int = 2,
                        progress: Callable[[int, int], None] | None = None) -> PerplexityResult:
    """Layer streaming (test_inference.py -sl): each module is read once for all rows (engine/streaming.py)."""
    from exlpy.engine.streaming import stream_rows

    rows, length = ids.shape
    total = 0.0

    def score(first: int, logits: torch.Tensor) -> None:
        nonlocal total
        for r in range(logits.shape[0]):
            total += _row_logprob_sum(logits[r], ids[first + r])
        if progress is not None:
            progress(first + logits.shape[0], rows)

    stream_rows(model, ids, rows_per_pass, score)
    count = rows * (length - 1)
    return PerplexityResult(math.exp(-total / count), count, rows, length)


CACHES = {"fp16": "ExLlamaV2Cache", "fp8": "ExLlamaV2Cache_8bit", "q4": "ExLlamaV2Cache_Q4",
          "q6": "ExLlamaV2Cache_Q6", "q8": "ExLlamaV2Cache_Q8"}


def perplexity_token_by_token(model: Any, ids: torch.Tensor, cache_kind: str = "fp16",
                              progress: Callable[[int, int], None] | None = None) -> PerplexityResult:
    """Every token of every row through the cache alone (one forward per token)."""
    import exlpy

    if cache_kind not in CACHES:
        raise ConfigError(f"unknown cache kind {cache_kind!r}: use one of {', '.join(CACHES)}")
    rows, length = ids.shape
    cache = getattr(exlpy, CACHES[cache_kind])(model, max_seq_len=length)
    total, count = 0.0, 0
    for r in range(rows):
        cache.current_seq_len = 0
        logits = [model.forward(ids[r:r + 1, i:i + 1], cache, last_id_only=True)[0, -1] for i in range(length - 1)]
        logits.append(logits[-1])  # position n-1 is not scored
        total += _row_logprob_sum(torch.stack(logits), ids[r])
        count += length - 1
        if progress is not None:
            progress(r + 1, rows)
    return PerplexityResult(math.exp(-total / count), count, rows, length)
