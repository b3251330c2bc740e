"""Sampling a batch of rows on the logits' device, each row with its own settings and random point.

The generators sample here when a row's next token depends only on its logits and settings (greedy, or
temperature / top-k / top-p / min-p ... with token bias and blocked tokens), so the token never leaves the
GPU before the next step consumes it. Rows whose sampling needs host state (penalties over the context, DRY,
filters, mirostat, hooks, CFG) use `ExLlamaV2Sampler.sample` instead.

Rows are grouped by the settings that shape the distribution; each group runs the same pipeline as the host
sampler (`sampler.sample_core`) once. Per-row parts (token bias, blocked tokens) are applied to the group's
logits first, in the host sampler's order. Each row's point `r` in [0, 1) is drawn by the caller from that
job's own torch.Generator, so a seeded job draws exactly the numbers the host sampler would draw.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from exlpy.generator.sampling import chain
from exlpy.generator.sampling.guard import distribution_ok, neutralize, usable
from exlpy.generator.sampling.logit_masks import BLOCKED_LOGIT
from exlpy.generator.sampling.settings import SamplerSettings
from exlpy.model.batch import upload_ids  # pinned, non-blocking: no wait for the GPU

# Everything besides token_bias that shapes a device-sampled row's distribution.
_KEY_FIELDS = ("temperature", "smoothing_factor", "min_temp", "max_temp", "temp_exponent", "top_k", "top_p", "top_a",
               "min_p", "tfs", "typical", "skew", "temperature_last", "xtc_probability", "xtc_threshold")


def device_capable(s: SamplerSettings) -> bool:
    """Whether rows with these settings can be sampled here (no state beyond the logits is needed)."""
    return (s.cfg_scale is None and not s.mirostat and not s.post_sampling_hooks and s.dry_multiplier == 0.0
            and s.token_repetition_penalty == 1.0 and s.token_frequency_penalty == 0.0
            and s.token_presence_penalty == 0.0)


def is_greedy(s: SamplerSettings) -> bool:
    """The token is the argmax: no random point is needed."""
    return chain.effective_top_k(s) == 1


def group_key(s: SamplerSettings) -> tuple[Any, ...]:
    ign = s.xtc_ignore_tokens
    return tuple(getattr(s, f) for f in _KEY_FIELDS) + (None if ign is None else frozenset(ign),)


@dataclass
class RowSample:
    """One row to sample: its settings and the tokens blocked at this position (e.g. stop tokens before
    min_new_tokens)."""

    settings: SamplerSettings
    blocked: Sequence[int] | None = None


# id(bias tensor) -> {(device, vocab): row}; an entry goes when its tensor does. (A WeakKeyDictionary would
# compare tensors with ==, which is elementwise.)
_bias_cache: dict[int, dict[tuple[str, int], torch.Tensor]] = {}


def _bias_row(bias: torch.Tensor, device: torch.device, vocab: int) -> torch.Tensor:
    """The bias as a float32 row of `vocab` entries on `device` (a shorter bias covers the first ids only),
    built once per tensor, device and vocab: settings reuse it every step."""
    per = _bias_cache.get(id(bias))
    if per is None:
        per = _bias_cache[id(bias)] = {}
        weakref.finalize(bias, _bias_cache.pop, id(bias), None)
    key = (str(device), vocab)
    if key not in per:
        row = torch.zeros(vocab, dtype=torch.float32)
        n = min(bias.numel(), vocab)
        row[:n] = bias.reshape(-1)[:n].float().cpu()
        per[key] = row.to(device, non_blocking=True)
    return per[key]


def _row_parts(x: torch.Tensor, rows: list[RowSample]) -> torch.Tensor:
    """Blocked tokens, then token bias, per row (the host sampler's order): two kernels for the whole group."""
    vocab = x.shape[-1]
    blocked = [(i, t) for i, r in enumerate(rows) for t in (r.blocked or ()) if 0 <= t < vocab]
    biased = [i for i, r in enumerate(rows) if r.settings.token_bias is not None]
    if not blocked and not biased:
        return x
    x = x.clone()
    if blocked:
        idx = upload_ids(torch.tensor(blocked, dtype=torch.long), x.device)
        x[idx[:, 0], idx[:, 1]] = BLOCKED_LOGIT
    if biased:
        rows_bias = torch.stack([_bias_row(rows[i].settings.token_bias, x.device, vocab) for i in biased])
        x.index_add_(0, upload_ids(torch.tensor(biased, dtype=torch.long), x.device), rows_bias)
    return x


_group_settings: dict[tuple[Any, ...], SamplerSettings] = {}


def _plain(s: SamplerSettings, key: tuple[Any, ...]) -> SamplerSettings:
    """`s` without the per-row parts (those are applied per row), cached per group key."""
    g = _group_settings.get(key)
    if g is None:
        if len(_group_settings) > 256:
            _group_settings.clear()
        g = _group_settings[key] = replace(s, token_bias=None, post_sampling_hooks=[], mirostat_mu=None)
    return g


def sample_rows(logits: torch.Tensor, rows: list[RowSample], r: torch.Tensor, tokenizer: Any
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample row i of `logits` [N, V] (float32, any device) with rows[i]; `r` [N, 1] on the same device holds
    each row's random point (ignored by greedy rows). Returns (tokens [N] long, their probabilities [N], [N]
    bool whether the row had a usable distribution: no NaN / +inf, some token left; sampling/guard.py), on
    the device, without any host sync: the caller reads the flags with the tokens."""
    from exlpy.generator.sampler import sample_core

    n = logits.shape[0]
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(group_key(row.settings), []).append(i)
    if len(groups) == 1:
        key = next(iter(groups))
        return _sample_group(logits, rows, r, _plain(rows[0].settings, key), tokenizer, sample_core)
    tokens = torch.empty(n, dtype=torch.long, device=logits.device)
    probs = torch.empty(n, dtype=torch.float32, device=logits.device)
    ok = torch.empty(n, dtype=torch.bool, device=logits.device)
    for key, members in groups.items():
        idx = upload_ids(torch.tensor(members, dtype=torch.long), logits.device)
        t, p, k = _sample_group(logits.index_select(0, idx), [rows[i] for i in members], r.index_select(0, idx),
                                _plain(rows[members[0]].settings, key), tokenizer, sample_core)
        tokens.index_copy_(0, idx, t)
        probs.index_copy_(0, idx, p)
        ok.index_copy_(0, idx, k)
    return tokens, probs, ok


def _sample_group(x: torch.Tensor, rows: list[RowSample], r: torch.Tensor, settings: SamplerSettings,
                  tokenizer: Any, core: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ok_in = usable(x)
    x = _row_parts(neutralize(x, ok_in), rows)
    ctx = chain.LogitContext(None, tokenizer)
    if is_greedy(settings):  # the argmax itself: no draw (a few kernels fewer per step)
        from exlpy.generator.sampler import final_distribution

        probs, ids, _, ok_logits = final_distribution(x, settings, ctx, tokenizer)
        return ids[:, 0], probs[:, 0], ok_in & ok_logits & distribution_ok(probs)
    token, prob, probs, _, _, ok_logits = core(x, settings, ctx, tokenizer, r)
    return token.view(-1), prob.view(-1), ok_in & ok_logits & distribution_ok(probs)
