"""`ExLlamaV2GrammarFilter`: output constrained by a JSON schema, a regex or a Lark / GBNF grammar (llguidance).

The filter takes the mask path of the filter protocol: after each token, llguidance computes a bitmask of the
allowed next tokens (one bit per token, 32 per int32 word, V/8 bytes) into a page-locked host buffer, in a
worker thread while the GPU runs the next forward pass (llguidance releases the GIL). The generator uploads the
words and a single kernel (`ops.apply_token_bitmask`) sets the excluded logits to -inf on the GPU. The EOS ids
pass only where the grammar is complete, so a finished JSON value ends the generation.

JSON schemas compile without flexible whitespace by default (`, ` and `: ` separators, as `json.dumps` writes):
a small model cannot then wander off into endless blank lines inside an object.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from exlpy.errors import GrammarError
from exlpy.generator.filters.base import ExLlamaV2Filter, token_id
from exlpy.generator.filters.llg_tokenizer import grammar_eos, import_llguidance, llg_tokenizer
from exlpy.kernels import ops

JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def logits_vocab(model: Any, tokenizer: Any) -> int:
    """Width of the model's logits (the head may be padded past the tokenizer's vocabulary)."""
    sizes = [int(getattr(tokenizer, "actual_vocab_size", 0) or 0)]
    cfg = getattr(model, "config", None)
    if cfg is not None and getattr(cfg, "vocab_size", None):
        sizes.append(int(cfg.vocab_size))
    return max(sizes)


def compile_json_schema(schema: Any, what: str = "json_schema") -> str:
    """llguidance grammar text for a JSON schema (dict, JSON text, or True for "any JSON value")."""
    llg = import_llguidance()
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise GrammarError(f"{what}: not valid JSON: {e}") from e
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise GrammarError(f"{what}: a JSON schema must be an object, got {type(schema).__name__}")
    try:
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=dict(JSON_DEFAULTS))
    except ValueError as e:
        raise GrammarError(f"{what}: {e}") from e


def check_grammar(grammar: str, what: str, tokenizer: Any = None) -> None:
    """Raise GrammarError with llguidance's message when `grammar` does not compile."""
    llg = import_llguidance()
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        raise GrammarError(f"{what}: {messages[0] if messages else 'invalid'}")


class ExLlamaV2GrammarFilter(ExLlamaV2Filter):
    """Constrain generation to a grammar. Build with `json_schema()`, `json_object()`, `regex()`, `lark()` or
    `gbnf()`; or pass llguidance grammar text directly."""

    def __init__(self, model: Any, tokenizer: Any, grammar: str, what: str = "grammar") -> None:
        super().__init__(model, tokenizer)
        llg = import_llguidance()
        self.vocab = logits_vocab(model, tokenizer)
        self.ll_tokenizer = llg_tokenizer(tokenizer, self.vocab)
        check_grammar(grammar, what, self.ll_tokenizer)
        self.grammar = grammar
        self.what = what
        self.matcher = llg.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"{what}: {self.matcher.get_error()}")
        self.eos_ids = grammar_eos(self.ll_tokenizer)
        words = (self.vocab + 31) // 32
        self.bitmask = torch.full((1, words), -1, dtype=torch.int32, pin_memory=torch.cuda.is_available())

    # --- constructors --------------------------------------------------------------------------------------
    @classmethod
    def json_schema(cls, model: Any, tokenizer: Any, schema: Any) -> ExLlamaV2GrammarFilter:
        return cls(model, tokenizer, compile_json_schema(schema), "json_schema")

    @classmethod
    def json_object(cls, model: Any, tokenizer: Any) -> ExLlamaV2GrammarFilter:
        """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
        return cls(model, tokenizer, compile_json_schema({"type": "object"}), "json_object")

    @classmethod
    def regex(cls, model: Any, tokenizer: Any, pattern: str) -> ExLlamaV2GrammarFilter:
        llg = import_llguidance()
        return cls(model, tokenizer, llg.LLMatcher.grammar_from_regex(pattern), "regex")

    @classmethod
    def lark(cls, model: Any, tokenizer: Any, grammar: str) -> ExLlamaV2GrammarFilter:
        """A Lark-syntax EBNF grammar (llguidance's dialect: `start: ...`, regex terminals, `%json {...}`)."""
        llg = import_llguidance()
        return cls(model, tokenizer, llg.LLMatcher.grammar_from_lark(grammar), "lark grammar")

    @classmethod
    def gbnf(cls, model: Any, tokenizer: Any, grammar: str) -> ExLlamaV2GrammarFilter:
        """A llama.cpp GBNF grammar (`root ::= ...`)."""
        import_llguidance()
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            lark = gbnf_to_lark(grammar)
        except Exception as e:  # the converter raises plain exceptions for syntax errors
            raise GrammarError(f"gbnf grammar: {e}") from e
        return cls.lark(model, tokenizer, lark)

    def clone(self, c: Any = None) -> ExLlamaV2GrammarFilter:
        c = super().clone(c)
        for name in ("vocab", "ll_tokenizer", "grammar", "what", "eos_ids"):
            setattr(c, name, getattr(self, name))
        c.matcher = self.matcher.deep_copy()
        c.bitmask = self.bitmask.clone().pin_memory() if self.bitmask.is_pinned() else self.bitmask.clone()
        return c

    # --- protocol ------------------------------------------------------------------------------------------
    def begin(self, prefix_str: str = "") -> None:
        self.background_drop()
        self.sequence_str = ""
        self.matcher.reset()

    def feed(self, token: Any) -> None:
        token = token_id(token)
        if self.matcher.is_stopped() and token in self.eos_ids:
            return  # the grammar was complete and the model ended: nothing to check
        if not self.matcher.consume_token(int(token)):
            raise GrammarError(f"{self.what}: token {token} does not continue the grammar: "
                               f"{self.matcher.get_error().splitlines()[0]}")

    def use_background_worker(self) -> bool:
        return True

    def can_mask_logits(self) -> bool:
        return True

    def prepare_logit_mask(self) -> bool:
        m = self.bitmask
        self.matcher.unsafe_compute_mask_ptr(m.data_ptr(), m.numel() * m.element_size())
        if self.matcher.is_error():
            raise GrammarError(f"{self.what}: {self.matcher.get_error().splitlines()[0]}")
        return True

    def token_bitmask(self) -> torch.Tensor:
        """The bitmask [1, W] int32 (host) of the last prepare_logit_mask()."""
        return self.bitmask

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        m = self.bitmask.to(logits.device, non_blocking=True)
        if logits.dim() == 1:
            return ops.apply_token_bitmask(logits.unsqueeze(0), m).squeeze(0)
        return ops.apply_token_bitmask(logits, m.expand(logits.shape[0], -1))

    def mask_end_tokens(self) -> set[int]:
        """EOS ids end the generation once the grammar is complete (also without a stop condition for them)."""
        return set(self.eos_ids) if self.matcher.is_accepting() else set()

    def next(self) -> tuple[set[int], set[int]]:
        """Token-set form of the mask (for stacks that mix this filter with set-only filters)."""
        self.prepare_logit_mask()
        bits = torch.arange(32, dtype=torch.int32)
        allowed = ((self.bitmask[0].unsqueeze(-1) >> bits) & 1).reshape(-1).nonzero().view(-1)
        return set(allowed.tolist()), self.mask_end_tokens()

    def is_complete(self) -> bool:
        """Whether the text so far is a complete sentence of the grammar."""
        return self.matcher.is_accepting()
