"""Sampler settings as the captured sampler's per-row parameters (exlpy/generator/sampling/graphed.py): which
settings it covers with the host chain's distribution, and the rows of floats its device buffers hold. Host code
only; the column layouts are those of kernels/sample_top.py (`row_params`) and `GraphSampler._step` (`ext_params`).
"""

from __future__ import annotations

import math

from exlpy.generator.sampling.chain import GREEDY_BELOW
from exlpy.generator.sampling.settings import SamplerSettings

K_MAX = 128  # candidates per row kept by the fused kernel: top-k up to this runs in the graph
WINDOW = 4096  # newest tokens kept per slot for penalties with a range (range + decay up to this)
BLOCKED_LOGIT = -1e30  # as the host sampler's blocked tokens (a fully blocked row stays finite)
NEXT = 14  # columns of ext_params


def candidate_steps(s: SamplerSettings) -> bool:
    """Whether the row uses steps the graph runs in torch on the K_MAX candidates (TFS, typical, dynamic or last
    temperature, XTC): the host chain applies them only when not greedy."""
    if s.temperature < GREEDY_BELOW or s.top_k == 1:
        return False
    return (0.0 < s.tfs < 1.0 or 0.0 < s.typical < 1.0 or s.max_temp > s.min_temp
            or (s.temperature_last and s.temperature != 1.0) or s.xtc_probability > 0.0)


def graph_capable(s: SamplerSettings, vocab: int) -> bool:
    """Whether rows with these settings can be sampled by `GraphSampler` with the host chain's distribution."""
    greedy = s.temperature < GREEDY_BELOW
    k = 1 if greedy else s.top_k
    if candidate_steps(s):  # they read the candidates: every survivor must be one
        k_ok = 0 < k <= K_MAX or vocab <= K_MAX
    else:
        k_ok = 0 < k <= K_MAX or k <= 0 or k >= vocab or vocab <= K_MAX
    return (s.cfg_scale is None and not s.mirostat and not s.post_sampling_hooks and s.dry_multiplier == 0.0
            and (not has_penalties(s) or s.token_repetition_range < 0  # the whole context (decay unused)
                 or s.token_repetition_range + max(s.token_repetition_decay, 0) <= WINDOW)
            and (s.xtc_probability == 0.0 or s.xtc_ignore_tokens is None) and k_ok)


def ext_params(s: SamplerSettings) -> list[float]:
    """The row's parameters of the candidate steps and smoothing (`_Bucket.ext` columns, see `_step`)."""
    cand = candidate_steps(s)
    tfs = cand and 0.0 < s.tfs < 1.0
    typ = cand and 0.0 < s.typical < 1.0
    dyn = cand and s.max_temp > s.min_temp
    last = cand and not dyn and s.temperature_last and s.temperature != 1.0
    xtc_on = cand and s.xtc_probability > 0.0
    return [float(tfs), float(s.tfs), float(typ), float(s.typical), float(dyn), float(s.min_temp),
            float(s.max_temp), float(s.temp_exponent), float(last), float(s.temperature), float(xtc_on),
            float(s.xtc_probability), float(s.xtc_threshold), float(s.smoothing_factor)]


def has_penalties(s: SamplerSettings) -> bool:
    return (s.token_repetition_penalty != 1.0 or s.token_frequency_penalty != 0.0
            or s.token_presence_penalty != 0.0)


def row_params(s: SamplerSettings, vocab: int, point: float | None) -> list[float]:
    """The row's `ops.sample_top` parameters (kernels/sample_top.py: params columns)."""
    greedy = s.temperature < GREEDY_BELOW
    k = 1 if greedy else s.top_k
    if not 0 < k < vocab:
        k = vocab
    temp = 1.0 if greedy or s.temperature_last else float(s.temperature)
    return [temp, float(k), float(s.top_p), float(s.top_a), float(s.min_p),
            1.0 if s.skew == 0.0 else math.exp(-float(s.skew)), -1.0 if point is None else float(point)]


def verify_capable(s: SamplerSettings, vocab: int) -> bool:
    """Rows whose speculative verification `GraphSampler.verify` runs: their whole distribution is among the
    K_MAX candidates (greedy, top-k <= K_MAX or a small vocabulary), no penalties, bias or skew (as the host
    verification: drafts extend the context, skew bends the draw)."""
    greedy = s.temperature < GREEDY_BELOW or s.top_k == 1
    return (graph_capable(s, vocab) and not has_penalties(s) and s.token_bias is None and s.skew == 0.0
            and (greedy or 0 < s.top_k <= K_MAX or vocab <= K_MAX))
