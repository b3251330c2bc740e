"""From an OpenAI request to an `ExLlamaV2DynamicJob`: prompt ids, sampler settings, stops, token budget.

Every bad value raises a typed exception (SamplerError for sampling fields, GeneratorError for the rest,
SequenceLengthError for a prompt that leaves no room) whose message starts with the OpenAI field name; the
exception carries that name in `.param` for the error body.

Defaults follow OpenAI: temperature 1, top_p 1, no penalties; temperature 0 means greedy decoding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from exlpy.errors import ExlpyError, GeneratorError, SamplerError, SequenceLengthError, TokenizerError
from exlpy.generator.dynamic import ExLlamaV2DynamicJob
from exlpy.generator.sampler import ExLlamaV2Sampler
from exlpy.server.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields

MAX_TOP_LOGPROBS = 20
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


def bad(cls: type[ExlpyError], param: str, message: str) -> ExlpyError:
    e = cls(f"{param}: {message}")
    e.param = param  # type: ignore[attr-defined]
    return e


@dataclass
class JobPlan:
    """Everything needed to create the job; `top_logprobs` is None when no logprobs were asked for."""

    ids: torch.Tensor
    max_new_tokens: int
    settings: Any
    stop: list[int | str]
    seed: int | None
    top_logprobs: int | None
    include_usage: bool

    @property
    def prompt_tokens(self) -> int:
        return int(self.ids.shape[-1])

    def make_job(self, identifier: str) -> ExLlamaV2DynamicJob:
        return ExLlamaV2DynamicJob(self.ids, self.max_new_tokens, gen_settings=self.settings,
                                   stop_conditions=self.stop, seed=self.seed, identifier=identifier,
                                   return_probs=self.top_logprobs is not None,
                                   return_top_tokens=self.top_logprobs or 0)


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


def stop_conditions(stop: str | list[str] | None, tokenizer: Any) -> list[int | str]:
    strings = [stop] if isinstance(stop, str) else list(stop or [])
    return [*sorted(tokenizer.stop_token_ids), *[s for s in strings if s]]


def check_n(n: int | None) -> None:
    if n not in (None, 1):
        raise bad(GeneratorError, "n", f"only n=1 is supported (one choice per request), got {n}; send "
                  "several requests instead: they run concurrently")


def check_seed(seed: int | None) -> int | None:
    if seed is not None and not -(2 ** 63) <= seed < 2 ** 64:
        raise bad(GeneratorError, "seed", f"must fit in 64 bits, got {seed}")
    return seed


def token_budget(requested: int | None, param: str, prompt_len: int, max_seq_len: int, default: int | None,
                 prompt_param: str) -> int:
    """max_new_tokens: the request's (or the default), capped to what the context leaves after the prompt."""
    room = max_seq_len - prompt_len
    if room < 1:
        raise bad(SequenceLengthError, prompt_param, f"the prompt has {prompt_len} tokens and the context "
                  f"(max_seq_len) holds {max_seq_len}: no room for a new token")
    if requested is not None and requested < 1:
        raise bad(GeneratorError, param, f"must be >= 1, got {requested}")
    want = requested if requested is not None else (default or room)
    return min(want, room)


def completion_ids(prompt: str | list[int] | list[str], tokenizer: Any) -> torch.Tensor:
    """A text prompt is encoded with BOS (when the tokenizer adds one); a token-id prompt is used as given."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise bad(GeneratorError, "prompt", f"got {len(prompt)} prompts; this server takes one prompt per "
                      "request (send several requests: they run concurrently)")
        prompt = prompt[0]
    if isinstance(prompt, str):
        add_bos = bool(tokenizer.tokenizer_config.get("add_bos_token", True)) and tokenizer.bos_token_id is not None
        return tokenizer.encode(prompt, add_bos=add_bos).view(1, -1)
    if not prompt:
        raise bad(GeneratorError, "prompt", "is empty")
    vocab = vocab_size(tokenizer)
    for t in prompt:
        if not 0 <= t < vocab:
            raise bad(GeneratorError, "prompt", f"token id {t} is outside the vocabulary [0, {vocab})")
    return torch.tensor([prompt], dtype=torch.long)


def chat_ids(req: ChatCompletionRequest, tokenizer: Any) -> torch.Tensor:
    if not req.messages:
        raise bad(GeneratorError, "messages", "is empty")
    messages = []
    for m in req.messages:
        content = m.content if isinstance(m.content, str) else \
            "".join(p.text or "" for p in (m.content or []) if p.type == "text")
        messages.append({"role": m.role, "content": content})
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except TokenizerError as e:  # no template, or the template rejected the conversation
        e.param = "messages"  # type: ignore[attr-defined]
        raise
    # The template writes BOS itself where the model wants it.
    return tokenizer.encode(text, add_bos=False, encode_special_tokens=True).view(1, -1)


def logprob_count(value: int | None, param: str) -> int:
    if value is None:
        return 0
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise bad(GeneratorError, param, f"must be in [0, {MAX_TOP_LOGPROBS}], got {value}")
    return value


def plan_completion(req: CompletionRequest, tokenizer: Any, max_seq_len: int) -> JobPlan:
    check_n(req.n)
    ids = completion_ids(req.prompt, tokenizer)
    top = None if req.logprobs is None else logprob_count(req.logprobs, "logprobs")
    return _plan(req, ids, tokenizer, max_seq_len, req.max_tokens, "max_tokens", DEFAULT_COMPLETION_TOKENS,
                 "prompt", top)


def plan_chat(req: ChatCompletionRequest, tokenizer: Any, max_seq_len: int) -> JobPlan:
    check_n(req.n)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad(GeneratorError, "top_logprobs", "needs logprobs: true")
    ids = chat_ids(req, tokenizer)
    top = logprob_count(req.top_logprobs, "top_logprobs") if req.logprobs else None
    requested, param = (req.max_completion_tokens, "max_completion_tokens") if req.max_tokens is None \
        else (req.max_tokens, "max_tokens")
    return _plan(req, ids, tokenizer, max_seq_len, requested, param, None, "messages", top)


def _plan(req: SamplingFields, ids: torch.Tensor, tokenizer: Any, max_seq_len: int, requested: int | None,
          param: str, default: int | None, prompt_param: str, top: int | None) -> JobPlan:
    settings = sampler_settings(req, tokenizer)
    budget = token_budget(requested, param, int(ids.shape[-1]), max_seq_len, default, prompt_param)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return JobPlan(ids, budget, settings, stop_conditions(req.stop, tokenizer), check_seed(req.seed), top,
                   include_usage)
