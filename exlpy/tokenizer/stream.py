"""Incremental detokenization: feed ids one at a time, get back only text that can no longer change.

Text is held back while the decoded tail ends in U+FFFD (an incomplete UTF-8 sequence from byte-fallback or
byte-level tokens), and after byte tokens whose decoding the library may still revise. Each new window is
decoded together with the ids already emitted before it, so that SentencePiece's "strip the leading space at
the start of a text" applies equally to both decodes and cancels out. Concatenating every returned string
plus `flush()` equals `tokenizer.decode(all ids)` with the same `decode_special_tokens` setting.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from exlpy.tokenizer.tokenizer import ExLlamaV2Tokenizer

REPLACEMENT = "\ufffd"


class StreamDecoder:
    def __init__(self, tokenizer: ExLlamaV2Tokenizer, decode_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.decode_special_tokens = decode_special_tokens
        self._run: list[int] = []  # base-vocab ids of the current run; the first `_done` are already emitted
        self._done = 0
        self._leading = True  # left padding is skipped even when specials are shown, as decode() does

    def reset(self) -> None:
        self._run, self._done = [], 0

    def add(self, token_id: int) -> str:
        """Feed one id; returns the text that became final (possibly '')."""
        tok = self.tokenizer
        token_id = int(token_id)
        if not tok._is_visible(token_id, self.decode_special_tokens):
            return ""
        if self._leading and token_id == tok.pad_token_id:
            return ""
        self._leading = False
        added = tok._added.get(token_id)
        if added is not None:  # an added token ends the run: decode() splits runs at the same places
            return self.flush() + added.content
        self._run.append(token_id)
        backend = tok.backend
        prefix = backend.decode(self._run[: self._done]) if self._done else ""
        text = backend.decode(self._run)
        if (text.endswith(REPLACEMENT) or token_id in backend.regroup_ids or not text.startswith(prefix)
                or len(text) == len(prefix)):
            return ""
        # The emitted ids stay as context for the next window so that its leading-space handling matches.
        self._run = self._run[self._done:]
        self._done = len(self._run)
        return text[len(prefix):]

    def feed(self, ids: Iterable[int] | torch.Tensor) -> str:
        """Feed several ids (a list or a one-row tensor); returns the text that became final."""
        if isinstance(ids, torch.Tensor):
            ids = ids.flatten().tolist()
        return "".join(self.add(i) for i in ids)

    def flush(self) -> str:
        """Everything still held (incomplete UTF-8 comes out as U+FFFD); starts a new run."""
        backend = self.tokenizer.backend
        prefix = backend.decode(self._run[: self._done]) if self._done else ""
        text = backend.decode(self._run) if self._run else ""
        self.reset()
        return text[len(prefix):] if text.startswith(prefix) else text
