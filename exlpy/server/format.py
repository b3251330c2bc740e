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
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self.entries: list[lp.TokenLogprob] = []
        self.cumulative_logprob = 0.0
        # Text pieces and token-id tensors as they came: joined or turned into ints only when asked for (the
        # final response, logprobs), not once per token on the event loop.
        self._texts: list[str] = []
        self._ids: list[Any] = []

    @property
    def text(self) -> str:
        if len(self._texts) > 1:
            self._texts = ["".join(self._texts)]
        return self._texts[0] if self._texts else ""

    @property
    def tokens(self) -> list[int]:
        return [t for ids in self._ids for t in ids[0].tolist()]

    def add(self, r: dict[str, Any]) -> tuple[str, list[lp.TokenLogprob]]:
        """(text, logprob entries) of one streaming result."""
        text = r.get("text", "")
        if text:
            self._texts.append(text)
        ids = r["token_ids"]  # (1, n): indexed only when the ints are needed (a tensor index per token costs)
        n = ids.shape[-1]
        entries: list[lp.TokenLogprob] = []
        if n and ("logits" in r or "token_probs" in r):
            id_list = ids[0].tolist()
            if "logits" in r:
                entries = lp.from_logits(r["logits"][0], id_list, len(self.pieces), self.top or 0)
                self.cumulative_logprob += sum(e.logprob for e in entries)
            else:
                probs = r["token_probs"][0].tolist()
                alts = list(zip(r["top_k_tokens"][0].tolist(), r["top_k_probs"][0].tolist())) \
                    if "top_k_tokens" in r else [([], [])] * n
                entries = lp.from_probs(id_list, probs, alts, self.top or 0)
        if r["eos"]:
            if r.get("eos_reason") == "stop_token" and n:
                ids, entries = ids[:, :-1], entries[:-1]  # the stop token is not part of the completion
            self.finish_reason = FINISH.get(r.get("eos_reason", ""), "stop")
            self.completion_tokens = int(r.get("new_tokens", 0))
        if n:
            self._ids.append(ids)
            self.entries += entries
        return text, entries if self.top is not None else []
