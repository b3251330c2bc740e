"""Builds the sampler's two chains from Settings, skipping disabled steps (spec §8.3 "Pipeline in sample").

Logit stage (full vocab, [B, V]): penalties -> blocked tokens -> token bias -> DRY -> filters -> token
healing -> vocab limit. Probability stage (sorted candidates, [B, C]): softmax with temperature/smoothing and
top-k (`candidates`) -> top-p -> top-a -> min-p -> TFS -> typical -> mirostat -> post/dynamic temperature ->
XTC. Skew and the draw follow in the sampler. Every step is a pure function of its inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from exlpy.generator.sampling import logit_masks, truncation
from exlpy.generator.sampling.dry import dry_penalty
from exlpy.generator.sampling.mirostat import mirostat_truncate
from exlpy.generator.sampling.penalties import apply_penalties
from exlpy.generator.sampling.settings import SamplerSettings
from exlpy.generator.sampling.temperature import (
    apply_temperature,
    dynamic_temperature,
    softmax_with_temperature,
)
from exlpy.generator.sampling.tokenizer_info import (
    cached_id_mask,
    default_dry_breakers,
    default_xtc_ignore,
    id_mask,
    vocab_size,
)
from exlpy.generator.sampling.xtc import xtc

LogitStep = Callable[[torch.Tensor], torch.Tensor]
ProbStep = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (probs [B, C], ids [B, C]) -> probs

GREEDY_BELOW = 0.01  # temperature below this samples greedily (spec §8.3)


@dataclass
class LogitContext:
    """Per-call inputs of the logit stage besides the settings."""

    sequence_ids: torch.Tensor | None  # [B, L] or None
    tokenizer: Any = None
    prefix_ids: list[int] | None = None  # token healing, one per row
    blocked_tokens: Sequence[int] | None = None
    filter_mask: torch.Tensor | None = None  # [B, V] from logit_masks.evaluate_filters
    filter_step: LogitStep | None = None  # mask-path filters (logit_masks.mask_filter_step)


def _token_mask(tokenizer: Any, key: str, explicit: Any, default: Callable[[Any], set[int]], vocab: int,
                device: torch.device) -> torch.Tensor | None:
    if explicit is not None:
        return id_mask(set(explicit), vocab, device)
    if tokenizer is None:
        return None
    return cached_id_mask(tokenizer, key, default(tokenizer), vocab, device)


def logit_chain(s: SamplerSettings, ctx: LogitContext, vocab: int, device: torch.device) -> list[LogitStep]:
    steps: list[LogitStep] = []
    seq = ctx.sequence_ids
    has_context = seq is not None and seq.numel() > 0
    if has_context and (s.token_repetition_penalty != 1.0 or s.token_frequency_penalty != 0.0
                        or s.token_presence_penalty != 0.0):
        steps.append(partial(_penalties, seq=seq, s=s))
    if ctx.blocked_tokens:
        steps.append(partial(logit_masks.block_tokens, blocked=list(ctx.blocked_tokens)))
    if s.token_bias is not None:
        steps.append(partial(logit_masks.add_token_bias, bias=s.token_bias))
    if has_context and s.dry_multiplier > 0.0:
        breakers = _token_mask(ctx.tokenizer, "dry", s.dry_sequence_breakers, default_dry_breakers,
                               vocab, device)
        if breakers is None:
            breakers = torch.zeros(vocab, dtype=torch.bool, device=device)
        dry_seq = seq[:, -s.dry_range:] if s.dry_range > 0 else seq
        steps.append(partial(_dry, seq=dry_seq, breakers=breakers, s=s))
    if ctx.filter_mask is not None:
        steps.append(partial(logit_masks.restrict, allowed=ctx.filter_mask))
    if ctx.filter_step is not None:
        steps.append(ctx.filter_step)
    if ctx.prefix_ids is not None:
        heal = logit_masks.healing_mask(ctx.tokenizer, ctx.prefix_ids, vocab, device)
        steps.append(partial(logit_masks.restrict, allowed=heal))
    vs = vocab_size(ctx.tokenizer) if ctx.tokenizer is not None else None
    if vs is not None and vs < vocab:
        steps.append(partial(logit_masks.limit_vocab, size=vs))
    return steps


def _penalties(logits: torch.Tensor, seq: torch.Tensor, s: SamplerSettings) -> torch.Tensor:
    return apply_penalties(logits, seq, s.token_repetition_penalty, s.token_repetition_range,
                           s.token_repetition_decay, s.token_frequency_penalty, s.token_presence_penalty)


def _dry(logits: torch.Tensor, seq: torch.Tensor, breakers: torch.Tensor, s: SamplerSettings) -> torch.Tensor:
    return logits + dry_penalty(seq, logits.shape[-1], breakers, s.dry_multiplier, s.dry_base,
                                s.dry_allowed_length, s.dry_max_ngram)


def first_temperature(s: SamplerSettings) -> float:
    """Temperature of the first softmax: 1 when greedy or when temperature is applied last."""
    if s.temperature < GREEDY_BELOW or s.temperature_last:
        return 1.0
    return float(s.temperature)


def effective_top_k(s: SamplerSettings) -> int:
    return 1 if s.temperature < GREEDY_BELOW else s.top_k


def candidates(logits: torch.Tensor, temperature: float, smoothing: float,
               top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax, then the candidates sorted by descending probability: the top_k (renormalised), or all."""
    vocab = logits.shape[-1]
    if top_k == 1:  # greedy: no softmax needed
        ids = logits.argmax(-1, keepdim=True)
        return torch.ones(ids.shape, device=logits.device), ids
    probs = softmax_with_temperature(logits, temperature, smoothing)
    if 0 < top_k < vocab:
        p, ids = probs.topk(top_k, dim=-1, sorted=True)
        return truncation.renormalize(p), ids
    return probs.sort(dim=-1, descending=True)


