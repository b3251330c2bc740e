"""Reading one job's streaming results: text, per-token logprobs, finish_reason, token counts.

`add()` returns what each result adds (text and logprob entries) so streams can forward it at once; the
reader keeps the totals for the final response and for best_of ranking (`cumulative_logprob`).
"""

from __future__ import annotations

from typing import Any

from exlpy.server import logprobs as lp

FINISH = {"stop_token": "stop", "stop_string": "stop", "end_filter": "stop", "max_new_tokens": "length"}


class ResultReader:
    def __init__(self, pieces: list[str], top_logprobs: int | None, raw: bool) -> None:
        self.pieces = pieces
        self.top = top_logprobs
        self.raw = raw
        self.text = ""
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self.tokens: list[int] = []
        self.entries: list[lp.TokenLogprob] = []
        self.cumulative_logprob = 0.0

    def add(self, r: dict[str, Any]) -> tuple[str, list[lp.TokenLogprob]]:
        """(text, logprob entries) of one streaming result."""
        text = r.get("text", "")
        self.text += text
        ids = r["token_ids"][0].tolist()
        entries: list[lp.TokenLogprob] = []
        if "logits" in r and ids:
            entries = lp.from_logits(r["logits"][0], ids, len(self.pieces), self.top or 0)
            self.cumulative_logprob += sum(e.logprob for e in entries)
        elif "token_probs" in r and ids:
            probs = r["token_probs"][0].tolist()
            alts = list(zip(r["top_k_tokens"][0].tolist(), r["top_k_probs"][0].tolist())) \
                if "top_k_tokens" in r else [([], [])] * len(ids)
            entries = lp.from_probs(ids, probs, alts, self.top or 0)
        if r["eos"] and r.get("eos_reason") == "stop_token" and ids:
            ids, entries = ids[:-1], entries[:-1]  # the stop token is not part of the completion
        self.tokens += ids
        self.entries += entries
        if r["eos"]:
            self.finish_reason = FINISH.get(r.get("eos_reason", ""), "stop")
            self.completion_tokens = int(r.get("new_tokens", 0))
        return text, entries if self.top is not None else []
