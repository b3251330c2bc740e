"""Per-id text pieces and prefix search over them (token healing, filters, stop-string matching).

A token's text depends on what precedes it in SentencePiece-style vocabularies: decoding '▁the' alone gives
'the' (the leading space is stripped at the start of a text), after another token it gives ' the'. So every id
is decoded after a fixed anchor token and the anchor's own text is cut off, which gives the mid-text form for
both SentencePiece and byte-level vocabularies in one batched call.
"""

from __future__ import annotations

import bisect

from exlpy.tokenizer.backend import AddedToken, TokenizerBackend


def decoded_pieces(backend: TokenizerBackend, size: int, added: dict[int, AddedToken]) -> list[str]:
    """Text of every id as it appears inside a longer text; added tokens give their content."""
    pieces = [""] * size
    base = [i for i in range(size) if i not in added]
    anchor_ids = [i for i in backend.encode("a", False) if i not in added]
    singles = backend.decode_batch([[i] for i in base])
    if anchor_ids:
        anchor = anchor_ids[-1]
        head = backend.decode([anchor])
        pairs = backend.decode_batch([[anchor, i] for i in base])
        for i, text, single in zip(base, pairs, singles):
            pieces[i] = text[len(head):] if head and text.startswith(head) else single
    else:
        for i, single in zip(base, singles):
            pieces[i] = single
    for t in added.values():
        if t.id < size:
            pieces[t.id] = t.content
    return pieces


class PrefixIndex:
    """Ids sorted by piece text, so that all pieces starting with a prefix form one contiguous slice."""

    def __init__(self, pieces: list[str], exclude: set[int]) -> None:
        entries = sorted((p, i) for i, p in enumerate(pieces) if p and i not in exclude)
        self._texts = [p for p, _ in entries]
        self._ids = [i for _, i in entries]

    def with_prefix(self, prefix: str) -> list[int]:
        lo = bisect.bisect_left(self._texts, prefix)
        hi = lo
        while hi < len(self._texts) and self._texts[hi].startswith(prefix):
            hi += 1
        return self._ids[lo:hi]
