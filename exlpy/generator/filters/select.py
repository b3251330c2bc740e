"""`ExLlamaV2SelectFilter`: the generated text must be exactly one of the given options.

Tokens that write a further part of an option pass; a token that completes an option is also an end token, so
generation ends there (`eos_reason` "end_filter"). With `case_insensitive` the options match in any case.
"""

from __future__ import annotations

from typing import Any

from exlpy.errors import GeneratorError
from exlpy.generator.filters.base import ExLlamaV2Filter, token_id
from exlpy.generator.filters.text_index import text_index


class ExLlamaV2SelectFilter(ExLlamaV2Filter):
    def __init__(self, model: Any, tokenizer: Any, options: list[str], case_insensitive: bool = False) -> None:
        super().__init__(model, tokenizer)
        if isinstance(options, str) or not options or not all(isinstance(o, str) and o for o in options):
            raise GeneratorError(f"ExLlamaV2SelectFilter: options must be a non-empty list of non-empty strings, "
                                 f"got {options!r}")
        self.options = list(options)
        self.case_insensitive = case_insensitive
        self.offset = 0
        self.prefix = ""

    def clone(self, c: Any = None) -> ExLlamaV2SelectFilter:
        c = super().clone(c)
        c.options = list(self.options)
        c.case_insensitive = self.case_insensitive
        c.offset = self.offset
        c.prefix = self.prefix
        return c

    def begin(self, prefix_str: str = "") -> None:
        self.prefix = prefix_str
        self.sequence_str = ""
        self.offset = 0

    def feed(self, token: Any) -> None:
        token = token_id(token)
        pieces = self.tokenizer.get_id_to_piece_list(False)
        piece = pieces[token] if 0 <= token < len(pieces) else ""
        self.sequence_str += piece
        self.offset += len(piece)

    def next(self) -> tuple[set[int], set[int]]:
        index = text_index(self.tokenizer, self.case_insensitive)
        done = index.key(self.sequence_str)
        allowed: set[int] = set()
        end: set[int] = set()
        for option in self.options:
            o = index.key(option)
            if not o.startswith(done) or len(o) == len(done):
                continue
            rest = o[len(done):]
            for k, ids in index.prefixes_of(rest):
                allowed.update(ids)
                if k == len(rest):
                    end.update(ids)
        return allowed, end
