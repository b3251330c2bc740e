"""Backend over the Hugging Face `tokenizers` library (tokenizer.json): BPE, byte-level BPE, unigram."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence

from tokenizers import Tokenizer

from exlpy.errors import TokenizerError
from exlpy.tokenizer.backend import MAX_ID_GAP, AddedToken, check_added_ids, extra_added_tokens, read_json
from exlpy.tokenizer.base import BackendTokenizerModel


class HFBackend:
    kind = "json"

    def __init__(self, path: str, model_dir: str) -> None:
        self.path = path
        try:
            self.tk = Tokenizer.from_file(path)
        except BaseException as e:  # plain Exception for every failure, or a Rust panic (a BaseException)
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            read_json(path, "tokenizer.json")  # names malformed JSON precisely; a schema error falls through
            raise TokenizerError(f"tokenizer.json is not a valid tokenizers file: {path}: {e}") from e
        # Padding/truncation configured in the file would silently change encode() lengths.
        self.tk.no_padding()
        self.tk.no_truncation()
        added = {i: AddedToken(i, t.content, bool(t.special))
                 for i, t in self.tk.get_added_tokens_decoder().items()}
        base = self.tk.get_vocab(with_added_tokens=False)
        base_size = len(base)
        top = max(base.values(), default=-1)
        if top >= base_size + MAX_ID_GAP:  # raw_pieces() sizes a table by the largest id
            raise TokenizerError(f"tokenizer.json: vocabulary id {top} is far beyond its {base_size} pieces (ids may "
                                 f"exceed the piece count by at most {MAX_ID_GAP}): {path}")
        check_added_ids(list(added.values()), base_size, path)
        for t in extra_added_tokens(model_dir, base_size):
            added.setdefault(t.id, t)
        self._added = sorted(added.values(), key=lambda t: t.id)
        self._split_special: bool | None = None
        byte_piece = re.compile(r"<0x[0-9A-Fa-f]{2}>")
        self.regroup_ids = frozenset(
            i for p, i in self.tk.get_vocab(with_added_tokens=False).items() if byte_piece.fullmatch(p)
        ) if getattr(self.tk.model, "byte_fallback", False) else frozenset()

    def encode(self, text: str, encode_special_tokens: bool) -> list[int]:
        # The library flag has the opposite sense: True means "treat special tokens as plain text".
        if self._split_special != encode_special_tokens:
            self.tk.encode_special_tokens = not encode_special_tokens
            self._split_special = encode_special_tokens
        return self.tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=False)

    def decode_batch(self, seqs: Sequence[Sequence[int]]) -> list[str]:
        return self.tk.decode_batch([list(s) for s in seqs], skip_special_tokens=False)

    def raw_pieces(self) -> list[str]:
        vocab = self.tk.get_vocab(with_added_tokens=True)
        size = max(max(vocab.values(), default=-1), max((t.id for t in self._added), default=-1)) + 1
        pieces = [""] * size
        for piece, i in vocab.items():
            pieces[i] = piece
        for t in self._added:
            if not pieces[t.id]:
                pieces[t.id] = t.content
        return pieces

    def added_tokens(self) -> list[AddedToken]:
        return self._added


class ExLlamaV2TokenizerHF(BackendTokenizerModel):
    """exllamav2's wrapper of a tokenizer.json (`tokenizer.tokenizer` of a model that has one).
    `hf_tokenizer` is the `tokenizers.Tokenizer` itself."""

    def __init__(self, tokenizer_json: str | HFBackend, pieces: Callable[[], list[str]] | None = None) -> None:
        backend = tokenizer_json if isinstance(tokenizer_json, HFBackend) else \
            HFBackend(tokenizer_json, os.path.dirname(os.path.abspath(tokenizer_json)))
        self.hf_tokenizer = backend.tk
        super().__init__(backend, pieces)

    def _unk_piece(self) -> str | None:
        return getattr(self.hf_tokenizer.model, "unk_token", None)
