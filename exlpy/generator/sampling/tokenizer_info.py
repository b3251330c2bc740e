"""What the sampler needs from a tokenizer, read by duck typing and cached per tokenizer.

The sampler accepts any object with (some of) exllamav2's tokenizer API: `get_id_to_piece_list(bool)`,
`extended_id_to_piece`, `eos_token_id`, `actual_vocab_size` / `get_vocab_size()`, `config.vocab_size`,
`get_tokens_with_prefix_id(id)`. Token sets derived from the piece list (DRY breakers, XTC ignore tokens,
token-healing candidates) are built once per tokenizer and device.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from exlpy.errors import SamplerError

DRY_BREAKER_CHARS = '.,!?<>[](){}\n\t"'
XTC_IGNORE_CHARS = "\n"

_cache: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()


def _store(tokenizer: Any) -> dict[Any, Any]:
    try:
        return _cache.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: no caching, still correct
        return {}


def vocab_size(tokenizer: Any) -> int | None:
    """Number of ids the tokenizer can produce (largest of what it reports), or None if it reports nothing."""
    sizes: list[int] = []
    if getattr(tokenizer, "actual_vocab_size", None) is not None:
        sizes.append(int(tokenizer.actual_vocab_size))
    if hasattr(tokenizer, "get_vocab_size"):
        sizes.append(int(tokenizer.get_vocab_size()))
    if not sizes and hasattr(tokenizer, "get_id_to_piece_list"):
        sizes.append(len(tokenizer.get_id_to_piece_list(True)))
    return max(sizes) if sizes else None


def token_bias_size(tokenizer: Any) -> int:
    """Length of a fresh token_bias: the model vocab (config.vocab_size) padded up to a multiple of 32."""
    config = getattr(tokenizer, "config", None)
    n = getattr(config, "vocab_size", None) if config is not None else None
    if n is None:
        n = vocab_size(tokenizer) if tokenizer is not None else None
    if n is None:
        raise SamplerError("token_bias helpers need a tokenizer that reports its vocab size")
    return int(n) + (-int(n) % 32)


def special_ids(tokenizer: Any) -> set[int]:
    ids = set(getattr(tokenizer, "extended_id_to_piece", {}) or {})
    ids |= set((getattr(tokenizer, "extended_piece_to_id", {}) or {}).values())
    for name in ("eos_token_id", "bos_token_id"):
        v = getattr(tokenizer, name, None)
        if isinstance(v, int) and v >= 0:
            ids.add(v)
    return ids


def _ids_with_chars(tokenizer: Any, chars: str) -> set[int]:
    pieces = tokenizer.get_id_to_piece_list(True) if hasattr(tokenizer, "get_id_to_piece_list") else []
    found = {i for i, p in enumerate(pieces) if p is not None and any(c in p for c in chars)}
    return found | special_ids(tokenizer)


def default_dry_breakers(tokenizer: Any) -> set[int]:
    """Tokens whose piece contains any of .,!?<>[](){}\\n\\t\" plus all special tokens (spec §8.3)."""
    store = _store(tokenizer)
    if "dry" not in store:
        store["dry"] = _ids_with_chars(tokenizer, DRY_BREAKER_CHARS)
    return store["dry"]


def default_xtc_ignore(tokenizer: Any) -> set[int]:
    """Tokens whose piece contains a newline plus all special tokens (spec §8.3)."""
    store = _store(tokenizer)
    if "xtc" not in store:
        store["xtc"] = _ids_with_chars(tokenizer, XTC_IGNORE_CHARS)
    return store["xtc"]


def id_mask(ids: set[int] | frozenset[int] | list[int], size: int, device: torch.device) -> torch.Tensor:
    """Bool [size] with True at `ids` (ids outside [0, size) are ignored)."""
    mask = torch.zeros(size, dtype=torch.bool)
    sel = [i for i in ids if 0 <= i < size]
    if sel:
        mask[torch.tensor(sel, dtype=torch.long)] = True
    return mask.to(device, non_blocking=True)


def cached_id_mask(tokenizer: Any, key: str, ids: set[int], size: int, device: torch.device) -> torch.Tensor:
    """`id_mask` of a tokenizer-derived set, cached per (tokenizer, key, size, device)."""
    store = _store(tokenizer)
    k = (key, size, str(device))
    if k not in store:
        store[k] = id_mask(ids, size, device)
    return store[k]


def healing_ids(tokenizer: Any, prefix_id: int) -> list[int]:
    """Ids whose piece starts with the piece of `prefix_id` (token healing candidates)."""
    if tokenizer is None:
        raise SamplerError("prefix_token (token healing) needs a tokenizer")
    store = _store(tokenizer)
    k = ("heal", prefix_id)
    if k not in store:
        if hasattr(tokenizer, "get_tokens_with_prefix_id"):
            ids = list(tokenizer.get_tokens_with_prefix_id(prefix_id))
        elif hasattr(tokenizer, "get_id_to_piece_list"):
            pieces = tokenizer.get_id_to_piece_list(False)
            if not 0 <= prefix_id < len(pieces):
                raise SamplerError(f"prefix_token {prefix_id} is outside the tokenizer's vocab "
                                   f"({len(pieces)})")
            pre = pieces[prefix_id]
            ids = [i for i, p in enumerate(pieces) if p is not None and p.startswith(pre)]
        else:
            raise SamplerError("prefix_token (token healing) needs a tokenizer with "
                               "get_tokens_with_prefix_id()")
        store[k] = ids
    return store[k]
