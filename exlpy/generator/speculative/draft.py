"""A draft model for the dynamic generator: it proposes tokens by its own greedy decoding, batched over jobs.

The draft keeps K/V in its own paged cache, at the same pages as the target (one block table serves both), so
whatever the page table does (prefix sharing, preemption, copying a partial page) holds for both. It is
prefilled with every prompt chunk the target runs, and `SeqState.draft_kv` says how many positions of a
sequence its cache holds. A round feeds the sequence's last two tokens (the second may be new since the
last round), then its own argmax k-1 times; every step stays on the device (CUDA graphs where they apply).
After verification only the accepted drafts remain valid in the draft cache.

The draft model may use any format and sit on another GPU: its batches are built for its own first device and
the drafts are copied to the target's.
"""

from __future__ import annotations

from typing import Any

import torch

from exlpy.model.batch import paged_batch


def weight_bytes(model: Any) -> int:
    return sum(m.weight_bytes() for m in model.modules[1:] if hasattr(m, "weight_bytes"))


class ModelDrafter:
    def __init__(self, model: Any, cache: Any, page_size: int, vocab: int) -> None:
        self.model, self.cache, self.page_size, self.vocab = model, cache, page_size, vocab

    def device(self) -> torch.device:
        return self.model.strategy_for_forward().first_device

    def cost(self, target: Any) -> float:
        """A draft step's cost relative to a target step (weight bytes, plus a launch overhead)."""
        try:
            return min(1.0, weight_bytes(self.model) / max(weight_bytes(target), 1) + 0.03)
        except Exception:
            return 0.2

    def prefill(self, q: Any, start: int, end: int) -> None:
        """Run the draft over positions [start, end) of a sequence (the target's prefill chunk, or catching up)."""
        if end <= start:
            return
        batch = paged_batch([(q.page_ids(), start, end - start)], self.cache, self.device(), self.page_size)
        self.model.forward_batch(q.ids[start:end].unsqueeze(0), batch, preprocess_only=True)
        q.draft_kv = end

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return logits[:, -1, :self.vocab].argmax(-1)

    def propose(self, seqs: list[Any], k: int, target_device: torch.device) -> torch.Tensor:
        """Drafts [len(seqs), k] (long, on `target_device`) continuing each sequence's ids."""
        dev = self.device()
        for q in seqs:  # rows whose draft cache fell behind (e.g. steps without speculation) catch up first
            length = q.ids.numel()
            q.draft_kv = min(q.draft_kv, length - 1)
            if q.draft_kv < length - 2:
                self.prefill(q, q.draft_kv, length - 2)
        out: list[torch.Tensor | None] = [None] * len(seqs)
        # First step: the last two tokens (one for a one-token sequence), at their positions.
        for n in (2, 1):
            idx = [i for i, q in enumerate(seqs) if min(q.ids.numel(), 2) == n]
            if not idx:
                continue
            ids = torch.stack([seqs[i].ids[-n:] for i in idx])
            batch = paged_batch([(seqs[i].page_ids(), seqs[i].ids.numel() - n, n) for i in idx], self.cache, dev,
                                self.page_size)
            first = self._argmax(self.model.forward_batch(ids, batch, last_id_only=True))
            for j, i in enumerate(idx):
                out[i] = first[j:j + 1]
        cur = torch.cat([t for t in out if t is not None])
        drafts = [cur]
        for step in range(1, k):
            batch = paged_batch([(q.page_ids(), q.ids.numel() - 1 + step, 1) for q in seqs], self.cache, dev,
                                self.page_size)
            cur = self._argmax(self.model.forward_batch(cur.view(-1, 1), batch, last_id_only=True))
            drafts.append(cur)
        for q in seqs:
            q.draft_kv = q.ids.numel() - 1 + k  # provisional: `accepted()` trims it to what verification kept
        return torch.stack(drafts, dim=1).to(target_device, non_blocking=True)

    @staticmethod
    def accepted(q: Any, length_before: int, m: int, k: int) -> None:
        """After verification of a sequence that had `length_before` tokens: drafts d_1..d_m were kept."""
        q.draft_kv = length_before + min(m, k - 1)
