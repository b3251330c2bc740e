"""Argument checks for speculative decoding: every mistake is a DraftModelError that names what is wrong."""

from __future__ import annotations

from typing import Any

from exlpy.errors import DraftModelError


def vocab_of(tokenizer: Any) -> int:
    return len(tokenizer.get_id_to_piece_list(True))


def check_draft(model: Any, cache: Any, tokenizer: Any, draft_model: Any, draft_cache: Any,
                num_draft_tokens: int | None, use_ngram_draft: bool, max_q_size: int, paged: bool) -> None:
    if num_draft_tokens is not None and (isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int)
                                         or not 1 <= num_draft_tokens <= max_q_size - 1):
        raise DraftModelError(f"num_draft_tokens must be an int from 1 to {max_q_size - 1} (max_q_size - 1: a "
                              f"verification step takes the drafts plus one token), got {num_draft_tokens!r}")
    if draft_model is None and draft_cache is None:
        return
    if use_ngram_draft:
        raise DraftModelError("use_ngram_draft and draft_model are alternatives: pass one of them")
    if draft_model is None:
        raise DraftModelError("draft_cache was given without draft_model")
    if draft_cache is None:
        raise DraftModelError("draft_model needs a draft_cache: ExLlamaV2Cache(draft_model, ...) sized like the "
                              "main cache")
    if not getattr(draft_model, "loaded", False):
        raise DraftModelError("the draft model is not loaded: call draft_model.load() or "
                              "draft_model.load_autosplit(draft_cache) first")
    tv, dv, kv = int(model.config.vocab_size), int(draft_model.config.vocab_size), vocab_of(tokenizer)
    if dv < kv or tv < kv or (dv != tv and max(dv, tv) - kv > 1024):
        raise DraftModelError(f"the draft model's vocabulary ({dv} tokens, {draft_model.config.model_dir}) does not "
                              f"match the target's ({tv} tokens; the tokenizer has {kv}): drafts would be other "
                              "tokens")
    layout = getattr(draft_cache, "layout", None)
    if layout is not None and getattr(layout, "devices", None) is not getattr(draft_model, "layer_devices", None):
        raise DraftModelError("draft_cache was not built for draft_model: create it with "
                              "ExLlamaV2Cache(draft_model, ...)")
    if paged:
        if draft_cache.batch_size != 1 or draft_cache.max_seq_len != cache.max_seq_len:
            raise DraftModelError(f"draft_cache must match the main cache (batch_size 1, max_seq_len "
                                  f"{cache.max_seq_len}), got batch_size {draft_cache.batch_size}, max_seq_len "
                                  f"{draft_cache.max_seq_len}")
    elif draft_cache.batch_size < 1 or draft_cache.max_seq_len < cache.max_seq_len:
        raise DraftModelError(f"draft_cache must hold at least the main cache's {cache.max_seq_len} positions, got "
                              f"max_seq_len {draft_cache.max_seq_len}")
