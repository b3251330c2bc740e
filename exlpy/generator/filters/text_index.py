"""Token text lookups shared by the prefix and select filters, built once per tokenizer (and case mode).

Pieces are the tokens' text as it reads inside a longer text (`get_id_to_piece_list()`; special tokens are
empty and never match). Two questions are answered fast: which ids read exactly as a given string, and which
ids read as a string that starts with a given prefix (a sorted list, bisected).
"""

from __future__ import annotations

import bisect
import weakref
from typing import Any

_cache: weakref.WeakKeyDictionary[Any, dict[bool, TextIndex]] = weakref.WeakKeyDictionary()


class TextIndex:
    def __init__(self, pieces: list[str], fold_case: bool) -> None:
        self.fold_case = fold_case
        self.pieces = [p.lower() if fold_case else p for p in pieces]
        self.exact: dict[str, list[int]] = {}
        for i, p in enumerate(self.pieces):
            if p:
                self.exact.setdefault(p, []).append(i)
        entries = sorted((p, i) for i, p in enumerate(self.pieces) if p)
        self._texts = [p for p, _ in entries]
        self._ids = [i for _, i in entries]
        self.max_len = max((len(p) for p in self._texts), default=0)

    def key(self, text: str) -> str:
        return text.lower() if self.fold_case else text

    def starting_with(self, prefix: str) -> list[int]:
        """Ids whose text starts with `prefix` (already case-folded when the index is)."""
        lo = bisect.bisect_left(self._texts, prefix)
        hi = bisect.bisect_left(self._texts, prefix + "\U0010ffff")
        return self._ids[lo:hi]

    def prefixes_of(self, text: str) -> list[tuple[int, list[int]]]:
        """(length, ids) for every non-empty leading part of `text` that is some token's whole text."""
        out = []
        for k in range(1, min(len(text), self.max_len) + 1):
            ids = self.exact.get(text[:k])
            if ids:
                out.append((k, ids))
        return out


def text_index(tokenizer: Any, fold_case: bool = False) -> TextIndex:
    try:
        per_tok = _cache.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: build every time (still correct)
        per_tok = {}
    if fold_case not in per_tok:
        per_tok[fold_case] = TextIndex(tokenizer.get_id_to_piece_list(False), fold_case)
    return per_tok[fold_case]
