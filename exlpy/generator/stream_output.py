"""What a streaming-generator step returns: exllamav2's `stream_ex()` dict, and unpadding of a prompt batch."""

from __future__ import annotations

from typing import Any

import torch

from exlpy.errors import GeneratorError
from exlpy.generator.dynamic.stops import Released


def stream_result(rel: Released, probs: bool, top_tokens: int, logits: bool, vocab: int) -> dict[str, Any]:
    """{"chunk", "eos", "chunk_token_ids"} (+ "eos_reason", "probs", "top_tokens"/"top_probs", "logits")."""
    r: dict[str, Any] = {"chunk": rel.text, "eos": rel.eos,
                         "chunk_token_ids": torch.tensor([rel.tokens], dtype=torch.long).view(1, -1)}
    if rel.eos:
        r["eos_reason"] = rel.eos_reason
    if probs:
        r["probs"] = torch.tensor([[p["prob"] for p in rel.payloads]]).view(1, -1)
    if top_tokens:
        k = top_tokens
        r["top_tokens"] = (torch.stack([p["top_tokens"] for p in rel.payloads]).unsqueeze(0) if rel.payloads
                           else torch.empty(1, 0, k, dtype=torch.long))
        r["top_probs"] = (torch.stack([p["top_probs"] for p in rel.payloads]).unsqueeze(0) if rel.payloads
                          else torch.empty(1, 0, k))
    if logits:
        r["logits"] = (torch.stack([p["logits"] for p in rel.payloads]).unsqueeze(0) if rel.payloads
                       else torch.empty(1, 0, vocab))
    return r


def unpad_rows(ids: torch.Tensor, input_mask: torch.Tensor | None) -> list[torch.Tensor]:
    """The real tokens of each row of a (left-)padded batch; `input_mask` is bool (True = token) or additive
    (0 = token, -inf = padding), as from tokenizer.padding_mask()."""
    if input_mask is None:
        return [r for r in ids]
    m = input_mask.reshape(ids.shape[0], -1)[:, -ids.shape[1]:].cpu()
    keep = m if m.dtype == torch.bool else m > -1.0
    rows = [ids[b][keep[b]] for b in range(ids.shape[0])]
    if min(r.numel() for r in rows) < 1:
        raise GeneratorError("input_mask leaves a row without any token")
    return rows
