"""Logprobs in OpenAI's and vLLM's shapes.

By default a logprob is the model's own log-softmax over the tokenizer's vocabulary, before temperature,
penalties and truncation (what evaluation harnesses need: lm-eval compares a token's logprob with the best
alternative's to decide whether it is the greedy choice). `logprobs_mode: "processed_logprobs"` gives the
distribution the token was drawn from instead (exllamav2's `return_probs`).

Prompt tokens are scored by one forward pass over the whole prompt (`score_prompt`); the first token has no
logprob (None), as in OpenAI's `echo` and vLLM's `prompt_logprobs`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

NO_PROB = -9999.0  # stands for log(0): JSON has no -inf


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # alternatives, most likely first
    rank: int = 1


def _finite(x: float) -> float:
    return x if math.isfinite(x) else NO_PROB


def from_logits(rows: torch.Tensor, tokens: list[int], vocab: int, top: int) -> list[TokenLogprob]:
    """Logprobs of `tokens` under rows [N, V] of logits (the model's raw distribution)."""
    lsm = torch.log_softmax(rows[:, :vocab].float(), dim=-1)
    ids = torch.tensor(tokens, dtype=torch.long).view(-1, 1)
    chosen = lsm.gather(1, ids).view(-1)
    ranks = (lsm > chosen.view(-1, 1)).sum(-1) + 1
    tops_v, tops_i = lsm.topk(top, dim=-1) if top else (None, None)
    out = []
    for k, t in enumerate(tokens):
        alts = list(zip(tops_i[k].tolist(), tops_v[k].tolist())) if tops_i is not None else []
        out.append(TokenLogprob(t, _finite(float(chosen[k])), [(a, _finite(v)) for a, v in alts], int(ranks[k])))
    return out


def from_probs(tokens: list[int], probs: list[float], alts: list[tuple[list[int], list[float]]],
               top: int) -> list[TokenLogprob]:
    """Processed logprobs from the sampler's final probabilities (alternatives with p = 0 are left out)."""
    out = []
    for t, p, (ai, ap) in zip(tokens, probs, alts):
        lp = math.log(p) if p > 0 else NO_PROB
        pairs = [(a, math.log(q)) for a, q in zip(ai, ap) if q > 0][:top]
        out.append(TokenLogprob(t, lp, pairs))
    return out


def score_prompt(model: Any, ids: torch.Tensor, vocab: int, top: int, loras: list[Any] | None = None
                 ) -> list[TokenLogprob]:
    """Logprob of every prompt token after the first, from one forward pass (no cache), with the request's
    LoRA adapters if any."""
    if ids.shape[-1] < 2:
        return []
    logits = model.forward(ids.view(1, -1), loras=loras or None)[0, :-1]
    return from_logits(logits.float().cpu(), ids.view(-1)[1:].tolist(), vocab, top)


def piece(pieces: list[str], tid: int) -> str:
    return pieces[tid] if 0 <= tid < len(pieces) else ""


def legacy(entries: list[TokenLogprob | None], pieces: list[str], tokens: list[int], offset: int,
           top: int) -> dict[str, Any]:
    """Completions' logprobs object for `tokens` (entries[i] None: no logprob, e.g. the first prompt token)."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, e in zip(tokens, entries):
        text = piece(pieces, t)
        out["tokens"].append(text)
        out["token_logprobs"].append(None if e is None else e.logprob)
        out["top_logprobs"].append(None if e is None else {piece(pieces, a): v for a, v in e.top[:top]})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def chat(entries: list[TokenLogprob], pieces: list[str], top: int) -> list[dict[str, Any]]:
    """Chat's `logprobs.content` entries."""
    out = []
    for e in entries:
        text = piece(pieces, e.token)
        out.append({"token": text, "logprob": e.logprob, "bytes": list(text.encode()),
                    "top_logprobs": [{"token": piece(pieces, a), "logprob": v, "bytes": list(piece(pieces, a).encode())}
                                     for a, v in e.top[:top]]})
    return out


def vllm_prompt(entries: list[TokenLogprob], pieces: list[str], top: int) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: None for the first token, then {token id: {logprob, rank, decoded_token}} with
    the prompt's own token and the top alternatives."""
    out: list[dict[str, Any] | None] = [None]
    for e in entries:
        d: dict[str, Any] = {}
        for rank, (a, v) in enumerate(e.top[:top], start=1):
            d[str(a)] = {"logprob": v, "rank": rank, "decoded_token": piece(pieces, a)}
        d.setdefault(str(e.token), {"logprob": e.logprob, "rank": e.rank, "decoded_token": piece(pieces, e.token)})
        out.append(d)
    return out
