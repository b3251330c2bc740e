"""From the generator's streaming results to OpenAI fields: text, logprobs, finish_reason, usage.

Logprobs come from the job's `return_probs` / `return_top_tokens`: they are the probabilities of the
distribution the token was drawn from (after temperature, penalties, logit_bias and top-k/top-p/min-p
truncation), as exllamav2 reports them. With temperature 0 the chosen token has logprob 0 and there are no
alternatives; alternatives with probability 0 are left out.
"""

from __future__ import annotations

import math
from typing import Any

from exlpy.server.schemas import Usage

FINISH = {"stop_token": "stop", "stop_string": "stop", "end_filter": "stop", "max_new_tokens": "length"}


class ResultReader:
    """Reads one job's results in order; `add()` returns what each result adds to the completion."""

    def __init__(self, pieces: list[str], top_logprobs: int | None, chat: bool, prompt_tokens: int) -> None:
        self.pieces = pieces
        self.top = top_logprobs
        self.chat = chat
        self.prompt_tokens = prompt_tokens
        self.text = ""
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self.offset = 0  # characters of completion so far (legacy text_offset)
        self.logprobs = self._empty_logprobs() if top_logprobs is not None else None

    def _empty_logprobs(self) -> dict[str, Any]:
        if self.chat:
            return {"content": []}
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add(self, r: dict[str, Any]) -> tuple[str, dict[str, Any] | None]:
        """(text, logprobs fragment or None) of one streaming result."""
        text = r.get("text", "")
        self.text += text
        frag = self._logprobs(r) if self.top is not None else None
        if frag is not None and self.logprobs is not None:
            for k, v in frag.items():
                self.logprobs[k].extend(v)
        if r["eos"]:
            self.finish_reason = FINISH.get(r.get("eos_reason", ""), "stop")
            self.completion_tokens = int(r.get("new_tokens", 0))
        return text, frag

    def usage(self) -> Usage:
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                     total_tokens=self.prompt_tokens + self.completion_tokens)

    def _piece(self, tid: int) -> str:
        return self.pieces[tid] if 0 <= tid < len(self.pieces) else ""

    def _logprobs(self, r: dict[str, Any]) -> dict[str, Any]:
        ids = r["token_ids"][0].tolist()
        probs = r["token_probs"][0].tolist() if "token_probs" in r else [1.0] * len(ids)
        tops = list(zip(r["top_k_tokens"][0].tolist(), r["top_k_probs"][0].tolist())) \
            if self.top and "top_k_tokens" in r else [([], [])] * len(ids)
        if r["eos"] and r.get("eos_reason") == "stop_token" and ids:
            ids, probs, tops = ids[:-1], probs[:-1], tops[:-1]  # the stop token is not part of the completion
        frag = self._empty_logprobs()
        for tid, p, (alt_ids, alt_probs) in zip(ids, probs, tops):
            piece = self._piece(tid)
            lp = math.log(p) if p > 0 else -9999.0
            alts = [(self._piece(a), math.log(q)) for a, q in zip(alt_ids, alt_probs) if q > 0]
            if self.chat:
                frag["content"].append({"token": piece, "logprob": lp, "bytes": list(piece.encode()),
                                        "top_logprobs": [{"token": a, "logprob": q, "bytes": list(a.encode())}
                                                         for a, q in alts]})
            else:
                frag["tokens"].append(piece)
                frag["token_logprobs"].append(lp)
                frag["top_logprobs"].append(dict(alts) if self.top else None)
                frag["text_offset"].append(self.offset)
                self.offset += len(piece)
        return frag
