"""`ExLlamaV2Filter`: exllamav2's constrained-decoding protocol.

A filter sees the generated tokens one at a time and, before each sampling step, says which tokens may come
next. Two ways to say it:

- `next() -> (pass_tokens, end_tokens)`: sets (or lists) of ids; `pass_tokens` None means "anything", and a
  sampled token in `end_tokens` ends the generation (`eos_reason` "end_filter").
- `can_mask_logits()` True: `prepare_logit_mask()` computes a mask on the host and `mask_logits(logits)` sets
  the excluded logits to -inf on the logits' own device. When every filter of a job can mask, the sampler uses
  this path only (exllamav2's rule); the grammar filter takes it, with a 32-tokens-per-int32 bitmask.

CPU-heavy filters return True from `use_background_worker()`: the generators then start `next()` (or
`prepare_logit_mask()`) in a worker thread right after `feed()`, so it runs while the GPU computes the next
logits, and `get_next()` collects the result.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from exlpy.errors import GeneratorError

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def filter_pool() -> ThreadPoolExecutor:
    """The process-wide worker pool for background filter evaluation (created on first use)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="exlpy-filter")
        return _POOL


class ExLlamaV2Filter:
    """Base class of filters; subclasses implement `begin`, `feed` and `next` (and optionally the mask path)."""

    allow_return_type_list: bool = True  # next() may return lists instead of sets (exllamav2 compatibility)

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.sequence_str = ""
        self.background_result: Future[Any] | None = None

    def clone(self, c: ExLlamaV2Filter | None = None) -> ExLlamaV2Filter:
        """A copy with the same model, tokenizer and text so far (subclasses copy their own state too)."""
        if c is None:
            c = type(self).__new__(type(self))
        c.model = self.model
        c.tokenizer = self.tokenizer
        c.sequence_str = self.sequence_str
        c.background_result = None
        return c

    # --- protocol ------------------------------------------------------------------------------------------
    def begin(self, prefix_str: str) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not implement begin()")

    def feed(self, token: Any) -> None:
        """The sampled token, as exllamav2 passes it: a [1, 1] LongTensor (`token_id(token)` gives the int;
        third-party filters such as lm-format-enforcer's read `token[0][0]`)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement feed()")

    def next(self) -> tuple[Any, Any]:
        raise NotImplementedError(f"{type(self).__name__} does not implement next()")

    def use_background_worker(self) -> bool:
        """Whether next()/prepare_logit_mask() should run in a worker thread while the GPU works."""
        return False

    def can_mask_logits(self) -> bool:
        """Whether this filter applies its constraint with mask_logits() instead of next()."""
        return False

    def prepare_logit_mask(self) -> bool:
        """Compute the mask for the next token (host side); called in place of next()."""
        raise NotImplementedError(f"{type(self).__name__} cannot mask logits")

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits with every token the filter excludes set to -inf (on the logits' device)."""
        raise NotImplementedError(f"{type(self).__name__} cannot mask logits")

    # --- background evaluation -----------------------------------------------------------------------------
    def background_next(self, pool: ThreadPoolExecutor | None = None) -> None:
        """Start next() in the worker pool; get_next() returns its result."""
        self._submit(self.next, pool)

    def background_prepare_logit_mask(self, pool: ThreadPoolExecutor | None = None) -> None:
        """Start prepare_logit_mask() in the worker pool; get_next(mask=True) waits for it."""
        self._submit(self.prepare_logit_mask, pool)

    def _submit(self, fn: Any, pool: ThreadPoolExecutor | None) -> None:
        if self.background_result is not None:
            raise GeneratorError(f"{type(self).__name__}: a background evaluation is already pending; "
                                 "call get_next() or background_drop() first")
        self.background_result = (pool or filter_pool()).submit(fn)

    def background_drop(self) -> None:
        """Wait for and discard a pending background result (e.g. the job ended before it was needed)."""
        if self.background_result is not None:
            r, self.background_result = self.background_result, None
            try:
                r.result()
            except Exception:  # noqa: BLE001 - a result nobody will read: its error does not matter any more
                pass

    def get_next(self, mask: bool = False) -> Any:
        """The pending background result if there is one, else next() (or prepare_logit_mask() with `mask`)."""
        if self.background_result is None:
            return self.prepare_logit_mask() if mask else self.next()
        r, self.background_result = self.background_result, None
        return r.result()


def mask_mode(filters: list[Any]) -> bool:
    """exllamav2's rule: the mask path is used when every filter of the stack can mask logits."""
    return bool(filters) and all(getattr(f, "can_mask_logits", lambda: False)() for f in filters)


def schedule_background(filters: list[Any]) -> None:
    """Start the next evaluation of every background-capable filter (called right after feed())."""
    masked = mask_mode(filters)
    for f in filters:
        if getattr(f, "use_background_worker", lambda: False)() and getattr(f, "background_result", 1) is None:
            if masked:
                f.background_prepare_logit_mask(filter_pool())
            else:
                f.background_next(filter_pool())


def drop_background(filters: list[Any]) -> None:
    for f in filters:
        if hasattr(f, "background_drop"):
            f.background_drop()


def token_id(token: Any) -> int:
    """The id of a token handed to `feed`: a [1, 1] tensor (what the generators pass, as exllamav2 does) or an
    int (callers that feed filters by hand)."""
    return int(token.reshape(-1)[0]) if hasattr(token, "reshape") else int(token)


def feed_token(filters: Any, token: int) -> None:
    """Feed one sampled token to every filter, in exllamav2's form ([1, 1] LongTensor)."""
    feeders = [f for f in filters or () if hasattr(f, "feed")]  # plain callables (logit masks) have no state
    if feeders:
        t = torch.tensor([[token]], dtype=torch.long)
        for f in feeders:
            f.feed(t)
