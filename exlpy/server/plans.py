"""From an OpenAI request to a `RequestPlan`: the prompts' ids, how many choices each gets (n, best_of), the
token budget, logprob options, the output constraint and tools, and how to make each choice's job.

Completion prompts are tokenized as transformers does with the model's tokenizer (its own BOS rule, special
tokens in the text parsed: `tokenizer.hf_compat`); a token-id prompt is used as given. Chat messages are
rendered with the model's template and encoded the same way, their contents always as text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from exlpy.errors import GeneratorError, SequenceLengthError, TokenizerError
from exlpy.generator.dynamic import ExLlamaV2DynamicJob
from exlpy.server import params
from exlpy.server.params import bad
from exlpy.server.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from exlpy.server.structured import Constraint, constraint
from exlpy.server.tools import ToolPlan, chat_messages, plan_tools, tool_grammar
from exlpy.tokenizer.hf_compat import encode_chat, hf_encode

MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 16  # n and best_of
MAX_PROMPTS = 256  # prompts in one /v1/completions request
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


@dataclass
class RequestPlan:
    prompts: list[torch.Tensor]  # [1, T] each
    prompt_texts: list[str | None]  # the text each prompt came from (echo); None for a token-id prompt
    max_new_tokens: list[int]  # per prompt; 0 = no generation (echo / prompt logprobs only)
    settings: Any
    stop: list[int | str]
    seed: int | None
    n: int = 1
    best_of: int = 1
    top_logprobs: int | None = None  # alternatives per generated token; None: no logprobs
    raw_logprobs: bool = True  # the model's log-softmax (else the sampler's final distribution)
    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs (alternatives per prompt token)
    include_usage: bool = False
    constraint: Constraint | None = None
    tools: ToolPlan | None = None
    model: Any = None
    tokenizer: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    embeddings: list[Any] = field(default_factory=list)  # images of a chat request (exlpy/server/vision.py)

    def needs_logits(self) -> bool:
        """Jobs return their raw logits: raw logprobs were asked for, or best_of ranks the candidates."""
        return self.raw_logprobs and (self.top_logprobs is not None or self.best_of > self.n)

    def make_job(self, prompt: int, candidate: int, identifier: str) -> ExLlamaV2DynamicJob:
        seed = None if self.seed is None else self.seed + candidate
        filters = [self.constraint.make_filter(self.model, self.tokenizer)] if self.constraint else []
        processed = self.top_logprobs is not None and not self.raw_logprobs
        return ExLlamaV2DynamicJob(self.prompts[prompt], self.max_new_tokens[prompt], gen_settings=self.settings,
                                   stop_conditions=self.stop, seed=seed, identifier=identifier,
                                   return_probs=processed, return_top_tokens=(self.top_logprobs or 0) if processed
                                   else 0, return_logits=self.needs_logits(), filters=filters,
                                   embeddings=self.embeddings or None)


def logprob_count(value: int | None, param: str) -> int:
    if value is None:
        return 0
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise bad(GeneratorError, param, f"must be in [0, {MAX_TOP_LOGPROBS}], got {value}")
    return value


def choice_counts(n: int | None, best_of: int | None, stream: bool) -> tuple[int, int]:
    n_ = 1 if n is None else n
    if not 1 <= n_ <= MAX_CHOICES:
        raise bad(GeneratorError, "n", f"must be in [1, {MAX_CHOICES}], got {n}")
    b = n_ if best_of is None else best_of
    if not 1 <= b <= MAX_CHOICES:
        raise bad(GeneratorError, "best_of", f"must be in [1, {MAX_CHOICES}], got {best_of}")
    if b < n_:
        raise bad(GeneratorError, "best_of", f"must be >= n ({n_}), got {best_of}")
    if b > n_ and stream:
        raise bad(GeneratorError, "best_of", "cannot be larger than n when streaming")
    return n_, b


def token_budget(requested: int | None, param: str, prompt_len: int, max_seq_len: int, default: int | None,
                 prompt_param: str, allow_zero: bool = False) -> int:
    """max_new_tokens: the request's (or the default), capped to what the context leaves after the prompt. More
    than the whole context is an error: such a budget is a mistake, not a request to fill the context."""
    lowest = 0 if allow_zero else 1
    if requested is not None and requested < lowest:
        raise bad(GeneratorError, param, f"must be >= {lowest}, got {requested}")
    if requested == 0:
        if prompt_len > max_seq_len:
            raise bad(SequenceLengthError, prompt_param, f"the prompt has {prompt_len} tokens and the context "
                      f"(max_seq_len) holds {max_seq_len}")
        return 0
    if requested is not None and requested > max_seq_len:  # could never fit, whatever the prompt (as vLLM: 400)
        raise bad(SequenceLengthError, param, f"{requested} tokens is more than the whole context of this model "
                  f"({max_seq_len} tokens, prompt included); ask for at most {max_seq_len - prompt_len}")
    room = max_seq_len - prompt_len
    if room < 1:
        raise bad(SequenceLengthError, prompt_param, f"the prompt has {prompt_len} tokens and the context "
                  f"(max_seq_len) holds {max_seq_len}: no room for a new token")
    want = requested if requested is not None else (default or room)
    return min(want, room)


def completion_prompts(prompt: Any, tokenizer: Any) -> tuple[list[torch.Tensor], list[str | None]]:
    """One or more prompts: a string, a list of strings, a list of token ids, or a list of id lists."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        items = [prompt]
    elif isinstance(prompt, list):
        items = list(prompt)
    else:
        raise bad(GeneratorError, "prompt", "must be a string, a list of strings, a list of token ids or a list "
                  "of token-id lists")
    if not items:
        raise bad(GeneratorError, "prompt", "is empty")
    if len(items) > MAX_PROMPTS:
        raise bad(GeneratorError, "prompt", f"holds {len(items)} prompts, at most {MAX_PROMPTS} per request")
    vocab = params.vocab_size(tokenizer)
    ids_out, texts = [], []
    for i, p in enumerate(items):
        where = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            ids = hf_encode(tokenizer, p)
            texts.append(p)
        else:
            ids = list(p)
            for t in ids:
                if not 0 <= t < vocab:
                    raise bad(GeneratorError, where, f"token id {t} is outside the vocabulary [0, {vocab})")
            texts.append(None)
        if not ids:
            raise bad(GeneratorError, where, "is empty (it encodes to no tokens)")
        ids_out.append(torch.tensor([ids], dtype=torch.long))
    return ids_out, texts


