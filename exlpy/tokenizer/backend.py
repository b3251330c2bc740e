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


# Added tokens extend the vocabulary at its end; an id far past it is garbage (an 80-byte added_tokens.json with
# id 10^8 would otherwise size a 10^8-entry piece table). Ids may run past base + added tokens by this much.
MAX_ID_GAP = 1024


def read_json(path: str, what: str) -> Any:
    """Parse a JSON file; a malformed one (or one that is no regular file) is a TokenizerError naming it."""
    if os.path.exists(path) and not os.path.isfile(path):  # a FIFO would block open() forever
        raise TokenizerError(f"cannot read {what}: {path} is not a regular file")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except RecursionError:
        raise TokenizerError(f"cannot read {what}: {path}: JSON nested too deeply") from None
    except (OSError, ValueError) as e:
        raise TokenizerError(f"cannot read {what}: {path}: {e}") from e


def read_json_object(path: str, what: str) -> dict[str, Any]:
    data = read_json(path, what)
    if not isinstance(data, dict):
        raise TokenizerError(f"{what} must hold a JSON object, got a {type(data).__name__}: {path}")
    return data


def _token_id(value: Any, what: str, path: str, token: str, key: bool = False) -> int:
    if key and isinstance(value, str) and value.isdigit() and value.isascii():
        value = int(value)  # JSON object keys are strings: added_tokens_decoder is keyed by "128000"
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TokenizerError(f"{what}: token {token[:40]!r} has id {str(value)[:40]!r}, not a non-negative "
                             f"integer: {path}")
    return value


def check_added_ids(tokens: list[AddedToken], base_size: int, where: str) -> None:
    """Refuse added-token ids so far past the vocabulary that a table indexed by id would be mostly empty."""
    limit = base_size + len(tokens) + MAX_ID_GAP
    for t in tokens:
        if t.id >= limit:
            raise TokenizerError(f"added token {t.content[:40]!r} has id {t.id}, beyond the vocabulary "
                                 f"({base_size} pieces + {len(tokens)} added tokens; ids may exceed that by at "
                                 f"most {MAX_ID_GAP}): {where}")


def extra_added_tokens(model_dir: str, base_size: int) -> list[AddedToken]:
    """Added tokens declared outside the tokenizer model: added_tokens.json (all special, as in exllamav2) and
    tokenizer_config.json's added_tokens_decoder (with its own special flags). `base_size`: pieces of the
    tokenizer model itself, which bounds the ids (check_added_ids)."""
    found: dict[int, AddedToken] = {}
    p = os.path.join(model_dir, "added_tokens.json")
    if os.path.exists(p):
        data = read_json_object(p, "added_tokens.json")
        for content, idx in data.items():
            i = _token_id(idx, "added_tokens.json", p, content)
            found[i] = AddedToken(i, content, True)
        check_added_ids(list(found.values()), base_size, p)
    p = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.exists(p):
        decoder = read_json_object(p, "tokenizer_config.json").get("added_tokens_decoder") or {}
        if not isinstance(decoder, dict):
            raise TokenizerError(f"tokenizer_config.json: added_tokens_decoder must map ids to tokens, got a "
                                 f"{type(decoder).__name__}: {p}")
        from_config = []
        for idx, entry in decoder.items():
            if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
                raise TokenizerError(f"tokenizer_config.json: added_tokens_decoder[{idx[:40]!r}] must be an object "
                                     f"with a 'content' string: {p}")
            i = _token_id(idx, "tokenizer_config.json added_tokens_decoder", p, entry["content"], key=True)
            from_config.append(AddedToken(i, entry["content"], bool(entry.get("special"))))
        check_added_ids(from_config, base_size, p)
        for token in from_config:
            found.setdefault(token.id, token)
    return sorted(found.values(), key=lambda t: t.id)
