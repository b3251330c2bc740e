"""Repetitive decoding workloads for n-gram drafting on random-weight models (benchmarks/speculative.py, part
`ngram8b`).

Random weights copy nothing, so a model's text is scripted instead: `Script` adds a large logit to the script's
next token at every position the target computes logits for (decode steps, verification steps of k+1 tokens,
the prompt's last token), on the device, after the real forward pass. The target's greedy text is then the
script, whatever was fed, and a draft is accepted exactly when it equals the script's token: the n-gram drafter
meets a real repetitive text and every cost (forward passes of every shape, verification, the host's n-gram
lookups and rounds) is the real one. Plain decoding runs under the same script (one small upload and one
scatter per forward pass in both).

Texts come from this repository (the device machine has no other data): words and punctuation of a source file
or of the README mapped to token ids by a fixed hash, so equal words are equal tokens, as a tokenizer makes them:

- code edit: a source file, then the same file with three identifiers renamed (the answer quotes the input);
- summary quoting: the README, then a summary that quotes every third sentence after a few words of its own;
- shuffled: the input's words in random order: every token was seen, so n-grams match and then mostly fail
  (the low-acceptance case, where drafting must not cost more than it saves).
"""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
BIG = 1000.0  # added to the script's token: far above a random model's logits, within fp16


def words(text: str) -> list[str]:
    return re.findall(r"\w+|[^\w\s]", text)


def word_ids(items: list[str], vocab: int) -> list[int]:
    return [3 + zlib.crc32(w.encode()) % (vocab - 3) for w in items]


def workloads(vocab: int, prompt_words: int = 1200, answer_words: int = 512) -> dict[str, tuple[list[int], list[int]]]:
    """{name: (prompt ids, answer ids)} of the three workloads."""
    code = words((ROOT / "exlpy" / "generator" / "speculative" / "dynamic.py").read_text())[:prompt_words]
    renames = {"spec_rows": "drafted_rows", "rows": "batch_rows", "k": "draft_len"}
    edited = [renames.get(w, w) for w in code]
    readme = words((ROOT / "README.md").read_text())[:prompt_words]
    sentences: list[list[str]] = [[]]
    for w in readme:
        sentences[-1].append(w)
        if w in (".", ":"):
            sentences.append([])
    summary: list[str] = []
    for i, s in enumerate(sentences[::3]):
        summary += ["In", "short", f"point{i}", ","] + s
    shuffled = readme[:]
    random.Random(0).shuffle(shuffled)
    instruction = words("Rewrite the text below as asked . Text :")
    out = {}
    for name, prompt, answer in (("code edit", code, edited), ("summary quoting", readme, summary),
                                 ("shuffled (low acceptance)", readme, shuffled)):
        out[name] = (word_ids(instruction + prompt, vocab), word_ids(answer[:answer_words], vocab))
    return out


class Script:
    """Makes `model`'s greedy text `prompt + answer` (see the module docstring) while `active()`."""

    def __init__(self, model: Any, prompt: list[int], answer: list[int]) -> None:
        self.model, self.full, self.prompt_len = model, prompt + answer, len(prompt)

    def _forward_batch(self, original: Any, ids: torch.Tensor, batch: Any, last_id_only: bool = False,
                       preprocess_only: bool = False) -> Any:
        out = original(ids, batch, last_id_only=last_id_only, preprocess_only=preprocess_only)
        if out is None or preprocess_only or batch.host is None:
            return out
        starts, q, T = batch.host[0], ids.shape[1], out.shape[1]
        rows, cols, toks = [], [], []
        for b, s in enumerate(starts):
            first = s + q - T  # the position of logits column 0 (all positions, or the last one only)
            for t in range(T):
                p = first + t + 1  # the position whose token these logits predict
                if self.prompt_len <= p < len(self.full):
                    rows.append(b)
                    cols.append(t)
                    toks.append(self.full[p])
        if rows:
            idx = torch.tensor([rows, cols, toks], dtype=torch.long)
            if out.device.type == "cuda":
                idx = idx.pin_memory()
            idx = idx.to(out.device, non_blocking=True)
            out.index_put_((idx[0], idx[1], idx[2]), torch.full((), BIG, dtype=out.dtype, device=out.device),
                           accumulate=True)
        return out

    @contextmanager
    def active(self) -> Iterator[None]:
        had = "forward_batch" in vars(self.model)
        original = self.model.forward_batch
        self.model.forward_batch = lambda *a, **kw: self._forward_batch(original, *a, **kw)
        try:
            yield
        finally:
            if had:
                self.model.forward_batch = original
            else:
                del self.model.forward_batch  # the class's method again
