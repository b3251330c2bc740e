"""Checks of a dynamic job's arguments, when it is built and when it is enqueued.

A bad job must be refused before it reaches the scheduler: there, a `max_new_tokens` of 2.5 used to raise a
TypeError on every iterate() while the job stayed queued, and a prompt id past the vocabulary failed every
batched decode step, taking the other jobs down with it.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import torch

from exlpy.errors import GeneratorError

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _is_int(v: Any) -> bool:
    """An int (numpy and 0-dim torch integers too), not a bool or a float."""
    if isinstance(v, (bool, float)) or not hasattr(v, "__index__"):
        return False
    try:
        operator.index(v)
    except TypeError:
        return False
    return True


SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes


def seeded_rng(seed: Any, name: str = "seed") -> torch.Generator:
    """A private torch RNG seeded with `seed`, an integer torch can take (a GeneratorError naming it otherwise)."""
    check_seed(seed, name)
    return torch.Generator().manual_seed(operator.index(seed))


def check_seed(seed: Any, name: str = "seed") -> None:
    if seed is None:
        return
    if not _is_int(seed):
        raise GeneratorError(f"{name} must be an integer or None, got {seed!r:.60}")
    if not SEED_MIN <= operator.index(seed) <= SEED_MAX:
        raise GeneratorError(f"{name} must fit in 64 bits ([-2**63, 2**64 - 1]), got {seed}")


def check_job_args(max_new_tokens: Any, min_new_tokens: Any, max_skips: Any, seed: Any, return_top_tokens: Any,
                   stop_conditions: Iterable[Any] | None, banned_strings: Any) -> None:
    """The scalar arguments of ExLlamaV2DynamicJob: each a GeneratorError naming the argument."""
    for name, value, lo in (("max_new_tokens", max_new_tokens, 1), ("min_new_tokens", min_new_tokens, 0),
                            ("max_skips", max_skips, 0), ("return_top_tokens", return_top_tokens, 0)):
        if not _is_int(value) or value < lo:
            raise GeneratorError(f"{name} must be an integer >= {lo}, got {value!r:.60}")
    check_seed(seed)
    if stop_conditions is not None:
        if isinstance(stop_conditions, (str, bytes)) or not isinstance(stop_conditions, Iterable):
            raise GeneratorError(f"stop_conditions must be a list of token ids and strings, got "
                                 f"{stop_conditions!r:.60}")
        for c in stop_conditions:
            if not (_is_int(c) or isinstance(c, str)) or c == "":
                raise GeneratorError(f"stop_conditions may hold token ids (int) and non-empty strings, got {c!r:.60}")
    if banned_strings is not None and (isinstance(banned_strings, str) or
                                       not all(isinstance(b, str) and b for b in banned_strings)):
        raise GeneratorError(f"banned_strings must be a list of non-empty strings, got {banned_strings!r:.60}")


def check_prompt_ids(prompt: torch.Tensor) -> None:
    if prompt.dtype not in _INT_DTYPES:
        raise GeneratorError(f"job input_ids must hold integer token ids, got dtype {prompt.dtype}")


def check_job_vocab(all_input_ids: list[torch.Tensor], vocab_size: int) -> None:
    """Every prompt id inside the model's vocabulary [0, vocab_size)."""
    for ids in all_input_ids:
        lo, hi = (int(v) for v in torch.aminmax(ids))
        if lo < 0 or hi >= vocab_size:
            raise GeneratorError(f"job input_ids hold token id {lo if lo < 0 else hi}, outside the model's "
                                 f"vocabulary [0, {vocab_size}) (vocab_size)")


def check_job_embeddings(gen: Any, job: Any) -> None:
    """A job with embeddings (images): ids inside the vocabulary or the embeddings' ranges, a model that takes
    them (embeddings of its hidden size), and no speculative decoding (as in exllamav2)."""
    from exlpy.errors import MultimodalError, NotSupportedError
    from exlpy.vision.mm import check_mm_ids

    hidden = gen.model.config.hidden_size
    for e in job.embeddings:
        if e.width != hidden:
            raise MultimodalError(f"job embeddings: {e!r} has {e.width} columns, the model's hidden "
                                  f"size is {hidden}")
    for ids in job.all_input_ids:
        check_mm_ids(ids, gen.model_vocab, job.embeddings, "job input_ids")
    if gen.spec is not None:
        raise NotSupportedError("jobs with embeddings (images) cannot run with speculative decoding (draft model or "
                                "n-gram drafting), as in exllamav2; use a generator without drafting")
