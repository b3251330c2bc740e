"""N-gram drafting: guess the next tokens from what followed the same few tokens earlier in the context.

Each sequence keeps counts of (n-gram -> next token) for n = 1..max_ngram over its own tokens; a shared index
holds preloaded text (`ngram_preload`). A draft extends the context one token at a time with the most frequent
continuation of the longest suffix that occurred before (at least `threshold` times), the sequence's own index
first, then the preloaded one. It costs only dictionary lookups on the host; when nothing matches there is no
draft and the generator decodes normally.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, threshold: int = 1,
                 base: NgramIndex | None = None) -> None:
        self.max_ngram, self.min_ngram, self.threshold = max_ngram, min_ngram, threshold
        self.base = base
        self.counts: dict[tuple[int, ...], dict[int, int]] = {}
        self.tokens: list[int] = []

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the indexed sequence, counting every n-gram that ends at each of them."""
        for t in tokens:
            t = int(t)
            seq = self.tokens
            for n in range(self.min_ngram, self.max_ngram + 1):
                if len(seq) < n:
                    break
                nxt = self.counts.setdefault(tuple(seq[-n:]), {})
                nxt[t] = nxt.get(t, 0) + 1
            seq.append(t)

    def truncate(self, length: int) -> None:
        """Forget the tokens past `length` (a rewind); their n-grams are rebuilt from what remains."""
        if length >= len(self.tokens):
            return
        keep = self.tokens[:length]
        self.counts, self.tokens = {}, []
        self.extend(keep)

    def _next(self, tail: list[int]) -> int | None:
        for n in range(min(self.max_ngram, len(tail)), self.min_ngram - 1, -1):
            for index in (self, self.base):
                nxt = index.counts.get(tuple(tail[-n:])) if index is not None else None
                if nxt:
                    tok, count = max(nxt.items(), key=lambda kv: kv[1])
                    if count >= self.threshold:
                        return tok
        return None

    def propose(self, k: int) -> list[int]:
        """Up to k tokens continuing the indexed sequence (fewer, or none, when no n-gram matches)."""
        tail = self.tokens[-self.max_ngram:]
        out: list[int] = []
        while len(out) < k:
            t = self._next(tail)
            if t is None:
                break
            out.append(t)
            tail = (tail + [t])[-self.max_ngram:]
        return out
