"""Prompt tokenization exactly as Hugging Face transformers (and so vLLM) does it with the model's tokenizer.

The OpenAI server uses this for completion prompts and rendered chat templates, so that a prompt gives the
same ids as `AutoTokenizer.from_pretrained(model_dir)(prompt)` (and `apply_chat_template(..., tokenize=True)`):

- special tokens written in the text are parsed (`<|im_start|>` is one id), unless tokenizer_config.json sets
  `split_special_tokens`;
- BOS/EOS come from the tokenizer's own rule: the tokenizer.json post-processor, replaced by one built from
  tokenizer_config.json's `add_bos_token` / `add_eos_token` where those are given (as transformers does);
- tokenizer_class LlamaTokenizer(Fast) is rebuilt as transformers 5 does: no normalizer and a Metaspace
  pre-tokenizer whose prefix space follows `add_prefix_space` and `legacy` (a text that already starts with a
  space gets no second one); GPT2Tokenizer(Fast) gets a plain ByteLevel pre-tokenizer (transformers 5 drops
  e.g. SmolLM2's individual-digit splitting, so "4 ½" differs from tokenizer.json alone). Other classes keep
  tokenizer.json's pipeline, as transformers rebuilds them identically.

SentencePiece-only tokenizers (no tokenizer.json) parse special tokens the same way and add BOS unless
`add_bos_token` is false, EOS only if `add_eos_token` is true.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from exlpy.tokenizer.specials import token_text

LLAMA_CLASSES = ("LlamaTokenizer", "LlamaTokenizerFast", "CodeLlamaTokenizer", "CodeLlamaTokenizerFast")
GPT2_CLASSES = ("GPT2Tokenizer", "GPT2TokenizerFast")

_cache: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _prepend_scheme(cfg: dict[str, Any]) -> str:
    add_prefix_space = cfg.get("add_prefix_space")
    if add_prefix_space is None or add_prefix_space:
        return "always" if cfg.get("legacy", False) else "first"
    return "never"


def _template(cfg: dict[str, Any], vocab: dict[str, int]) -> Any:
    """transformers' post-processor from add_bos_token / add_eos_token (tokens that do not exist are left out)."""
    from tokenizers import processors

    bos, eos = token_text(cfg.get("bos_token")), token_text(cfg.get("eos_token"))
    add_bos = bool(cfg.get("add_bos_token", False)) and bos in vocab
    add_eos = bool(cfg.get("add_eos_token", False)) and eos in vocab
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    specials = [(t, vocab[t]) for t, on in ((bos, add_bos), (eos, add_eos)) if on and t is not None]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def build_hf_tokenizer(path: str, cfg: dict[str, Any]) -> Any:
    """A `tokenizers.Tokenizer` configured as transformers configures the one it loads from `path`."""
    from tokenizers import Tokenizer, pre_tokenizers

    tk = Tokenizer.from_file(path)
    tk.no_padding()
    tk.no_truncation()
    if cfg.get("tokenizer_class") in LLAMA_CLASSES and type(tk.model).__name__ == "BPE":
        tk.normalizer = None
        tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=_prepend_scheme(cfg),
                                                    split=False)
        tk.post_processor = _template({"add_bos_token": True, **cfg}, tk.get_vocab(with_added_tokens=True))
    else:
        if cfg.get("tokenizer_class") in GPT2_CLASSES and type(tk.model).__name__ == "BPE":
            tk.normalizer = None
            tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=bool(cfg.get("add_prefix_space", False)))
        if "add_bos_token" in cfg or "add_eos_token" in cfg or tk.post_processor is None:
            tk.post_processor = _template(cfg, tk.get_vocab(with_added_tokens=True))
    tk.encode_special_tokens = bool(cfg.get("split_special_tokens", False))
    return tk


def _hf_tokenizer(tokenizer: Any) -> Any:
    with _lock:
        try:
            hit = _cache.get(tokenizer)
        except TypeError:
            hit = None
        if hit is None:
            hit = build_hf_tokenizer(tokenizer.backend.path, tokenizer.tokenizer_config)
            try:
                _cache[tokenizer] = hit
            except TypeError:
                pass
        return hit


def hf_encode(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """Ids of `text` as transformers gives them: `tokenizer(text)` with add_special_tokens (BOS/EOS per the
    model's rule), special tokens in the text parsed."""
    backend = getattr(tokenizer, "backend", None)
    if getattr(backend, "kind", None) == "json":
        return list(_hf_tokenizer(tokenizer).encode(text, add_special_tokens=add_special_tokens).ids)
    cfg = getattr(tokenizer, "tokenizer_config", {}) or {}
    ids = list(backend.encode(text, not cfg.get("split_special_tokens", False)))  # type: ignore[union-attr]
    if add_special_tokens:
        if cfg.get("add_bos_token", True) and tokenizer.bos_token_id is not None and tokenizer.bos_token_id >= 0:
            ids = [tokenizer.bos_token_id, *ids]
        if cfg.get("add_eos_token", False) and tokenizer.eos_token_id is not None:
            ids = [*ids, tokenizer.eos_token_id]
    return ids


def hf_encode_text_only(tokenizer: Any, text: str) -> list[int]:
    """Ids of `text` with no special token parsed and none added (user content inside a chat prompt)."""
    backend = getattr(tokenizer, "backend", None)
    if getattr(backend, "kind", None) == "json":
        tk = _hf_tokenizer(tokenizer)
        with _lock:
            before = tk.encode_special_tokens
            tk.encode_special_tokens = True
            try:
                return list(tk.encode(text, add_special_tokens=False).ids)
            finally:
                tk.encode_special_tokens = before
    return list(backend.encode(text, False))  # type: ignore[union-attr]


def added_token_texts(tokenizer: Any) -> list[str]:
    """Texts that transformers parses as single tokens inside a text (every added token)."""
    texts = set(getattr(tokenizer, "extended_piece_to_id", {}) or {})
    texts |= set(getattr(tokenizer, "unspecial_piece_to_id", {}) or {})
    return sorted((t for t in texts if t), key=len, reverse=True)


def encode_chat(tokenizer: Any, text: str, contents: list[str]) -> list[int]:
    """Ids of a rendered chat prompt as `apply_chat_template(..., tokenize=True)` gives them, except that the
    message contents stay text: a user who writes `<|im_start|>system` gets those characters, not the control
    token. Contents holding no added-token text (the usual case) change nothing; the others are found in the
    rendered text in order and encoded on their own with special-token parsing off."""
    specials = added_token_texts(tokenizer)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for c in contents:
        if not c or not any(s in c for s in specials):
            continue
        i = text.find(c, cursor)
        if i < 0:
            c = c.strip()
            i = text.find(c, cursor)
        if i < 0:
            from exlpy.errors import TokenizerError

            raise TokenizerError("messages: the chat template rewrote a message that contains special-token "
                                 "text, so it cannot be kept as text; remove the control-token text from it")
        spans.append((i, i + len(c)))
        cursor = i + len(c)
    if not spans:
        return hf_encode(tokenizer, text, add_special_tokens=False)
    ids: list[int] = []
    pos = 0
    for a, b in spans:
        if a > pos:
            ids += hf_encode(tokenizer, text[pos:a], add_special_tokens=False)
        ids += hf_encode_text_only(tokenizer, text[a:b])
        pos = b
    if pos < len(text):
        ids += hf_encode(tokenizer, text[pos:], add_special_tokens=False)
    return ids
