"""Structured output: OpenAI's `response_format` (`json_object`, `json_schema`) and vLLM's `guided_json`,
`guided_regex`, `guided_grammar` (Lark or GBNF) and `guided_choice`, each turned into a grammar that the
job's `ExLlamaV2GrammarFilter` enforces token by token. The grammar is checked once per request (a bad schema
answers 400 naming the field); every job (n, best_of, several prompts) gets its own filter.

`json_schema.strict` is accepted either way: the output is always held to the schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from exlpy.errors import GrammarError
from exlpy.server.schemas import SamplingFields


@dataclass(frozen=True)
class Constraint:
    grammar: str  # llguidance grammar text
    what: str  # the request field it came from (error messages)

    def make_filter(self, model: Any, tokenizer: Any) -> Any:
        from exlpy.generator.filters import ExLlamaV2GrammarFilter

        return ExLlamaV2GrammarFilter(model, tokenizer, self.grammar, self.what)


def _named(e: GrammarError, param: str) -> GrammarError:
    e.param = param  # type: ignore[attr-defined]
    return e


def _bad(param: str, message: str) -> GrammarError:
    return _named(GrammarError(f"{param}: {message}"), param)


def _checked(grammar_fn: Any, param: str) -> Constraint:
    from exlpy.generator.filters.grammar import check_grammar

    try:
        grammar = grammar_fn()
        check_grammar(grammar, param)
    except GrammarError as e:
        msg = str(e)
        raise _named(GrammarError(msg if msg.startswith(param) else f"{param}: {msg}"), param) from None
    return Constraint(grammar, param)


def json_constraint(schema: Any, param: str) -> Constraint:
    from exlpy.generator.filters.grammar import compile_json_schema

    return _checked(lambda: compile_json_schema(schema, param), param)


def constraint(req: SamplingFields) -> Constraint | None:
    """The request's output constraint, or None. At most one of the fields may be given."""
    given = [name for name in ("response_format", "guided_json", "guided_regex", "guided_grammar", "guided_choice")
             if getattr(req, name) is not None and not (name == "response_format" and req.response_format
                                                          and req.response_format.type == "text")]
    if len(given) > 1:
        raise _bad(given[1], f"only one output constraint may be given, got {' and '.join(given)}")
    if not given:
        return None
    from exlpy.generator.filters.llg_tokenizer import import_llguidance

    llg = import_llguidance()
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            return json_constraint({"type": "object"}, "response_format")
        if rf.type != "json_schema":
            raise _bad("response_format.type", f"must be 'text', 'json_object' or 'json_schema', got {rf.type!r}")
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise _bad("response_format.json_schema.schema", "is required for type 'json_schema'")
        return json_constraint(rf.json_schema.schema_, "response_format.json_schema.schema")
    if req.guided_json is not None:
        return json_constraint(req.guided_json, "guided_json")
    if req.guided_regex is not None:
        return _checked(lambda: llg.LLMatcher.grammar_from_regex(req.guided_regex), "guided_regex")
    if req.guided_choice is not None:
        if not req.guided_choice or not all(isinstance(c, str) and c for c in req.guided_choice):
            raise _bad("guided_choice", "must be a non-empty list of non-empty strings")
        alts = " | ".join(json.dumps(c) for c in req.guided_choice)
        return _checked(lambda: llg.LLMatcher.grammar_from_lark(f"start: {alts}"), "guided_choice")
    text = req.guided_grammar or ""
    if "::=" in text:  # GBNF (llama.cpp) rather than Lark
        def gbnf() -> str:
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                return llg.LLMatcher.grammar_from_lark(gbnf_to_lark(text))
            except Exception as e:  # the converter raises plain exceptions on syntax errors
                raise GrammarError(str(e)) from e

        return _checked(gbnf, "guided_grammar")
    return _checked(lambda: llg.LLMatcher.grammar_from_lark(text), "guided_grammar")
