"""`ExLlamaV2Sampler.Settings`: every knob of spec §8.3 with its exllamav2 default, plus validation.

Validation runs in `__post_init__` and again at every `sample()` call, because users mutate fields between
calls (`settings.top_p = 1.5`). Each failure is a `SamplerError` naming the setting and its value.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from exlpy.arguments import refuse_unknown_arguments
from exlpy.errors import SamplerError
from exlpy.generator.sampling.tokenizer_info import token_bias_size


@dataclass
class SamplerSettings:
    """Sampling settings; defaults are exllamav2's (spec §8.3). See `ExLlamaV2Sampler.sample` for the order.

    Mirostat state lives in `mirostat_mu`: a list with one entry per (post-CFG) batch row, initialised to
    2·tau on first use. The sampler writes 0-d float32 tensors on the logits' device there (no host sync);
    `float(settings.mirostat_mu[i])` reads one. Users may also assign plain floats.
    """

    token_repetition_penalty: float = 1.025
    token_repetition_range: int = -1
    token_repetition_decay: int = 0
    token_frequency_penalty: float = 0.0
    token_presence_penalty: float = 0.0

    temperature: float = 0.8
    smoothing_factor: float = 0.0
    min_temp: float = 0.0
    max_temp: float = 0.0
    temp_exponent: float = 1.0
    top_k: int = 50
    top_p: float = 0.8
    top_a: float = 0.0
    min_p: float = 0.0
    tfs: float = 0.0
    typical: float = 0.0
    skew: float = 0.0

    temperature_last: bool = False

    mirostat: bool = False
    mirostat_tau: float = 1.5
    mirostat_eta: float = 0.1
    mirostat_mu: list[Any] | None = None

    token_bias: torch.Tensor | None = None
    cfg_scale: float | None = None

    post_sampling_hooks: list[Callable[..., Any]] = field(default_factory=list)

    dry_allowed_length: int = 2
    dry_base: float = 1.75
    dry_multiplier: float = 0.0
    dry_sequence_breakers: set[int] | None = None
    dry_range: int = 0
    dry_max_ngram: int = 20

    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    xtc_ignore_tokens: frozenset[int] | set[int] | None = None

    def __post_init__(self) -> None:
        self.validate()

    # ---------------------------------------------------------------- helpers (exllamav2 API)

    @classmethod
    def greedy(cls, **kwargs: Any) -> SamplerSettings:
        """Greedy decoding: temperature 1, no repetition penalty, top_p 0, top_k 1; `kwargs` override."""
        args: dict[str, Any] = {"temperature": 1.0, "token_repetition_penalty": 1.0, "top_p": 0.0, "top_k": 1}
        args.update(kwargs)
        return cls(**args)

    def clone(self) -> SamplerSettings:
        """Independent copy: lists, sets and the bias tensor are copied: mutating one leaves the other."""
        c = copy.copy(self)
        c.post_sampling_hooks = list(self.post_sampling_hooks)
        c.mirostat_mu = None if self.mirostat_mu is None else list(self.mirostat_mu)
        c.token_bias = None if self.token_bias is None else self.token_bias.clone()
        if self.dry_sequence_breakers is not None:
            c.dry_sequence_breakers = set(self.dry_sequence_breakers)
        return c

    def greedy_clone(self) -> SamplerSettings:
        """Greedy settings keeping this one's repetition penalties and DRY (what draft models use)."""
        c = type(self)(top_k=1, top_p=0.0)
        for name in ("token_repetition_penalty", "token_repetition_range", "token_repetition_decay",
                     "token_frequency_penalty", "token_presence_penalty", "dry_allowed_length", "dry_base",
                     "dry_multiplier", "dry_range", "dry_max_ngram"):
            setattr(c, name, getattr(self, name))
        if self.dry_sequence_breakers is not None:
            c.dry_sequence_breakers = set(self.dry_sequence_breakers)
        return c

    def _ensure_bias(self, tokenizer: Any, fill: float) -> torch.Tensor:
        if self.token_bias is None:
            self.token_bias = torch.full((token_bias_size(tokenizer),), fill, dtype=torch.float32)
        return self.token_bias

    def disallow_tokens(self, tokenizer: Any, tokens: Iterable[int]) -> None:
        """Set the bias of `tokens` to -inf (creating a zero bias of the padded vocab size if none)."""
        bias = self._ensure_bias(tokenizer, 0.0)
        ids = _check_ids(list(tokens), bias.numel(), "disallow_tokens")
        if ids:
            bias[torch.tensor(ids, dtype=torch.long)] = float("-inf")

    def allow_tokens(self, tokenizer: Any, tokens: Sequence[int | str]) -> None:
        """Disallow every token except `tokens` (ids, or strings that encode to a single token)."""
        bias = self._ensure_bias(tokenizer, 0.0)
        ids: list[int] = []
        for t in tokens:
            if isinstance(t, bool) or not isinstance(t, (int, str)):
                raise SamplerError(f"allow_tokens: entries must be int ids or str pieces, got {t!r}")
            ids.append(t if isinstance(t, int) else _single_id(tokenizer, t))
        ids = _check_ids(ids, bias.numel(), "allow_tokens")
        keep = torch.zeros(bias.numel(), dtype=torch.bool)
        if ids:
            keep[torch.tensor(ids, dtype=torch.long)] = True
        bias.masked_fill_(~keep, float("-inf"))

    # ---------------------------------------------------------------- validation

    def validate(self) -> None:
        """Raise SamplerError naming the first setting whose value is out of range."""
        _number(self, "token_repetition_penalty", lo=0.0, lo_open=True)
        _integer(self, "token_repetition_range", lo=-1)
        _integer(self, "token_repetition_decay", lo=0)
        _number(self, "token_frequency_penalty")
        _number(self, "token_presence_penalty")
        _number(self, "temperature", lo=0.0)
        _number(self, "smoothing_factor", lo=0.0)
        _number(self, "min_temp", lo=0.0)
        _number(self, "max_temp", lo=0.0)
        _number(self, "temp_exponent", lo=0.0)
        _integer(self, "top_k", lo=0)
        for name in ("top_p", "top_a", "min_p", "tfs", "typical", "xtc_probability", "xtc_threshold"):
            _number(self, name, lo=0.0, hi=1.0)
        _number(self, "skew")
        _number(self, "mirostat_tau", lo=0.0)
        _number(self, "mirostat_eta", lo=0.0)
        if self.cfg_scale is not None:
            _number(self, "cfg_scale")
        _integer(self, "dry_allowed_length", lo=1)
        _number(self, "dry_base", lo=0.0, lo_open=True)
        _number(self, "dry_multiplier", lo=0.0)
        _integer(self, "dry_range", lo=0)
        _integer(self, "dry_max_ngram", lo=1)
        for name in ("temperature_last", "mirostat"):
            if not isinstance(getattr(self, name), bool):
                raise SamplerError(f"sampler setting {name} must be a bool, got {getattr(self, name)!r}")
        if self.token_bias is not None and (not isinstance(self.token_bias, torch.Tensor)
                                            or self.token_bias.dim() != 1
                                            or not self.token_bias.is_floating_point()):
            raise SamplerError(f"sampler setting token_bias must be a 1-D float tensor, "
                               f"got {self.token_bias!r}")
        hooks = self.post_sampling_hooks
        if not isinstance(hooks, list) or not all(callable(h) for h in hooks):
            raise SamplerError("sampler setting post_sampling_hooks must be a list of callables, "
                               f"got {self.post_sampling_hooks!r}")
        for name in ("dry_sequence_breakers", "xtc_ignore_tokens"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, (str, bytes)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in v)):
                raise SamplerError(f"sampler setting {name} must be a set of int token ids, got {v!r}")
        if self.mirostat_mu is not None and not isinstance(self.mirostat_mu, list):
            raise SamplerError(f"sampler setting mirostat_mu must be None or a list (one per row), "
                               f"got {self.mirostat_mu!r}")


