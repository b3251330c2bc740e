"""Backend over `sentencepiece` (tokenizer.model), for Llama-2/Mistral-era models that ship no tokenizer.json.

SentencePiece knows nothing of added tokens beyond its control pieces, so special strings are split out of the
text here by one regex and each remaining segment is encoded on its own (getting its own dummy-prefix space,
which is what HF's converted tokenizer.json files do too).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence

import sentencepiece as spm

from exlpy.errors import TokenizerError
from exlpy.tokenizer.backend import AddedToken, extra_added_tokens
from exlpy.tokenizer.base import BackendTokenizerModel


class SPMBackend:
    kind = "spm"
    regroup_ids: frozenset[int] = frozenset()  # sentencepiece replaces invalid bytes one by one, in place

    def __init__(self, path: str, model_dir: str) -> None:
        self.path = path
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.Load(path)
        except Exception as e:  # sentencepiece raises OSError or RuntimeError depending on the failure
            raise TokenizerError(f"tokenizer.model is not a valid SentencePiece model: {path}: {e}") from e
        self.n = self.sp.get_piece_size()
        added = {
            i: AddedToken(i, self.sp.id_to_piece(i), True)
            for i in range(self.n)
            if self.sp.is_control(i) or self.sp.is_unknown(i)
        }
        for t in extra_added_tokens(model_dir, self.n):
            if t.id >= self.n or t.id in added:
                added[t.id] = t
        self._added = sorted(added.values(), key=lambda t: t.id)
        self._patterns = {flag: self._pattern(flag) for flag in (False, True)}
        self._by_content = {t.content: t.id for t in self._added}

    def _pattern(self, with_special: bool) -> re.Pattern[str] | None:
        # Longest first so that "<|im_end|>" wins over a shorter token that is its prefix.
        texts = sorted({t.content for t in self._added if t.content and (with_special or not t.special)},
                       key=len, reverse=True)
        return re.compile("(" + "|".join(re.escape(t) for t in texts) + ")") if texts else None

    def encode(self, text: str, encode_special_tokens: bool) -> list[int]:
        pattern = self._patterns[encode_special_tokens]
        if pattern is None:
            return self.sp.encode(text) if text else []
        ids: list[int] = []
        for i, segment in enumerate(pattern.split(text)):
            if i % 2:  # odd items are the captured added-token texts
                ids.append(self._by_content[segment])
            elif segment:
                ids.extend(self.sp.encode(segment))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.sp.decode(list(ids))

    def decode_batch(self, seqs: Sequence[Sequence[int]]) -> list[str]:
        return self.sp.decode([list(s) for s in seqs])

    def raw_pieces(self) -> list[str]:
        pieces = self.sp.id_to_piece(list(range(self.n)))
        extra = [t for t in self._added if t.id >= self.n]
        if extra:
            pieces += [""] * (max(t.id for t in extra) + 1 - self.n)
            for t in extra:
                pieces[t.id] = t.content
        return pieces

    def added_tokens(self) -> list[AddedToken]:
        return self._added


class ExLlamaV2TokenizerSPM(BackendTokenizerModel):
    """The exllamav2-style wrapper of a SentencePiece tokenizer.model (`tokenizer.tokenizer` of a model
    without tokenizer.json; exllamav2 itself dropped SentencePiece in 0.3.1). `spm` is the processor."""

    def __init__(self, tokenizer_model: str | SPMBackend, pieces: Callable[[], list[str]] | None = None) -> None:
        backend = tokenizer_model if isinstance(tokenizer_model, SPMBackend) else \
            SPMBackend(tokenizer_model, os.path.dirname(os.path.abspath(tokenizer_model)))
        self.spm = backend.sp
        super().__init__(backend, pieces)

    def _unk_piece(self) -> str | None:
        unk = self.spm.unk_id()
        return self.spm.id_to_piece(unk) if unk >= 0 else None
