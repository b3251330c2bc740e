"""Vocabulary tables exllamav2's tokenizer offers to filters and samplers: the byte value of single-byte
tokens, a character trie over the token texts, and prefix -> ids maps."""

from __future__ import annotations

from typing import Any

from exlpy.tokenizer.pieces import PrefixIndex


class Trie:
    """A node of the character trie: `children` maps the next character to a node, `leaf` lists the ids whose
    text ends at this node."""

    def __init__(self, children: dict[str, Trie] | None = None, leaf: list[int] | None = None) -> None:
        self.children: dict[str, Trie] = children if children is not None else {}
        self.leaf: list[int] = leaf if leaf is not None else []


def char_trie(pieces: list[str], case_insensitive: bool) -> Trie:
    """Trie over every non-empty piece (lower-cased when case_insensitive)."""
    root = Trie()
    for idx, piece in enumerate(pieces):
        if not piece:
            continue
        node = root
        for ch in piece.lower() if case_insensitive else piece:
            node = node.children.setdefault(ch, Trie())
        node.leaf.append(idx)
    return root


def id_to_ord(model: Any, size: int) -> list[int]:
    """Per id, the byte value it stands for (byte-fallback '<0x41>' or a one-character piece), else -1."""
    return [model.piece_to_ord(model.id_to_piece(i) or "") for i in range(size)]


def prefix_to_ids(piece_to_id: dict[str, int], index: PrefixIndex) -> dict[str, list[int]]:
    """For every piece text: the sorted ids of all pieces that start with it (itself included)."""
    return {p: sorted(index.with_prefix(p)) for p in piece_to_id if p}
