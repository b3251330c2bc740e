"""What the public tokenizer needs from a tokenizer library, and the added-token record both backends share.

A backend owns the base vocabulary (the model's BPE/unigram pieces) and knows its added tokens. It decodes
only runs of base ids: the public class splits id sequences at added tokens itself, so that both libraries
treat special tokens, pads and stop tokens the same way.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from exlpy.errors import TokenizerError


@dataclass(frozen=True)
class AddedToken:
    """A token outside the learned vocabulary (control tokens, chat markers); `special` ones decode to ''
    unless asked for."""

    id: int
    content: str
    special: bool


class TokenizerBackend(Protocol):
    kind: str  # "json" (HF tokenizers) or "spm" (sentencepiece)
    path: str
    # Ids whose text may still change with the ids after them (HF's ByteFallback decoder turns a whole run of
    # byte tokens into U+FFFDs when the run is invalid UTF-8, even bytes that were valid on their own).
    regroup_ids: frozenset[int]

    def encode(self, text: str, encode_special_tokens: bool) -> list[int]:
        """Ids of `text` without BOS/EOS; special added tokens count only if `encode_special_tokens`."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of a run of base-vocabulary ids (no added tokens)."""
        ...

    def decode_batch(self, seqs: Sequence[Sequence[int]]) -> list[str]: ...

    def raw_pieces(self) -> list[str]:
        """The vocabulary's own piece strings by id (e.g. '▁the', 'Ġthe', '<0x0A>'), added tokens included."""
        ...

    def added_tokens(self) -> list[AddedToken]: ...


def read_json(path: str, what: str) -> Any:
    """Parse a JSON file; a malformed one is a TokenizerError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"cannot read {what}: {path}: {e}") from e


def extra_added_tokens(model_dir: str) -> list[AddedToken]:
    """Added tokens declared outside the tokenizer model: added_tokens.json (all special, as in exllamav2) and
    tokenizer_config.json's added_tokens_decoder (with its own special flags)."""
    found: dict[int, AddedToken] = {}
    p = os.path.join(model_dir, "added_tokens.json")
    if os.path.isfile(p):
        data = read_json(p, "added_tokens.json")
        if not isinstance(data, dict):
            raise TokenizerError(f"added_tokens.json must map token text to id: {p}")
        for content, idx in data.items():
            found[int(idx)] = AddedToken(int(idx), str(content), True)
    p = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.isfile(p):
        decoder = read_json(p, "tokenizer_config.json").get("added_tokens_decoder") or {}
        for idx, entry in decoder.items():
            if isinstance(entry, dict) and "content" in entry:
                token = AddedToken(int(idx), str(entry["content"]), bool(entry.get("special")))
                found.setdefault(token.id, token)
    return sorted(found.values(), key=lambda t: t.id)