def prob_chain(s: SamplerSettings, mu: torch.Tensor | None, tokenizer: Any, vocab: int,
               device: torch.device) -> list[ProbStep]:
    """Steps after top-k. `mu` [B, 1] is the mirostat state (None when mirostat is off)."""
    steps: list[ProbStep] = []
    if effective_top_k(s) != 1:
        if 0.0 < s.top_p < 1.0:
            steps.append(_on_probs(truncation.top_p, s.top_p))
        if s.top_a > 0.0:
            steps.append(_on_probs(truncation.top_a, s.top_a))
        if 0.0 < s.min_p < 1.0:
            steps.append(_on_probs(truncation.min_p, s.min_p))
        if 0.0 < s.tfs < 1.0:
            steps.append(_on_probs(truncation.tail_free, s.tfs))
        if 0.0 < s.typical < 1.0:
            steps.append(_on_probs(truncation.typical, s.typical))
        if mu is not None:
            steps.append(_on_probs(mirostat_truncate, mu))
        if s.max_temp > s.min_temp:
            steps.append(lambda p, _ids: dynamic_temperature(p, s.min_temp, s.max_temp, s.temp_exponent))
        elif s.temperature_last and s.temperature != 1.0:
            steps.append(_on_probs(apply_temperature, float(s.temperature)))
        if s.xtc_probability > 0.0:
            ignore = _token_mask(tokenizer, "xtc", s.xtc_ignore_tokens, default_xtc_ignore, vocab, device)
            steps.append(partial(_xtc, probability=s.xtc_probability, threshold=s.xtc_threshold,
                                 ignore=ignore))
    return steps


def _on_probs(fn: Callable[[torch.Tensor, Any], torch.Tensor], arg: Any) -> ProbStep:
    return lambda probs, _ids: fn(probs, arg)


def _xtc(probs: torch.Tensor, ids: torch.Tensor, probability: float, threshold: float,
         ignore: torch.Tensor | None) -> torch.Tensor:
    return xtc(probs, ids, probability, threshold, ignore)
