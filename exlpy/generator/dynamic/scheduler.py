"""What runs through the model in one iteration: prefill chunk planning (batches: exlpy.model.batch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from exlpy.generator.dynamic.pages import PAGE_SIZE

if TYPE_CHECKING:
    from exlpy.generator.dynamic.job import SeqState


def skip_cached_pages(seq: SeqState) -> int:
    """Advance the prefill position over leading pages whose K/V another job already computed; returns the
    number of tokens skipped."""
    target = seq.prefill_target
    pos = seq.prefill_pos
    start = pos
    while pos < target and pos % PAGE_SIZE == 0 and pos + PAGE_SIZE <= target and seq.pages[pos // PAGE_SIZE].complete:
        pos += PAGE_SIZE
    seq.prefill_pos = pos
    return pos - start


def plan_prefill(seq: SeqState, serial: int, max_chunk: int) -> tuple[int, int] | None:
    """Next prefill span (start, end) of one job sequence, after `skip_cached_pages`.

    A page that another running job is still filling is waited for: returns None, and the job tries again
    next iteration. An empty span means the sequence is prefilled.
    """
    pos, target = seq.prefill_pos, seq.prefill_target
    end = pos
    limit = min(target, pos + max_chunk)
    while end < limit:
        page = seq.pages[end // PAGE_SIZE]
        if page.complete:
            break
        if page.filler is not None and page.filler != serial:
            break
        page.filler = serial
        end = min(limit, (end // PAGE_SIZE + 1) * PAGE_SIZE)
    if end == pos and pos < target:
        return None
    return (pos, end)
