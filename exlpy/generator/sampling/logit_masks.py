"""Logit-level restrictions (spec §8.3 step 3): blocked tokens, token bias, filters, token healing,
vocab limit.

Each function is pure: it returns a new logits tensor (or a mask) and leaves its input alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from exlpy.errors import SamplerError
from exlpy.generator.sampling.tokenizer_info import healing_ids, id_mask

BLOCKED_LOGIT = -1e30  # exllamav2 blocks with a huge negative, not -inf, so a fully blocked row stays finite


def block_tokens(logits: torch.Tensor, blocked: Sequence[int]) -> torch.Tensor:
    ids = torch.tensor([t for t in blocked if 0 <= t < logits.shape[-1]], dtype=torch.long)
    return logits.index_fill(-1, ids.to(logits.device, non_blocking=True), BLOCKED_LOGIT)


def add_token_bias(logits: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Add bias[:V] (bias is padded to 32; a shorter bias covers the first ids only)."""
    n = min(bias.numel(), logits.shape[-1])
    out = logits.clone()
    out[:, :n] += bias[:n].to(logits.device, dtype=logits.dtype, non_blocking=True)
    return out


def restrict(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Set logits where `allowed` ([V] or [B, V] bool) is False to -inf."""
    return logits.masked_fill(~allowed, float("-inf"))


def limit_vocab(logits: torch.Tensor, size: int) -> torch.Tensor:
    """Logits beyond the tokenizer's vocab (padding rows of the head) -> -inf."""
    if size >= logits.shape[-1]:
        return logits
    out = logits.clone()
    out[:, size:] = float("-inf")
    return out


def _next_of(f: Any) -> tuple[Any, Any]:
    if hasattr(f, "get_next"):  # returns a background result when one was started
        return f.get_next()
    if hasattr(f, "next"):
        return f.next()
    raise SamplerError(f"filter {f!r} has neither next() nor get_next(), and is not a mask callable")


def evaluate_filters(filters: Sequence[Any], logits: torch.Tensor, eos_id: int | None,
                     prefer_eos: bool) -> tuple[torch.Tensor | None, set[int] | None]:
    """Combine filters into (allowed mask [B, V] or None, end token set or None).

    Protocol objects (`next()`/`get_next()` -> (pass_tokens, end_tokens)) are intersected (pass) and united
    (end); a callable `fn(logits) -> bool mask` ([V] or [B, V], True = allowed) is and-ed in. Checking that a
    callable's mask allows something reads it on the host: a sync if the callable returns a device tensor.
    """
    batch, vocab = logits.shape
    pass_tokens: set[int] | None = None
    end_tokens: set[int] | None = None
    masks: list[torch.Tensor] = []
    for f in filters:
        if callable(f) and not hasattr(f, "next") and not hasattr(f, "get_next"):
            masks.append(_callable_mask(f, logits))
            continue
        pt, et = _next_of(f)
        if pt is not None:
            pt = set(pt)
            pass_tokens = pt if pass_tokens is None else pass_tokens & pt
        if et is not None:
            end_tokens = set(et) if end_tokens is None else end_tokens | set(et)
    allowed: torch.Tensor | None = None
    if pass_tokens is not None:
        if not pass_tokens:
            raise SamplerError("Filter excluded all tokens")
        if prefer_eos and eos_id is not None and eos_id in pass_tokens:
            pass_tokens = {eos_id}
        allowed = id_mask(pass_tokens, vocab, logits.device).expand(batch, -1)
    for m in masks:
        allowed = m if allowed is None else allowed & m
    if masks and not bool(allowed.any(dim=-1).all()):
        raise SamplerError("Filter excluded all tokens")
    return allowed, end_tokens


def mask_filter_step(filters: Sequence[Any], eos_id: int | None,
                     prefer_eos: bool) -> tuple[Callable[[torch.Tensor], torch.Tensor], set[int]]:
    """The mask path of the filter protocol (every filter can_mask_logits()): a logit step that waits for each
    filter's prepared mask and applies it on the logits' device, and the filters' end tokens.

    No host sync on a device: a row left without any token is detected only for CPU logits."""
    for f in filters:
        f.get_next(mask=True)
    end: set[int] = set()
    for f in filters:
        if hasattr(f, "mask_end_tokens"):
            end |= set(f.mask_end_tokens())
    # exllamav2 prefers EOS only when the filters' allowed set names it. A mask does not say that: a filter may
    # leave EOS's logit untouched while it still expects text (formatron masks only its own vocabulary), so EOS
    # is preferred here only when a filter declares it among its end tokens for this step.
    prefer = prefer_eos and eos_id is not None and eos_id in end

    def step(logits: torch.Tensor) -> torch.Tensor:
        # exllamav2 hands mask_logits one row (1-D), as third-party filters (formatron) expect.
        rows = []
        for row in logits:
            for f in filters:
                row = f.mask_logits(row)
            rows.append(row)
        logits = torch.stack(rows)
        if prefer and 0 <= eos_id < logits.shape[-1]:
            eos_ok = torch.isfinite(logits[:, eos_id:eos_id + 1])
            others = torch.arange(logits.shape[-1], device=logits.device) != eos_id
            logits = logits.masked_fill(eos_ok & others, float("-inf"))
        if not logits.is_cuda and not bool(torch.isfinite(logits).any(dim=-1).all()):
            raise SamplerError("Filter excluded all tokens")
        return logits

    return step, end


def _callable_mask(fn: Callable[[torch.Tensor], torch.Tensor], logits: torch.Tensor) -> torch.Tensor:
    m = fn(logits)
    if not isinstance(m, torch.Tensor) or m.dtype != torch.bool or m.shape[-1] != logits.shape[-1] \
            or m.dim() not in (1, 2):
        raise SamplerError(f"filter callable {fn!r} must return a bool mask [V] or [B, V] with V = "
                           f"{logits.shape[-1]}, got {getattr(m, 'shape', type(m))}")
    return m.to(logits.device, non_blocking=True).expand(logits.shape[0], -1)


def healing_mask(tokenizer: Any, prefix_ids: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """[B, V] True where the token's piece starts with the row's prefix token piece."""
    rows = [id_mask(set(healing_ids(tokenizer, p)), vocab, device) for p in prefix_ids]
    return torch.stack(rows)
