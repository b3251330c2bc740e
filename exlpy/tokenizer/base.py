"""`ExLlamaV2TokenizerBase`: exllamav2's interface to the tokenizer library under `ExLlamaV2Tokenizer`.

Libraries built on exllamav2 read it as `tokenizer.tokenizer` / `tokenizer.tokenizer_model` (lm-format-enforcer
asks its `vocab_size()`, formatron its `id_to_piece()` and `vocab`). `BackendTokenizerModel` implements it over
one of exlpy's backends (tokenizer.json or tokenizer.model); hf.py and spm.py name the two flavours.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from exlpy.tokenizer.backend import TokenizerBackend
from exlpy.tokenizer.pieces import decoded_pieces


class ExLlamaV2TokenizerBase:
    """The methods a tokenizer library wrapper provides (exllamav2's abstract base)."""

    ord_exp = re.compile(r"^<0x([0-9A-Fa-f]+)>$")

    def unk_id(self) -> int | None: raise NotImplementedError
    def pad_id(self) -> int | None: raise NotImplementedError
    def bos_id(self) -> int | None: raise NotImplementedError
    def eos_id(self) -> int | None: raise NotImplementedError
    def unk_token(self) -> str | None: raise NotImplementedError
    def pad_token(self) -> str | None: raise NotImplementedError
    def bos_token(self) -> str | None: raise NotImplementedError
    def eos_token(self) -> str | None: raise NotImplementedError
    def space_char(self) -> str: raise NotImplementedError
    def newline_char(self) -> str: raise NotImplementedError
    def enumerate_tokens(self) -> Iterator[tuple[int, str]]: raise NotImplementedError
    def vocab_size(self) -> int: raise NotImplementedError
    def id_to_piece(self, idx: int) -> str | None: raise NotImplementedError
    def piece_to_id(self, text: str) -> int | None: raise NotImplementedError
    def decode(self, ids: Sequence[int]) -> str: raise NotImplementedError
    def encode(self, text: str) -> list[int]: raise NotImplementedError

    def clean_special_chars(self, p: str) -> str:
        """A raw piece with the vocabulary's space and newline markers ('Ġ', '▁', 'Ċ') as real characters."""
        return p.replace(self.space_char(), " ").replace(self.newline_char(), "\n")

    def piece_to_ord(self, p: str) -> int:
        """The byte value a single-byte piece stands for ('<0x0A>' -> 10, 'a' -> 97), else -1."""
        m = self.ord_exp.match(p)
        if m:
            return int(m.group(1), 16)
        if len(p) == 1:
            o = ord(self.clean_special_chars(p))
            if o <= 255:
                return o
        return -1

    def id_to_ord(self, idx: int) -> int:
        return self.piece_to_ord(self.id_to_piece(idx) or "")

    def deduce_char_map(self, input_char: str) -> str:
        """The character the vocabulary writes `input_char` as (e.g. ' ' -> 'Ġ' in byte-level BPE)."""
        ids = self.encode(input_char)
        if not ids:
            return input_char
        piece = self.id_to_piece(ids[-1]) or input_char
        m = self.ord_exp.match(piece)
        return chr(int(m.group(1), 16)) if m else piece[-1]


class BackendTokenizerModel(ExLlamaV2TokenizerBase):
    """The interface over an exlpy backend. Like exllamav2's: `encode` recognises special-token text, `decode`
    leaves special tokens out, BOS/EOS/PAD come from the model config (so the *_id methods answer None)."""

    def __init__(self, backend: TokenizerBackend, pieces: Callable[[], list[str]] | None = None) -> None:
        """`pieces`: where enumerate_tokens() gets the decoded pieces (ExLlamaV2Tokenizer passes its own list, so
        both agree and it is computed once); by default they are decoded here."""
        self.backend = backend
        self._pieces_source = pieces
        self._raw = backend.raw_pieces()
        self._ids = {p: i for i, p in enumerate(self._raw) if p}
        self._special = {t.id for t in backend.added_tokens() if t.special}
        self.vocab: list[str] | None = None  # decoded pieces, filled by enumerate_tokens()
        self.space_char_ = self.deduce_char_map(" ")
        self.newline_char_ = self.deduce_char_map("\n")

    def _unk_piece(self) -> str | None:
        return None

    def unk_id(self) -> int | None:
        piece = self._unk_piece()
        return None if piece is None else self.piece_to_id(piece)

    def unk_token(self) -> str | None:
        return self._unk_piece()

    def pad_id(self) -> int | None: return None
    def bos_id(self) -> int | None: return None
    def eos_id(self) -> int | None: return None
    def pad_token(self) -> str | None: return None
    def bos_token(self) -> str | None: return None
    def eos_token(self) -> str | None: return None

    def space_char(self) -> str:
        return self.space_char_

    def newline_char(self) -> str:
        return self.newline_char_

    def vocab_size(self) -> int:
        return len(self._raw)

    def enumerate_tokens(self) -> Iterator[tuple[int, str]]:
        """(id, text) for every id: its text inside a longer text; special tokens as ''."""
        if self.vocab is None and self._pieces_source is not None:
            self.vocab = list(self._pieces_source())
        if self.vocab is None:
            added = {t.id: t for t in self.backend.added_tokens()}
            pieces = decoded_pieces(self.backend, self.vocab_size(), added)
            self.vocab = ["" if i in self._special else p for i, p in enumerate(pieces)]
        return enumerate(self.vocab)

    def id_to_piece(self, idx: int | None) -> str | None:
        """The vocabulary's own string for an id ('Ġthe', '▁the', '<0x0A>'); None outside the vocabulary."""
        if idx is None:
            return ""
        return self._raw[idx] if 0 <= idx < len(self._raw) else None

    def piece_to_id(self, text: str) -> int | None:
        return self._ids.get(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode([int(i) for i in ids if int(i) not in self._special])

    def encode(self, text: str | Sequence[str]) -> Any:
        if isinstance(text, str):
            return self.backend.encode(text, True)
        return [self.backend.encode(t, True) for t in text]
