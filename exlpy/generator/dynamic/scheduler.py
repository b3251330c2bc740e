"""What runs through the model in one iteration: prefill chunk planning, paged ForwardBatch construction and the
batched decode step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from exlpy.generator.dynamic.pages import PAGE_SIZE
from exlpy.model.batch import ForwardBatch

if TYPE_CHECKING:
    from exlpy.generator.dynamic.job import ExLlamaV2DynamicJob, SeqState


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


def paged_batch(rows: list[tuple[list[int], int, int]], cache: object, device: torch.device) -> ForwardBatch:
    """ForwardBatch for rows of (page ids, first position, q_len), all rows with the same q_len.

    Built from Python lists with one tensor per field: this runs every decode step, and per-row tensor ops
    would cost more host time than a small model's whole step on the GPU.
    """
    B = len(rows)
    T = rows[0][2]
    P = max(len(p) for p, _, _ in rows)
    positions, slots, table, seqlens = [], [], [], []
    for pages, start, q in rows:
        assert q == T, "all rows of one paged batch need the same q_len"
        pos = list(range(start, start + T))
        positions.append(pos)
        slots.append([pages[t // PAGE_SIZE] * PAGE_SIZE + t % PAGE_SIZE for t in pos])
        table.append(pages + [0] * (P - len(pages)))
        seqlens.append(start + T)
    return ForwardBatch(batch_size=B, q_len=T,
                        positions=torch.tensor(positions, dtype=torch.long).to(device, non_blocking=True),
                        cache=cache, slots=torch.tensor(slots, dtype=torch.long).to(device, non_blocking=True),
                        block_table=torch.tensor(table, dtype=torch.int32).to(device, non_blocking=True),
                        page_size=PAGE_SIZE,
                        seqlens=torch.tensor(seqlens, dtype=torch.int32).to(device, non_blocking=True),
                        max_seqlen=max(seqlens))


def cache_rows_batch(cache: Any, rows: list[int], starts: list[int], q_len: int,
                     device: torch.device) -> ForwardBatch:
    """Batch over a contiguous cache where row i writes cache row rows[i] from position starts[i] on.

    Each sequence sits unpadded at the start of its own cache row, so positions equal cache indices and rows of
    different lengths need no attention mask (the streaming generator's CFG pair, the base generator's batch).
    """
    stride = cache.max_seq_len
    r = torch.tensor(rows, dtype=torch.long)
    pos = torch.tensor(starts, dtype=torch.long).unsqueeze(1) + torch.arange(q_len).unsqueeze(0)
    seqlens = (pos[:, -1] + 1).to(torch.int32)
    return ForwardBatch(batch_size=len(rows), q_len=q_len, positions=pos.to(device), cache=cache,
                        slots=(r.unsqueeze(1) * stride + pos).to(device),
                        block_table=r.to(torch.int32).unsqueeze(1).to(device), page_size=stride,
                        seqlens=seqlens.to(device), max_seqlen=int(seqlens.max()))


def decode_step(model: Any, cache: Any, device: torch.device, jobs: list[ExLlamaV2DynamicJob], vocab_limit: int
                ) -> tuple[dict[int, int], list[torch.Tensor], int]:
    """One batched q_len-1 step over every sequence of `jobs` (CFG jobs have two rows). Plain-greedy jobs
    are reduced to their argmax on the device; only the other jobs' logits travel to the CPU for the
    sampler. Returns ({job index: token}, per job its logits [rows, 1, V] on the CPU, rows run)."""
    rows, first = [], []  # first: each job's first row (a job's rows are consecutive)
    for j in jobs:
        first.append(len(rows))
        rows += [(q.page_ids(), q.ids.numel() - 1, 1) for q in j.seqs]
    ids = torch.stack([q.ids[-1:] for j in jobs for q in j.seqs])
    batch = paged_batch(rows, cache, device)
    logits = model.forward_batch(ids, batch, last_id_only=True)
    fast = [k for k, j in enumerate(jobs) if j.plain_greedy()]
    greedy: dict[int, int] = {}
    if fast:
        # Ids past the tokenizer's vocab (padded heads) are never valid picks, as in the sampler.
        picks = logits[[first[k] for k in fast], -1, :vocab_limit].argmax(-1).tolist()
        greedy = dict(zip(fast, picks))
    slow = [k for k in range(len(jobs)) if k not in greedy]
    per_job: list[torch.Tensor] = [torch.empty(0)] * len(jobs)
    if slow:
        # One device-to-host copy for all sampled rows, then each job takes its consecutive slice.
        cpu = logits[[first[k] + r for k in slow for r in range(len(jobs[k].seqs))], -1:].float().cpu()
        i = 0
        for k in slow:
            n = len(jobs[k].seqs)
            per_job[k] = cpu[i:i + n]
            i += n
    return greedy, per_job, len(rows)
