"""`ExLlamaV2Sampler`: exllamav2's sampler API (spec §8.3) as a chain of small pure torch steps.

Everything runs on the logits' device, with one host read at the very end, of the flags saying whether every
row had a usable distribution (sampling/guard.py: NaN or all -inf logits are a SamplerError, not an arbitrary
token); the caller reads the token right after, so that read waits for no extra work. The other host reads are
of inputs that are host data by nature: filter token sets, a callable filter's mask (a sync if it returns a
device tensor) and `prefix_token` (pass it on the CPU, as exllamav2's generators do).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from exlpy.errors import SamplerError
from exlpy.generator.filters.base import mask_mode
from exlpy.generator.sampling import chain
from exlpy.generator.sampling.cfg import cfg_merge
from exlpy.generator.sampling.draw import draw, uniforms
from exlpy.generator.sampling.guard import distribution_ok, neutralize, raise_if_bad, usable
from exlpy.generator.sampling.hooks import PostSamplingResult
from exlpy.generator.sampling.logit_masks import evaluate_filters, mask_filter_step
from exlpy.generator.sampling.mirostat import mirostat_update, mu_tensor
from exlpy.generator.sampling.settings import SamplerSettings
from exlpy.generator.sampling.skew import skew_random
from exlpy.generator.sampling.tokenizer_info import id_mask

SampleResult = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]


class ExLlamaV2Sampler:
    """Namespace of exllamav2's sampler: `Settings` and `sample(...)`."""

    Settings = SamplerSettings

    @staticmethod
    def sample(logits: torch.Tensor, settings: SamplerSettings, sequence_ids: torch.Tensor | None,
               random: float | None, tokenizer: Any = None, prefix_token: torch.Tensor | None = None,
               return_top_tokens: int = 0, blocked_tokens: Sequence[int] | None = None,
               filters: Sequence[Any] | None = None, filter_prefer_eos: bool = False,
               generator: torch.Generator | None = None) -> SampleResult:
        """Sample one token per row.

        logits: [B, 1, V] or [B, V], any float dtype and device (computed in float32 there).
        sequence_ids: [B, L] context for penalties and DRY (CPU is fine; one row is broadcast), or None.
        random: float in [0, 1) that picks the point of the inverse-CDF draw (exllamav2 style), or None.
        generator: a torch.Generator; when given it supplies the random points (same seed, same tokens).
        filters: objects with next()/get_next() -> (pass_tokens, end_tokens), or callables logits -> bool
            mask [V] / [B, V] (True = allowed); all are combined. When every filter can_mask_logits() (e.g.
            the grammar filter), their mask_logits() is applied on the logits' device instead.
        With `settings.cfg_scale` set, logits hold 2 rows (positive, negative) and one token is returned.

        Returns (token [B, 1] long, top_k_tokens [B, 1, K] or None, top_k_probs [B, 1, K] or None,
        prob [B, 1], end_filter [B] bool). top_k_* are the K most likely tokens of the final distribution
        (entries past the candidates have prob 0); prob is the drawn token's final probability; end_filter
        says whether the token is one of the filters' end tokens.
        """
        if not isinstance(settings, SamplerSettings):
            raise SamplerError(f"sample(): settings must be ExLlamaV2Sampler.Settings, got {type(settings)}")
        settings.validate()
        x = _logits_2d(logits)
        batch, vocab = x.shape
        device = x.device
        if isinstance(return_top_tokens, bool) or not isinstance(return_top_tokens, int) \
                or not 0 <= return_top_tokens <= vocab:
            raise SamplerError(f"sample(): return_top_tokens must be an int in [0, {vocab}], "
                               f"got {return_top_tokens!r}")
        seq = _sequence_2d(sequence_ids, batch)
        prefix_ids = _prefix_ids(prefix_token, batch)
        ok_in = usable(x)
        x = neutralize(x, ok_in)
        if settings.cfg_scale is not None:
            x = cfg_merge(x, float(settings.cfg_scale))
            ok_in = ok_in.all().view(1)
            batch = 1
            seq = None if seq is None else seq[:1]
            prefix_ids = None if prefix_ids is None else prefix_ids[:1]

        filter_mask, end_tokens, filter_step = None, None, None
        filters = [f for f in (filters or []) if f is not None]  # None entries: no filter (exllamav2's lists)
        if filters:
            eos = getattr(tokenizer, "eos_token_id", None)
            if filter_prefer_eos and eos is None:
                raise SamplerError("filter_prefer_eos needs a tokenizer with eos_token_id")
            if mask_mode(list(filters)):
                filter_step, end_tokens = mask_filter_step(list(filters), eos, filter_prefer_eos)
            else:
                filter_mask, end_tokens = evaluate_filters(list(filters), x, eos, filter_prefer_eos)

        ctx = chain.LogitContext(seq, tokenizer, prefix_ids, blocked_tokens, filter_mask, filter_step)
        mu = None
        if settings.mirostat:
            mu = mu_tensor(settings.mirostat_mu, batch, float(settings.mirostat_tau), device)
        r = uniforms(batch, device, random, generator)
        token, prob, probs, ids, x, ok_logits = sample_core(x, settings, ctx, tokenizer, r, mu)
        raise_if_bad([ok_in, ok_logits, distribution_ok(probs)])

        if mu is not None:
            new_mu = mirostat_update(mu, prob, float(settings.mirostat_tau), float(settings.mirostat_eta))
            settings.mirostat_mu = list(new_mu.reshape(batch).unbind(0))

        if settings.post_sampling_hooks:
            res = PostSamplingResult(token, prob, ids, probs / probs.sum(-1, keepdim=True), x)
            for hook in settings.post_sampling_hooks:
                hook(res)
            token, prob = res.sampled_token, res.sampled_prob

        top_tokens = top_probs = None
        if return_top_tokens > 0:
            final = probs / probs.sum(-1, keepdim=True)
            full = torch.zeros(batch, vocab, device=device).scatter_(-1, ids, final)
            top_probs, top_tokens = full.topk(return_top_tokens, dim=-1)
            top_probs, top_tokens = top_probs.unsqueeze(1), top_tokens.unsqueeze(1)

        if end_tokens:
            end_filter = id_mask(end_tokens, vocab, device)[token.reshape(batch)]
        else:
            end_filter = torch.zeros(batch, dtype=torch.bool, device=device)
        return token, top_tokens, top_probs, prob, end_filter