def _common(req: SamplingFields, plan: RequestPlan) -> RequestPlan:
    mode = req.logprobs_mode or "raw_logprobs"
    if mode not in LOGPROBS_MODES:
        raise bad(GeneratorError, "logprobs_mode", f"must be one of {', '.join(LOGPROBS_MODES)}, got {mode!r}")
    plan.raw_logprobs = mode == "raw_logprobs"
    if req.prompt_logprobs is not None:
        plan.prompt_logprobs = logprob_count(req.prompt_logprobs, "prompt_logprobs")
    plan.include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return plan


def plan_completion(req: CompletionRequest, tokenizer: Any, model: Any, max_seq_len: int) -> RequestPlan:
    n, best_of = choice_counts(req.n, req.best_of, req.stream)
    if req.suffix:
        raise bad(GeneratorError, "suffix", "is not supported (no fill-in-the-middle)")
    prompts, texts = completion_prompts(req.prompt, tokenizer)
    budgets = [token_budget(req.max_tokens, "max_tokens", int(p.shape[-1]), max_seq_len, DEFAULT_COMPLETION_TOKENS,
                            "prompt", allow_zero=True) for p in prompts]
    if req.max_tokens == 0 and not req.echo and req.prompt_logprobs is None:
        raise bad(GeneratorError, "max_tokens", "0 generates nothing: use it with echo (and logprobs) or "
                  "prompt_logprobs to score the prompt")
    top = None if req.logprobs is None else logprob_count(req.logprobs, "logprobs")
    plan = RequestPlan(prompts, texts, budgets, params.sampler_settings(req, tokenizer),
                       params.stop_conditions(req.stop, tokenizer), params.check_seed(req.seed), n, best_of, top,
                       echo=req.echo, constraint=constraint(req), model=model, tokenizer=tokenizer)
    return _common(req, plan)


def template_source(tokenizer: Any) -> str:
    raw = getattr(tokenizer, "tokenizer_config", {}).get("chat_template")
    return raw if isinstance(raw, str) else str(raw or "")


def chat_prompt(req: ChatCompletionRequest, tokenizer: Any, tools: ToolPlan | None, images: Any = None
                ) -> torch.Tensor:
    if not req.messages:
        raise bad(GeneratorError, "messages", "is empty")
    messages, texts = chat_messages(req, tools, images)
    kwargs = dict(req.chat_template_kwargs or {})
    if tools is not None and tools.native:
        kwargs["tools"] = tools.tools
    add_gen = req.add_generation_prompt and not req.continue_final_message
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_gen, **kwargs)
    except TokenizerError as e:  # no template, or the template rejected the conversation
        e.param = "messages"  # type: ignore[attr-defined]
        raise
    if req.continue_final_message and messages and messages[-1]["content"]:
        last = messages[-1]["content"]
        cut = text.rfind(last)
        text = text[:cut + len(last)] if cut >= 0 else text
    # The template writes BOS itself where the model wants it.
    try:
        if images is not None and images.embeddings:
            from exlpy.server.vision import encode_with_images

            ids = encode_with_images(lambda t, c: encode_chat(tokenizer, t, c), text, texts, images)
        else:
            ids = encode_chat(tokenizer, text, texts)
    except TokenizerError as e:
        e.param = "messages"  # type: ignore[attr-defined]
        raise
    return torch.tensor([ids], dtype=torch.long)


def plan_chat(req: ChatCompletionRequest, tokenizer: Any, model: Any, max_seq_len: int) -> RequestPlan:
    n, best_of = choice_counts(req.n, None, req.stream)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad(GeneratorError, "top_logprobs", "needs logprobs: true")
    tools = plan_tools(req, template_source(tokenizer))
    from exlpy.server.vision import RequestImages, serving

    images = RequestImages(model, tokenizer, serving(model))
    ids = chat_prompt(req, tokenizer, tools, images)
    top = logprob_count(req.top_logprobs, "top_logprobs") if req.logprobs else None
    requested, param = (req.max_completion_tokens, "max_completion_tokens") if req.max_tokens is None \
        else (req.max_tokens, "max_tokens")
    budget = token_budget(requested, param, int(ids.shape[-1]), max_seq_len, None, "messages")
    cons = constraint(req)
    if tools is not None and tools.mode in ("required", "named"):
        if cons is not None:
            raise bad(GeneratorError, "tool_choice", f"a required tool call cannot be combined with {cons.what}")
        cons = Constraint(tool_grammar(tools), "tool_choice")
    plan = RequestPlan([ids], [None], [budget], params.sampler_settings(req, tokenizer),
                       params.stop_conditions(req.stop, tokenizer), params.check_seed(req.seed), n, best_of, top,
                       constraint=cons, tools=tools, model=model, tokenizer=tokenizer,
                       embeddings=images.embeddings)
    return _common(req, plan)
