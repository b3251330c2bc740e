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


# ----------------------------------------------------------------------------------------------- exllamav2's names
# `exllamav2.generator.ngram` (under the compatibility switch, this module) holds exllamav2's n-gram table,
# `NgramCache`, which its streaming generator drafts from and which scripts reach for directly. exlpy's generators
# draft with `NgramIndex`; these two classes keep exllamav2's interface and counting rules for those scripts.


class NgramCacheNode:
    """The continuations seen after one n-gram, with their counts (exllamav2's `NgramCacheNode`)."""

    def __init__(self, preload: NgramCacheNode | None = None) -> None:
        # A node first met in a cache with a preloaded table starts from the preloaded counts.
        self.transitions: dict[int, int] = dict(preload.transitions) if preload is not None else {}

    def add_transition(self, next_value: int) -> None:
        self.transitions[next_value] = self.transitions.get(next_value, 0) + 1

    def predict(self, threshold: int) -> int | None:
        """The most frequent continuation, or None when there is none or it was seen fewer than `threshold`
        times."""
        if not self.transitions:
            return None
        best = max(self.transitions, key=self.transitions.__getitem__)
        return best if self.transitions[best] >= threshold else None


class NgramCache:
    """exllamav2's `NgramCache(min_len, max_len, preload)`: n-grams of `min_len`..`max_len - 1` tokens -> the
    tokens that followed them; `preload` is another NgramCache (e.g. of a preloaded text) or None."""

    def __init__(self, min_len: int, max_len: int, preload: NgramCache | None) -> None:
        self.ngrams: dict[tuple[int, ...], NgramCacheNode] = {}
        self.min_len, self.max_len, self.preload = min_len, max_len, preload

    def update(self, sequence: Sequence[int]) -> None:
        """Count the n-grams of a sequence: every window of up to `max_len` tokens ending before position i,
        for i from min_len + 1 to len - 1, as exllamav2 walks them."""
        for i in range(1 + self.min_len, len(sequence)):
            self.update_single(sequence[max(i - self.max_len, 0):i])

    def update_single(self, sequence: Sequence[int]) -> None:
        """Count the last token of `sequence` as the continuation of each suffix (of `min_len` tokens or more) of
        the tokens before it."""
        new, old = sequence[-1], sequence[:-1]
        for i in range(len(old) - self.min_len + 1):
            key = tuple(old[i:])
            node = self.ngrams.get(key)
            if node is None:
                base = self.preload.ngrams.get(key) if self.preload is not None else None
                node = self.ngrams[key] = NgramCacheNode(base)
            node.add_transition(new)

    def predict_next(self, context: Sequence[int], threshold: int, preload: NgramCache | None) -> int | None:
        """The continuation of the longest suffix of `context` (at least `min_len` tokens) that has one seen
        `threshold` times or more, in this cache or else in `preload`; None when none has."""
        for i in range(len(context) - self.min_len + 1):
            key = tuple(context[i:])
            node = self.ngrams.get(key)
            if node is None and preload is not None:
                node = preload.ngrams.get(key)
            if node is not None:
                found = node.predict(threshold)
                if found is not None:
                    return found
        return None
