"""Adapter slots of the embedding and the head: what adapters that replace or adapt `model.embed_tokens` /
`lm_head` need on the module's device (exlpy/lora/adapter.py reads them).

Like the blocks' buffers (buffers.py) everything is allocated once per registry generation and written in
place, and the per-row choice is made on the device from the batch's slot column, so CUDA graphs captured over
these buffers stay valid while adapters come and go:
  low-rank   a [S, 1, R, K] / b [S, N, R] / ranks [S] as for a block projection. The head adds
             B (A x) with the segmented kernels (ops.lora_shrink / lora_expand). The embedding's shrink is a
             lookup: a holds A transposed, [S, vocab, R], and a row's u is a[slot, id]; the expand is the same
             kernel as the head's;
  replaced   `tables` [T, vocab, hidden]: the replacement weights of the slots that have one, `table_of` [S] the
             table of each slot (-1: none). Every table is applied to the whole step and kept for the rows whose
             slot maps to it (torch.where): T extra head GEMMs or lookups per adapter step, no host decision.
             Tables are only as many as resident adapters with a replacement (the registry sizes them).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from exlpy.kernels import ops
from exlpy.model.batch import ForwardBatch

EMBED, HEAD = "model.embed_tokens", "lm_head"


class OuterLora:
    """Slot buffers of one Embedding or Head copy (attached as `module.lora` by the registry)."""

    def __init__(self, key: str, vocab: int, hidden: int, low_rank: bool, tables: int, slots: int, rank: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.key, self.vocab, self.hidden = key, vocab, hidden
        self.a: torch.Tensor | None = None
        self.b: torch.Tensor | None = None
        if low_rank:
            if key == HEAD:
                self.a = torch.zeros(slots, 1, rank, hidden, dtype=dtype, device=device)
                self.b = torch.zeros(slots, vocab, rank, dtype=dtype, device=device)
            else:
                self.a = torch.zeros(slots, vocab, rank, dtype=dtype, device=device)
                self.b = torch.zeros(slots, hidden, rank, dtype=dtype, device=device)
        self.ranks = torch.zeros(slots, dtype=torch.int32, device=device)
        self.tables = torch.zeros(tables, vocab, hidden, dtype=dtype, device=device) if tables else None
        self.table_of = torch.full((slots,), -1, dtype=torch.int64, device=device)
        self.owner: list[int | None] = [None] * tables  # the slot each table serves

    # --- writing ----------------------------------------------------------------------------------------------
    def write(self, slot: int, loras: tuple[Any, ...]) -> None:
        """Slot `slot` := the adapters' changes to this module (ranks concatenated, at most one replacement)."""
        self.clear(slot)
        parts = [lora.outer[self.key] for lora in loras if self.key in lora.outer]
        table = next((w.table for w in parts if w.table is not None), None)
        if table is not None:
            assert self.tables is not None, "the registry sizes the tables before writing"
            j = self.owner.index(None)
            self.owner[j] = slot
            self.tables[j].copy_(table)
            self.table_of[slot:slot + 1].fill_(j)
        if self.a is None or self.b is None:
            return
        R = self.b.shape[-1]
        a = torch.zeros(self.a.shape[1:])
        b = torch.zeros(self.b.shape[1:])
        r = 0
        for w in parts:
            if w.a is None or w.b is None:
                continue
            n = w.a.shape[0]
            assert r + n <= R, "the registry sizes the rank before writing"
            if self.key == HEAD:
                a[0, r:r + n] = w.a
            else:
                a[:, r:r + n] = w.a.t()
            b[:, r:r + n] = w.b
            r += n
        self.a[slot].copy_(a)
        self.b[slot].copy_(b)
        self.ranks[slot:slot + 1].fill_(r)

    def clear(self, slot: int) -> None:
        for j, s in enumerate(self.owner):
            if s == slot:
                self.owner[j] = None
        self.table_of[slot:slot + 1].fill_(-1)
        self.ranks[slot:slot + 1].zero_()
        if self.a is not None and self.b is not None:
            self.a[slot].zero_()
            self.b[slot].zero_()

    # --- forward hooks ----------------------------------------------------------------------------------------
    def _row_tables(self, batch: ForwardBatch, rows: int) -> torch.Tensor:
        """[rows] the replacement table of each row (-1: none)."""
        assert batch.adapters is not None
        slot = batch.adapters[:rows].to(self.table_of.device)
        return torch.where(slot >= 0, self.table_of[slot.clamp(min=0)], -1)

    def embed(self, ids: torch.Tensor, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """h = the base embedding of ids [B, T]; returns it with the adapters' rows replaced / adapted."""
        B, T = ids.shape
        if self.tables is not None:
            tbl = self._row_tables(batch, B).view(B, 1, 1)
            for j in range(self.tables.shape[0]):
                h = torch.where(tbl == j, F.embedding(ids, self.tables[j]), h)
        if self.a is not None and self.b is not None and batch.adapters is not None:
            slot = batch.adapters[:B].to(ids.device).view(B, 1).expand(B, T).clamp(min=0)
            u = self.a.view(-1, self.a.shape[-1])[(slot * self.vocab + ids).reshape(-1)].float()
            u = torch.cat([u, u.new_ones(u.shape[0], 1)], dim=1).unsqueeze(0)  # one split, scale column 1
            h = ops.lora_expand(h.contiguous(), u, self.b, self.ranks, batch.adapters, T)
        return h

    def logits(self, x: torch.Tensor, y: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """y = the base head's output for x [B, T, hidden]; returns it with the adapters' rows replaced /
        adapted (before the logit scale and soft-cap, which apply to every row)."""
        B, T = x.shape[0], x.shape[1]
        if self.tables is not None:
            tbl = self._row_tables(batch, B).view(B, 1, 1)
            for j in range(self.tables.shape[0]):
                y = torch.where(tbl == j, F.linear(x.to(self.tables.dtype), self.tables[j]).to(y.dtype), y)
        if self.a is not None and self.b is not None and batch.adapters is not None:
            u = ops.lora_shrink(x, self.a, self.ranks, batch.adapters, T)
            y = ops.lora_expand(y.contiguous(), u, self.b, self.ranks, batch.adapters, T)
        return y