def final_distribution(x: torch.Tensor, settings: SamplerSettings, ctx: chain.LogitContext, tokenizer: Any,
                       mu: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distribution a token is drawn from: logit chain, candidates, probability chain. Returns
    (candidate probs [B, C] in descending order, not necessarily normalised; candidate ids [B, C]; final
    logits [B, V]; [B] bool whether the logit stage left each row usable, sampling/guard.py: a bad row is
    replaced by zeros). Speculative verification reads target probabilities from here."""
    batch, vocab = x.shape
    device = x.device
    for step in chain.logit_chain(settings, ctx, vocab, device):
        x = step(x)
    ok_logits = usable(x)
    x = neutralize(x, ok_logits)
    probs, ids = chain.candidates(x, chain.first_temperature(settings), float(settings.smoothing_factor),
                                  chain.effective_top_k(settings))
    for pstep in chain.prob_chain(settings, mu, tokenizer, vocab, device):
        probs = pstep(probs, ids)
    if settings.xtc_probability > 0.0 and probs.shape[-1] > 1:
        # XTC can reorder candidates; the draw (and skew) expect descending order
        probs, order = probs.sort(dim=-1, descending=True)
        ids = ids.gather(-1, order)
    return probs, ids, x, ok_logits


def sample_core(x: torch.Tensor, settings: SamplerSettings, ctx: chain.LogitContext, tokenizer: Any,
                r: torch.Tensor, mu: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sampling pipeline after CFG and filters, shared by `sample` and the batched device sampler
    (exlpy.generator.sampling.batched): `final_distribution`, then skew and the inverse-CDF draw at the points
    `r` [B, 1]. Returns (token [B, 1], prob [B, 1], candidate probs [B, C], candidate ids [B, C], final
    logits [B, V], logit-stage flags [B])."""
    probs, ids, x, ok_logits = final_distribution(x, settings, ctx, tokenizer, mu)
    if settings.skew != 0.0:
        r = skew_random(r, float(settings.skew))
    idx, prob = draw(probs, r)
    return ids.gather(-1, idx), prob, probs, ids, x, ok_logits


def _logits_2d(logits: torch.Tensor) -> torch.Tensor:
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        got = getattr(logits, "dtype", type(logits))
        raise SamplerError(f"sample(): logits must be a float tensor, got {got}")
    if logits.dim() == 3:
        if logits.shape[1] != 1:
            raise SamplerError(f"sample(): logits must be [B, 1, V] or [B, V], got {tuple(logits.shape)}")
        logits = logits[:, 0]
    if logits.dim() != 2 or logits.shape[0] == 0 or logits.shape[1] == 0:
        raise SamplerError(f"sample(): logits must be [B, 1, V] or [B, V], got {tuple(logits.shape)}")
    return logits.float()


def _sequence_2d(sequence_ids: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    if sequence_ids is None:
        return None
    seq = torch.as_tensor(sequence_ids)
    if seq.dim() == 1:
        seq = seq.unsqueeze(0)
    if seq.dim() != 2 or seq.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise SamplerError(f"sample(): sequence_ids must be an integer tensor [B, L], got "
                           f"{tuple(seq.shape)} {seq.dtype}")
    if seq.shape[0] == 1 and batch > 1:
        seq = seq.expand(batch, -1)
    if seq.shape[0] != batch:
        raise SamplerError(f"sample(): sequence_ids has {seq.shape[0]} rows but logits have {batch}")
    return seq


def _prefix_ids(prefix_token: Any, batch: int) -> list[int] | None:
    if prefix_token is None:
        return None
    ids = torch.as_tensor(prefix_token).reshape(-1).tolist()
    if len(ids) == 1 and batch > 1:
        ids = ids * batch
    if len(ids) != batch:
        raise SamplerError(f"sample(): prefix_token must hold one token per row ({batch}), got {len(ids)}")
    return [int(i) for i in ids]
