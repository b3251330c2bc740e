"""`ExLlamaV2Tokenizer`: exllamav2's tokenizer API over tokenizer.json (HF `tokenizers`) or tokenizer.model
(`sentencepiece`), with special-token handling, left-padded batches, streaming-safe decoding and chat
templates.
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from exlpy.errors import MultimodalError, TokenizerError
from exlpy.tokenizer import tables
from exlpy.tokenizer.backend import AddedToken, TokenizerBackend, read_json_object
from exlpy.tokenizer.base import BackendTokenizerModel
from exlpy.tokenizer.chat import render_chat_template, select_template
from exlpy.tokenizer.hf import ExLlamaV2TokenizerHF, HFBackend
from exlpy.tokenizer.pieces import PrefixIndex, decoded_pieces
from exlpy.tokenizer.specials import ids_from_config, ids_from_files, resolve_special_ids
from exlpy.tokenizer.spm import ExLlamaV2TokenizerSPM, SPMBackend
from exlpy.tokenizer.stream import StreamDecoder

MAX_CACHED_STRINGS = 100
_SURROGATE = re.compile("[\ud800-\udfff]")


def open_backend(model_dir: str, force_json: bool, force_spm: bool) -> TokenizerBackend:
    """Prefer tokenizer.json; use tokenizer.model when forced or when it is the only file."""
    if force_json and force_spm:
        raise TokenizerError("force_json and force_spm cannot both be set")
    json_path = os.path.join(model_dir, "tokenizer.json")
    spm_path = os.path.join(model_dir, "tokenizer.model")
    if force_spm or (not force_json and not os.path.isfile(json_path) and os.path.isfile(spm_path)):
        if not os.path.isfile(spm_path):
            raise TokenizerError(f"tokenizer.model not found (force_spm is set): {spm_path}")
        return SPMBackend(spm_path, model_dir)
    if not os.path.isfile(json_path):
        what = "tokenizer.json" if force_json else "tokenizer.json or tokenizer.model"
        raise TokenizerError(f"{what} not found in {model_dir}: {json_path}")
    return HFBackend(json_path, model_dir)


class ExLlamaV2Tokenizer:
    """Tokenizer of a model directory. `config` is an ExLlamaV2Config or a directory path."""

    Trie = tables.Trie  # exllamav2's ExLlamaV2Tokenizer.Trie (nodes of get_char_trie())

    def __init__(self, config: Any, lazy_init: bool = True, force_json: bool = False,
                 force_spm: bool = False) -> None:
        if isinstance(config, (str, os.PathLike)):
            model_dir, self.config = os.fspath(config), None
        else:
            model_dir, self.config = getattr(config, "model_dir", None), config
        if model_dir is None:
            raise TokenizerError("no tokenizer directory: the config has no model_dir")
        if not os.path.isdir(model_dir):
            raise TokenizerError(f"tokenizer directory does not exist: {model_dir}")
        self.model_dir = model_dir
        self.backend = open_backend(model_dir, force_json, force_spm)
        # exllamav2's wrapper of the tokenizer library; integrations read it as `tokenizer.tokenizer`.
        self.tokenizer_model: BackendTokenizerModel = (
            ExLlamaV2TokenizerHF(self.backend, self.get_id_to_piece_list) if isinstance(self.backend, HFBackend)
            else ExLlamaV2TokenizerSPM(self.backend, self.get_id_to_piece_list))

        self._added: dict[int, AddedToken] = {t.id: t for t in self.backend.added_tokens()}
        self.extended_piece_to_id = {t.content: t.id for t in self._added.values() if t.special}
        self.extended_id_to_piece = {t.id: t.content for t in self._added.values() if t.special}
        self.unspecial_piece_to_id = {t.content: t.id for t in self._added.values() if not t.special}
        self.unspecial_id_to_piece = {i: p for p, i in self.unspecial_piece_to_id.items()}
        self.id_to_piece: list[str] = self.backend.raw_pieces()  # the vocabulary's own piece strings
        self.piece_to_id: dict[str, int] = {p: i for i, p in enumerate(self.id_to_piece) if p}
        self.actual_vocab_size = len(self.id_to_piece)

        tok_cfg_path = os.path.join(model_dir, "tokenizer_config.json")
        self.tokenizer_config: dict[str, Any] = (
            read_json_object(tok_cfg_path, "tokenizer_config.json") if os.path.exists(tok_cfg_path) else {})
        model_ids = ids_from_files(model_dir) if self.config is None else ids_from_config(self.config)
        lookup = {**self.piece_to_id, **self.unspecial_piece_to_id, **self.extended_piece_to_id}
        ids = resolve_special_ids(model_ids, self.tokenizer_config, lookup)
        self.bos_token_id, self.eos_token_id, self.pad_token_id = ids.bos, ids.eos, ids.pad
        self.stop_token_ids: frozenset[int] = ids.stop
        self.bos_token = self._token_text(self.bos_token_id)
        self.eos_token = self._token_text(self.eos_token_id)
        self.pad_token = self._token_text(self.pad_token_id)
        self.unk_token_id = self.tokenizer_model.unk_id()
        self.unk_token = self.tokenizer_model.unk_token()
        self.newline_token, self.space_token = "\n", " "

        self.newline_token_id = self._last_id("\n")
        self.space_token_id = next((self.piece_to_id[p] for p in ("▁", "Ġ", " ") if p in self.piece_to_id),
                                   self._last_id(" "))
        self.tokenized_str_cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.max_cached_strings = MAX_CACHED_STRINGS
        self._pieces: list[str] | None = None  # with special tokens' text
        self._pieces_plain: list[str] | None = None  # special tokens as ''
        self._prefix_index: PrefixIndex | None = None
        self._tables: dict[str, Any] = {}  # id_to_ord, char tries, prefix dicts: built on first use
        if not lazy_init:
            self.get_id_to_piece_list()
            self._get_prefix_index()

    @property
    def tokenizer(self) -> BackendTokenizerModel:
        """exllamav2's alias of `tokenizer_model` (lm-format-enforcer reads this one)."""
        return self.tokenizer_model

    @property
    def tokenizer_config_dict(self) -> dict[str, Any] | None:
        return self.tokenizer_config or None

    # ------------------------------------------------------------------ helpers

    def _token_text(self, token_id: int) -> str | None:
        if token_id in self._added:
            return self._added[token_id].content
        return self.id_to_piece[token_id] if 0 <= token_id < self.actual_vocab_size else None

    def _last_id(self, text: str) -> int:
        ids = self._encode_text(text, False)
        if not ids:
            raise TokenizerError(f"tokenizer cannot encode {text!r}: {self.backend.path}")
        return ids[-1]

    def _encode_text(self, text: str, encode_special_tokens: bool) -> list[int]:
        """backend.encode, with text that no tokenizer can take (lone UTF-16 surrogates such as '\\ud800',
        which have no UTF-8 form) refused as a TokenizerError naming the position."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode() expects text (str), got {type(text).__name__}")
        try:
            return self.backend.encode(text, encode_special_tokens)
        except Exception as e:  # tokenizers raises TypeError, sentencepiece RuntimeError
            bad = _SURROGATE.search(text)
            if bad is not None:
                raise TokenizerError(f"text holds a lone surrogate {bad.group()!r} at index {bad.start()}, which "
                                     "is not valid Unicode text (it cannot be encoded as UTF-8)") from None
            raise TokenizerError(f"{self.backend.path} cannot encode the text: {type(e).__name__}: {e}") from e

    def _is_visible(self, token_id: int, decode_special_tokens: bool) -> bool:
        """Whether decode() keeps an id: out-of-vocabulary ids never; pads, EOS and specials on request.
        (Shown specials include the pad id, which is often EOS; only leading pads, the left padding of a
        batch, are stripped then.)"""
        if not 0 <= token_id < self.actual_vocab_size:
            return False
        if decode_special_tokens:
            return True
        added = self._added.get(token_id)
        return token_id not in (self.pad_token_id, self.eos_token_id) and (added is None or not added.special)

    def _decode_visible(self, ids: list[int]) -> str:
        """Decode filtered ids: added tokens give their content, base-vocab runs go to the backend."""
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            added = self._added.get(i)
            if added is None:
                run.append(i)
                continue
            if run:
                parts.append(self.backend.decode(run))
                run = []
            parts.append(added.content)
        if run:
            parts.append(self.backend.decode(run))
        return "".join(parts)

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str | Sequence[str], add_bos: bool = False, add_eos: bool = False,
               encode_special_tokens: bool = False, return_offsets: bool = False,
               embeddings: Sequence[Any] | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Ids as LongTensor [1, n], or [b, n] left-padded with pad_token_id for a list (offsets = -padding).
        Special tokens written in the text become their ids only with encode_special_tokens. Each alias of
        `embeddings` (ExLlamaV2MMEmbedding) in the text becomes that embedding's ids; an alias found in none of
        the texts is an error (the image would silently be left out)."""
        mm = None
        if embeddings:
            from exlpy.vision.embedding import check_embeddings

            mm = check_embeddings(embeddings)
        single = isinstance(text, str)
        texts = [text] if single else text
        if not isinstance(texts, (list, tuple)) or not all(isinstance(t, str) for t in texts):
            raise TokenizerError(f"encode() expects a str or a list of str, got {type(text).__name__}")
        if not texts:
            raise TokenizerError("encode() got an empty list of texts")
        seqs = []
        if mm:
            missing = [e.text_alias for e in mm if not any(e.text_alias in t for t in texts)]
            if missing:
                raise MultimodalError(f"encode(): the alias {missing[0]!r} of an embedding passed in embeddings= "
                                      "does not appear in the text; put each image's text_alias in the prompt")
        for t in texts:
            ids = self._encode_with_aliases(t, encode_special_tokens, mm) if mm else \
                self._encode_text(t, encode_special_tokens)
            bos = [self.bos_token_id] if add_bos else []
            seqs.append(bos + ids + ([self.eos_token_id] if add_eos else []))
        longest = max(len(s) for s in seqs)
        if any(len(s) < longest for s in seqs) and self.pad_token_id < 0:
            raise TokenizerError("cannot left-pad a batch of unequal lengths: the tokenizer has no pad token")
        out = torch.tensor([[self.pad_token_id] * (longest - len(s)) + s for s in seqs], dtype=torch.long)
        out = out.view(len(seqs), longest)
        if return_offsets:
            return out, torch.tensor([len(s) - longest for s in seqs], dtype=torch.int)
        return out

    def _encode_with_aliases(self, text: str, encode_special_tokens: bool, embeddings: list[Any]) -> list[int]:
        """The text's ids with each embedding alias replaced by its id range (text between aliases encoded
        on its own, as exllamav2 does)."""
        by_alias = {e.text_alias: e for e in embeddings}
        pattern = re.compile("|".join(re.escape(a) for a in sorted(by_alias, key=len, reverse=True)))
        out: list[int] = []
        pos = 0
        for m in pattern.finditer(text):
            if m.start() > pos:
                out += self._encode_text(text[pos:m.start()], encode_special_tokens)
            out += by_alias[m.group()].get_ids()
            pos = m.end()
        if pos < len(text):
            out += self._encode_text(text[pos:], encode_special_tokens)
        return out

    def decode(self, ids: torch.Tensor | Sequence[int] | Sequence[Sequence[int]],
               decode_special_tokens: bool = False) -> str | list[str]:
        """Text of 1-D ids, or a list of texts for 2-D ids. Without decode_special_tokens pads, EOS and
        special tokens are dropped; with it they read as their text, except the left padding."""
        if isinstance(ids, torch.Tensor):
            if ids.dim() > 2:
                raise TokenizerError(f"decode() expects 1-D or 2-D ids, got shape {tuple(ids.shape)}")
            if ids.is_floating_point():
                raise TokenizerError(f"decode() expects integer ids, got dtype {ids.dtype}")
            ids = ids.tolist()
        if not isinstance(ids, Sequence) or isinstance(ids, str):
            raise TokenizerError(f"decode() expects a tensor or a list of ids, got {type(ids).__name__}")
        if ids and (isinstance(ids[0], Sequence) or (isinstance(ids[0], torch.Tensor) and ids[0].dim() == 1)):
            return [self._decode_one(row, decode_special_tokens) for row in ids]  # type: ignore[arg-type]
        return self._decode_one(ids, decode_special_tokens)  # type: ignore[arg-type]

    def _decode_one(self, ids: Sequence[int], decode_special_tokens: bool) -> str:
        try:
            seq = [int(i) for i in ids]
        except (TypeError, ValueError, RuntimeError) as e:
            raise TokenizerError(f"decode() expects integer ids: {e}") from e
        if decode_special_tokens:
            start = 0
            while start < len(seq) and seq[start] == self.pad_token_id:
                start += 1
            seq = seq[start:]
        return self._decode_visible([i for i in seq if self._is_visible(i, decode_special_tokens)])

    def stream_decoder(self, decode_special_tokens: bool = False) -> StreamDecoder:
        """An incremental decoder whose outputs concatenate to decode(all ids)."""
        return StreamDecoder(self, decode_special_tokens)

    def num_tokens(self, text: str) -> int:
        return len(self._encode_text(text, False))

    def cached_encode_str(self, text: str) -> torch.Tensor:
        """encode(text), remembering the last MAX_CACHED_STRINGS strings (stop strings, banned strings)."""
        hit = self.tokenized_str_cache.get(text)
        if hit is not None:
            self.tokenized_str_cache.move_to_end(text)
            return hit
        enc = self.encode(text)
        assert isinstance(enc, torch.Tensor)
        self.tokenized_str_cache[text] = enc
        while len(self.tokenized_str_cache) > self.max_cached_strings:
            self.tokenized_str_cache.popitem(last=False)
        return enc

    def single_id(self, token: str) -> int | None:
        """The id of a token given as its text (an added token, a vocabulary piece, or text that encodes to
        exactly one token); None when it is not a single token, as in exllamav2."""
        for table in (self.extended_piece_to_id, self.unspecial_piece_to_id, self.piece_to_id):
            if token in table:
                return table[token]
        ids = self._encode_text(token, True)
        return ids[0] if len(ids) == 1 else None

    def get_vocab_size(self) -> int:
        """1 + the largest token id (added tokens included)."""
        return self.actual_vocab_size

    def encode_special(self, text: str) -> list[int]:
        """Ids of `text` where special-token text becomes its id (no BOS/EOS)."""
        return self._encode_text(text, True)

    def encode_unspecial(self, text: str) -> list[int]:
        """Ids of `text` where special-token text stays plain text (no BOS/EOS)."""
        return self._encode_text(text, False)

    @staticmethod
    def single_token(token_id: int) -> torch.Tensor:
        return torch.tensor([[token_id]], dtype=torch.long)

    def padding_mask(self, ids: torch.Tensor) -> torch.Tensor:
        """Additive fp16 attention mask: -inf where ids are padding, 0 elsewhere (same shape as ids)."""
        return torch.where(ids == self.pad_token_id, float("-inf"), 0.0).to(torch.float16)

    # ------------------------------------------------------------------ pieces

    def get_id_to_piece_list(self, include_special_tokens: bool = False) -> list[str]:
        """Text of every id as it reads inside a longer text; special tokens are '' unless included."""
        if self._pieces is None:
            self._pieces = decoded_pieces(self.backend, self.actual_vocab_size, self._added)
        if include_special_tokens:
            return self._pieces
        if self._pieces_plain is None:
            hidden = self.extended_id_to_piece
            self._pieces_plain = [("" if i in hidden else p) for i, p in enumerate(self._pieces)]
        return self._pieces_plain

    def get_piece_to_id_dict(self) -> dict[str, int]:
        """Decoded piece text -> id (the first id wins where two ids decode alike); specials excluded."""
        table: dict[str, int] = {}
        for i, p in enumerate(self.get_id_to_piece_list()):
            if p:
                table.setdefault(p, i)
        return table

    def _get_prefix_index(self) -> PrefixIndex:
        if self._prefix_index is None:
            self._prefix_index = PrefixIndex(self.get_id_to_piece_list(), set(self.extended_id_to_piece))
        return self._prefix_index

    def get_tokens_with_prefix_string(self, prefix: str) -> list[int]:
        """Ids (specials excluded) whose piece text starts with `prefix` (token healing candidates)."""
        return self._get_prefix_index().with_prefix(prefix)

    def get_tokens_with_prefix_id(self, prefix_id: int) -> list[int]:
        if not 0 <= prefix_id < self.actual_vocab_size:
            raise TokenizerError(f"token id {prefix_id} is outside the vocabulary "
                                 f"(size {self.actual_vocab_size})")
        return self.get_tokens_with_prefix_string(self.get_id_to_piece_list(True)[prefix_id])

    def _table(self, name: str, build: Any) -> Any:
        if name not in self._tables:
            self._tables[name] = build()
        return self._tables[name]

    def get_id_to_ord_list(self) -> list[int]:
        """Per id, the byte it stands for (byte-fallback '<0x41>' or a one-character piece), else -1."""
        return self._table("ord", lambda: tables.id_to_ord(self.tokenizer_model, self.actual_vocab_size))

    def get_char_trie(self) -> tables.Trie:
        """Trie over every token's text (special tokens excluded); `leaf` lists the ids ending at a node."""
        return self._table("trie", lambda: tables.char_trie(self.get_id_to_piece_list(), False))

    def get_char_trie_ci(self) -> tables.Trie:
        """The same trie over lower-cased texts."""
        return self._table("trie_ci", lambda: tables.char_trie(self.get_id_to_piece_list(), True))

    def get_prefix_to_ids_dict(self) -> dict[str, list[int]]:
        """Token text -> sorted ids of every token whose text starts with it."""
        return self._table("prefix", lambda: tables.prefix_to_ids(self.get_piece_to_id_dict(),
                                                                    self._get_prefix_index()))

    def get_prefix_id_to_ids_dict(self) -> dict[int, list[int]]:
        """Token id -> sorted ids of every token whose text starts with its text (itself included)."""
        def build() -> dict[int, list[int]]:
            by_text = self.get_prefix_to_ids_dict()
            pieces = self.get_id_to_piece_list()
            return {i: by_text.get(p, [i]) if p else [i] for i, p in enumerate(pieces)}
        return self._table("prefix_id", build)

    # ------------------------------------------------------------------ chat

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            chat_template: str | None = None, **kwargs: Any) -> str:
        """Render the model's chat template (tokenizer_config.json) or `chat_template` into a prompt string.
        Encode it with encode_special_tokens=True (it already holds BOS where the template adds it)."""
        name = kwargs.pop("template_name", None)
        if chat_template:
            template, source = chat_template, "the chat_template passed to apply_chat_template"
        else:
            template = select_template(self.tokenizer_config.get("chat_template"), name, self.model_dir)
            where = os.path.join(self.model_dir, "tokenizer_config.json")
            source = f"chat template {name or 'default'!r} of {where}"
        return render_chat_template(template, messages, add_generation_prompt=add_generation_prompt,
                                    bos_token=self.bos_token or "", eos_token=self.eos_token or "", source=source,
                                    **kwargs)
