"""`ExLlamaV2PrefixFilter`: the generated text must begin with one of the given strings; after that, anything."""

from __future__ import annotations

from typing import Any

from exlpy.errors import GeneratorError
from exlpy.generator.filters.base import ExLlamaV2Filter, token_id
from exlpy.generator.filters.text_index import text_index


class ExLlamaV2PrefixFilter(ExLlamaV2Filter):
    def __init__(self, model: Any, tokenizer: Any, prefix_strings: str | list[str]) -> None:
        super().__init__(model, tokenizer)
        strings = [prefix_strings] if isinstance(prefix_strings, str) else list(prefix_strings)
        if not strings or not all(isinstance(s, str) and s for s in strings):
            raise GeneratorError(f"ExLlamaV2PrefixFilter: prefix_strings must be a non-empty string or list of "
                                 f"non-empty strings, got {prefix_strings!r}")
        self.prefix_strings = strings
        self.current_prefixes: set[str] = set(strings)
        self.current_str = ""

    def clone(self, c: Any = None) -> ExLlamaV2PrefixFilter:
        c = super().clone(c)
        c.prefix_strings = list(self.prefix_strings)
        c.current_prefixes = set(self.current_prefixes)
        c.current_str = self.current_str
        return c

    def begin(self, prefix_str: str = "") -> None:
        self.sequence_str = prefix_str
        self.current_prefixes = set(self.prefix_strings)
        self.current_str = ""

    def feed(self, token: Any) -> None:
        token = token_id(token)
        pieces = self.tokenizer.get_id_to_piece_list(False)
        piece = pieces[token] if 0 <= token < len(pieces) else ""
        self.sequence_str += piece
        self.current_str += piece
        s = self.current_str
        self.current_prefixes = {p for p in self.current_prefixes if p.startswith(s) or s.startswith(p)}

    def satisfied(self) -> bool:
        """Whether the text so far already begins with one of the prefixes."""
        return any(self.current_str.startswith(p) for p in self.current_prefixes)

    def next(self) -> tuple[set[int] | None, set[int]]:
        if self.satisfied():
            return None, set()  # the prefix is written: no more restriction
        index = text_index(self.tokenizer)
        allowed: set[int] = set()
        for p in self.current_prefixes:
            rest = p[len(self.current_str):]
            allowed.update(index.starting_with(rest))  # completes the prefix (and maybe goes on)
            for _, ids in index.prefixes_of(rest):  # a token that writes part of it
                allowed.update(ids)
        return allowed, set()
