"""Sampling fields of an OpenAI request: sampler settings, logit_bias, stops, seed (see `plans.py` for the rest).

Every bad value raises a typed exception (SamplerError for sampling fields, GeneratorError for the rest,
SequenceLengthError for a prompt that leaves no room) whose message starts with the OpenAI field name; the
exception carries that name in `.param` for the error body.

Defaults follow OpenAI: temperature 1, top_p 1, no penalties; temperature 0 means greedy decoding.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from exlpy.errors import ExlpyError, GeneratorError, SamplerError
from exlpy.generator.sampler import ExLlamaV2Sampler
from exlpy.server.schemas import SamplingFields


def bad(cls: type[ExlpyError], param: str, message: str) -> ExlpyError:
    e = cls(f"{param}: {message}")
    e.param = param  # type: ignore[attr-defined]
    return e


def _number(value: float | None, param: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = default if value is None else float(value)
    if not math.isfinite(v) or v < lo or (lo_open and v == lo) or v > hi:
        lower = f"> {lo}" if lo_open else f">= {lo}"
        upper = f" and <= {hi}" if math.isfinite(hi) else ""
        raise bad(SamplerError, param, f"must be a finite number {lower}{upper}, got {value!r}")
    return v


def vocab_size(tokenizer: Any) -> int:
    return len(tokenizer.get_id_to_piece_list(True))


def logit_bias_tensor(bias: dict[str, float] | None, tokenizer: Any) -> torch.Tensor | None:
    if not bias:
        return None
    from exlpy.generator.sampling.tokenizer_info import token_bias_size

    vocab = vocab_size(tokenizer)
    out = torch.zeros(max(token_bias_size(tokenizer), vocab), dtype=torch.float32)
    for key, value in bias.items():
        try:
            tid = int(key)
        except ValueError:
            raise bad(SamplerError, "logit_bias", f"key {key!r} is not a token id") from None
        if not 0 <= tid < vocab:
            raise bad(SamplerError, "logit_bias", f"token id {tid} is outside the vocabulary [0, {vocab})")
        if not math.isfinite(value) or not -100.0 <= value <= 100.0:
            raise bad(SamplerError, "logit_bias", f"bias of token {tid} must be in [-100, 100], got {value!r}")
        out[tid] = float(value)
    return out


def sampler_settings(req: SamplingFields, tokenizer: Any) -> Any:
    """ExLlamaV2Sampler.Settings for the request (greedy when temperature is 0)."""
    temperature = _number(req.temperature, "temperature", 1.0, 0.0, math.inf)
    top_p = _number(req.top_p, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    min_p = _number(req.min_p, "min_p", 0.0, 0.0, 1.0)
    freq = _number(req.frequency_penalty, "frequency_penalty", 0.0, -2.0, 2.0)
    pres = _number(req.presence_penalty, "presence_penalty", 0.0, -2.0, 2.0)
    rep = _number(req.repetition_penalty, "repetition_penalty", 1.0, 0.0, math.inf, lo_open=True)
    top_k = req.top_k if req.top_k is not None else 0
    if top_k == -1:  # vLLM's spelling of "disabled"
        top_k = 0
    if top_k < 0:
        raise bad(SamplerError, "top_k", f"must be >= 0 (0 or -1: disabled), got {req.top_k}")
    penalties = {"token_repetition_penalty": rep, "token_frequency_penalty": freq, "token_presence_penalty": pres,
                 "token_bias": logit_bias_tensor(req.logit_bias, tokenizer)}
    if temperature == 0.0:
        return ExLlamaV2Sampler.Settings.greedy(**penalties)
    return ExLlamaV2Sampler.Settings(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, **penalties)


MAX_STOPS = 16


def stop_conditions(stop: str | list[str] | None, tokenizer: Any) -> list[int | str]:
    strings = [stop] if isinstance(stop, str) else list(stop or [])
    if len(strings) > MAX_STOPS:
        raise bad(GeneratorError, "stop", f"holds {len(strings)} strings, at most {MAX_STOPS}")
    for i, s in enumerate(strings):
        if not s:  # an empty stop string would match at once: a request for nothing, most likely a client bug
            raise bad(GeneratorError, "stop" if isinstance(stop, str) else f"stop[{i}]", "is an empty string")
    return [*sorted(tokenizer.stop_token_ids), *strings]


def check_seed(seed: int | None) -> int | None:
    if seed is not None and not -(2 ** 63) <= seed < 2 ** 64:
        raise bad(GeneratorError, "seed", f"must fit in 64 bits, got {seed}")
    return seed


