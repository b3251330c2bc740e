"""llguidance's view of an exlpy tokenizer (`LLTokenizer`), built once per tokenizer and vocabulary size.

tokenizer.json goes to llguidance as is (it reads byte-level and SentencePiece vocabularies itself); a
SentencePiece-only tokenizer is described token by token (its bytes) through `TokenizerWrapper`. EOS is every
stop id of the model, so a grammar that is complete lets any of them end the generation.
"""

from __future__ import annotations

import re
import threading
import weakref
from typing import Any

from exlpy.errors import GeneratorError

_cache: weakref.WeakKeyDictionary[Any, dict[int, Any]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()
_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def import_llguidance() -> Any:
    try:
        import llguidance
    except ImportError as e:
        raise GeneratorError("grammar filters (JSON schema, regex, Lark/EBNF) need llguidance: "
                             "pip install 'exlpy[grammar]'") from e
    return llguidance


def grammar_eos(ll_tokenizer: Any) -> set[int]:
    """The ids llguidance lets through where a grammar is complete."""
    ids = getattr(ll_tokenizer, "eos_tokens", None)
    return set(ids) if ids else {int(ll_tokenizer.eos_token)}


def stop_ids(tokenizer: Any) -> list[int]:
    ids = set(getattr(tokenizer, "stop_token_ids", ()) or ())
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int) and eos >= 0:
        ids.add(eos)
    return sorted(ids)


def _spm_bytes(piece: str) -> bytes:
    m = _BYTE.fullmatch(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    return piece.replace("\u2581", " ").encode("utf-8")


class _SPMSource:
    """What `llguidance.TokenizerWrapper` reads: token bytes, EOS/BOS, special ids and an encode callable."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        specials = set(getattr(tokenizer, "extended_id_to_piece", {}) or {})
        self.tokens = [(t or "").encode("utf-8") if i in specials else _spm_bytes(t or "")
                       for i, t in enumerate(tokenizer.id_to_piece)]
        self.eos_token_id = stop_ids(tokenizer)[0]
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self.special_token_ids = sorted(specials)

    def __call__(self, text: str) -> list[int]:
        # Tokens as they continue a text (generation follows a prompt): SentencePiece's dummy prefix space
        # belongs to the start of a text only, so encode after a newline anchor and drop the anchor's ids.
        anchor = self.tok.backend.encode("\n", False)
        ids = self.tok.backend.encode("\n" + text, False)
        return ids[len(anchor):] if ids[:len(anchor)] == anchor else self.tok.backend.encode(text, False)


def llg_tokenizer(tokenizer: Any, n_vocab: int) -> Any:
    """The cached LLTokenizer of `tokenizer` for logits of width `n_vocab`."""
    llg = import_llguidance()
    with _lock:
        try:
            per_tok = _cache.setdefault(tokenizer, {})
        except TypeError:
            per_tok = {}
        if n_vocab not in per_tok:
            eos = stop_ids(tokenizer)
            if not eos:
                raise GeneratorError("grammar filters need a tokenizer with an EOS token id")
            backend = getattr(tokenizer, "backend", None)
            if getattr(backend, "kind", None) == "json":
                with open(backend.path, encoding="utf-8") as f:
                    source: Any = f.read()
            elif hasattr(tokenizer, "id_to_piece"):
                source = llg.TokenizerWrapper(_SPMSource(tokenizer))
            else:
                raise GeneratorError(f"grammar filters need an exlpy tokenizer, got {type(tokenizer).__name__}")
            try:
                per_tok[n_vocab] = llg.LLTokenizer(source, n_vocab=n_vocab, eos_token=eos)
            except TypeError:  # llguidance < 1.7 takes one EOS id
                main = getattr(tokenizer, "eos_token_id", None)
                per_tok[n_vocab] = llg.LLTokenizer(source, n_vocab=n_vocab, eos_token=main if main in eos else eos[0])
        return per_tok[n_vocab]
