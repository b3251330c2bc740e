"""What runs through the model in one iteration: prefill chunk planning and the batched decode step (batches:
exlpy.model.batch)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from exlpy.generator.dynamic.pages import PAGE_SIZE
from exlpy.generator.filters.device import premask_jobs
from exlpy.model.batch import paged_batch

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
    batch = paged_batch(rows, cache, device, PAGE_SIZE, [j.lora_slot for j in jobs for _ in j.seqs])  # LoRA slots
    logits = model.forward_batch(ids, batch, last_id_only=True)[:, -1]  # [rows, V]
    logits = premask_jobs(jobs, first, logits)  # grammar filters: their token masks applied on the device
    fast = [k for k, j in enumerate(jobs) if j.plain_greedy()]
    greedy: dict[int, int] = {}
    if fast:
        # Ids past the tokenizer's vocab (padded heads) are never valid picks, as in the sampler.
        picks = logits[[first[k] for k in fast], :vocab_limit].argmax(-1).tolist()
        greedy = dict(zip(fast, picks))
    slow = [k for k in range(len(jobs)) if k not in greedy]
    per_job: list[torch.Tensor] = [torch.empty(0)] * len(jobs)
    if slow:
        # One device-to-host copy for all sampled rows, then each job takes its consecutive slice.
        cpu = logits[[first[k] + r for k in slow for r in range(len(jobs[k].seqs))]].unsqueeze(1).float().cpu()
        i = 0
        for k in slow:
            n = len(jobs[k].seqs)
            per_job[k] = cpu[i:i + n]
            i += n
    return greedy, per_job, len(rows)