def _number(s: SamplerSettings, name: str, lo: float | None = None, hi: float | None = None,
            lo_open: bool = False) -> None:
    v = getattr(s, name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise SamplerError(f"sampler setting {name} must be a finite number, got {v!r}")
    if lo is not None and (v < lo or (lo_open and v == lo)):
        bound = f"> {lo}" if lo_open else f">= {lo}"
        upper = f" and <= {hi}" if hi is not None else ""
        raise SamplerError(f"sampler setting {name} must be {bound}{upper}, got {v!r}")
    if hi is not None and v > hi:
        raise SamplerError(f"sampler setting {name} must be in [{lo}, {hi}], got {v!r}")


def _integer(s: SamplerSettings, name: str, lo: int) -> None:
    v = getattr(s, name)
    if isinstance(v, bool) or not isinstance(v, int):
        raise SamplerError(f"sampler setting {name} must be an int, got {v!r}")
    if v < lo:
        raise SamplerError(f"sampler setting {name} must be >= {lo}, got {v!r}")


def _check_ids(ids: list[int], size: int, where: str) -> list[int]:
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < size:
            raise SamplerError(f"{where}: token id {t!r} is outside the token_bias range [0, {size})")
    return ids


def _single_id(tokenizer: Any, piece: str) -> int:
    if tokenizer is not None and hasattr(tokenizer, "single_id"):
        try:
            found = tokenizer.single_id(piece)
        except Exception as e:  # the tokenizer's own error type varies; re-raise as ours, naming the string
            raise SamplerError(f"allow_tokens: {piece!r} is not a single token ({e})") from e
        if found is None:  # exllamav2's single_id answers None for text that is not one token
            raise SamplerError(f"allow_tokens: {piece!r} is not a single token")
        return int(found)
    raise SamplerError(f"allow_tokens: string {piece!r} needs a tokenizer with single_id()")


# A misspelt setting (Settings(temprature=0.5)) is an error naming it, not a silent default.
SamplerSettings.__init__ = refuse_unknown_arguments(SamplerSettings.__init__)  # type: ignore[method-assign]
