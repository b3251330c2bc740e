"""vLLM's tokenizer endpoints: /tokenize (a prompt, or chat messages through the model's template),
/detokenize and /tokenizer_info. Prompts are tokenized exactly as /v1/completions and /v1/chat/completions
tokenize them, so `count` is what a request would use."""

from __future__ import annotations

from typing import Any

from exlpy.errors import GeneratorError
from exlpy.server.params import bad, vocab_size
from exlpy.server.schemas import ChatCompletionRequest, TokenizeRequest
from exlpy.tokenizer.hf_compat import hf_encode


def tokenize_ids(req: TokenizeRequest, tokenizer: Any) -> list[int]:
    if (req.prompt is None) == (req.messages is None):
        raise bad(GeneratorError, "prompt", "give either prompt or messages")
    if req.prompt is not None:
        add = True if req.add_special_tokens is None else req.add_special_tokens
        return hf_encode(tokenizer, req.prompt, add_special_tokens=add)
    from exlpy.server.plans import chat_prompt, template_source
    from exlpy.server.tools import plan_tools

    chat = ChatCompletionRequest(messages=req.messages or [], tools=req.tools,
                                 add_generation_prompt=req.add_generation_prompt,
                                 continue_final_message=req.continue_final_message,
                                 chat_template_kwargs=req.chat_template_kwargs)
    ids = chat_prompt(chat, tokenizer, plan_tools(chat, template_source(tokenizer))).view(-1).tolist()
    if req.add_special_tokens and tokenizer.bos_token_id is not None and (not ids or ids[0] != tokenizer.bos_token_id):
        ids = [tokenizer.bos_token_id, *ids]
    return ids


def detokenize_text(tokens: list[int], tokenizer: Any) -> str:
    vocab = vocab_size(tokenizer)
    for t in tokens:
        if not 0 <= t < vocab:
            raise bad(GeneratorError, "tokens", f"token id {t} is outside the vocabulary [0, {vocab})")
    if not tokens:
        return ""
    out = tokenizer.decode(tokens, decode_special_tokens=True)
    return out[0] if isinstance(out, list) else out


def tokenizer_info(tokenizer: Any, max_seq_len: int) -> dict[str, Any]:
    cfg = getattr(tokenizer, "tokenizer_config", {}) or {}
    raw = cfg.get("chat_template")
    return {"tokenizer_class": cfg.get("tokenizer_class", "PreTrainedTokenizerFast"),
            "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token,
            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "chat_template": raw if isinstance(raw, str) else None, "model_max_length": max_seq_len,
            "vocab_size": vocab_size(tokenizer)}
