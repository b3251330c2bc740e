"""Prompt processing of the dynamic generator: chunks that skip pages other jobs already computed, K/V copied
from a freed page that held the same tokens, and a token budget while other jobs decode."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from exlpy.generator.dynamic import scheduler
from exlpy.model.batch import mixed_batch, paged_batch

if TYPE_CHECKING:
    from exlpy.generator.dynamic.generator import ExLlamaV2DynamicGenerator
    from exlpy.generator.dynamic.job import ExLlamaV2DynamicJob
    from exlpy.generator.dynamic.sequence import SeqState


@dataclass
class Chunk:
    """A prompt span [start, end) of one sequence of a job, planned by `plan_chunks`. `buckets`: the captured
    chunk sizes it runs in (empty: one eager pass)."""

    job: ExLlamaV2DynamicJob
    seq: SeqState
    start: int
    end: int
    buckets: tuple[int, ...] = ()

    @property
    def ids(self) -> torch.Tensor:
        return self.seq.ids[self.start:self.end]


def run_prefill(gen: ExLlamaV2DynamicGenerator, job: ExLlamaV2DynamicJob, results: list[dict[str, Any]],
                decoding: int, budget: int, spent: int, defer: list[Chunk] | None = None,
                together: list[Chunk] | None = None) -> int:
    """One prompt chunk per sequence of the job; returns the tokens planned. With `defer` the chunks are appended
    to it instead of run: they run inside this iteration's decode step (a mixed pass, dynamic/decode.py), and
    `commit_chunks` then records them. A mixed pass holds at most `max_chunk_size` prompt tokens (the largest
    pass the server sizes its activations for): once `defer` holds that many, chunks run as passes of their own.
    With `together` (and no `defer`) the chunks are appended to it, eager, to run with other sequences' chunks in
    shared passes once every job is planned (`run_together`)."""
    room = None if defer is None else gen.max_chunk_size - sum(c.end - c.start for c in defer)
    if room is not None and room <= 0:
        defer = room = None
    if defer is not None:
        together = None
    queue = defer if defer is not None else together
    progressed, deferred, ran = False, False, 0
    for q in job.seqs:
        if q.is_prefilled():
            continue
        # eager, in a shared pass: the decode step's (`room` left in it) or other prompts' (any chunk fits one)
        left = room - ran if room is not None else (gen.max_chunk_size if together is not None else None)
        chunk, moved = plan_chunk(gen, job, q, decoding, budget, spent + ran, left)
        if together and writes_next_page(together, q):
            # A chunk planned before this one (a shared prefix, or the other sequence of a CFG job) writes this
            # sequence's next page: those chunks run first, so that it skips the page as it would behind passes of
            # their own, instead of waiting an iteration for it or writing it twice.
            run_together(gen, together, decoding, results)
            if job not in gen.active or job.finished:  # its own chunk failed in that pass
                return ran
            chunk, again = plan_chunk(gen, job, q, decoding, budget, spent + ran, left)
            moved |= again
        progressed |= moved
        if chunk is None:
            continue
        ran += chunk.end - chunk.start
        if queue is not None:
            queue.append(chunk)
            deferred = True
        else:  # run and recorded before the next sequence is planned: it may skip the pages this one wrote
            run_chunk(gen, chunk)
            commit_chunks(gen, [chunk])
    if progressed and not deferred:  # (deferred chunks report when they are committed)
        report(job, results)
    return ran


def writes_next_page(chunks: list[Chunk], q: SeqState) -> bool:
    """Whether one of `chunks` (planned, not run) writes the page that sequence q prefills next."""
    if q.is_prefilled():
        return False
    page = q.pages[q.prefill_pos // q.page_size]
    if page.complete or page.filler is None:  # (a page being written has its filler)
        return False
    size = q.page_size
    return any(c.seq.pages[p] is page for c in chunks for p in range(c.start // size, (c.end - 1) // size + 1))


def run_together(gen: ExLlamaV2DynamicGenerator, chunks: list[Chunk], decoding: int,
                 results: list[dict[str, Any]]) -> None:
    """Run the planned `chunks` of several sequences in shared forward passes (`scheduler.pass_sizes`: consecutive
    chunks, at most `max_chunk_size` tokens a pass), record them, report each job's progress once, and empty the
    list. A pass left with one chunk runs it as it would run alone (captured pieces next to decoding jobs). A
    shared pass that raises (one job's fault fails it whole) runs its chunks again one by one: the faulty one
    ends its job alone."""
    planned = list(chunks)
    chunks.clear()
    at = 0
    for n in scheduler.pass_sizes([c.end - c.start for c in planned], gen.max_chunk_size):
        group = [c for c in planned[at:at + n] if c.job in gen.active and not c.job.finished]
        at += n
        if len(group) > 1:
            try:
                run_shared(gen, group)
            except Exception:
                pass  # one by one below
            else:
                commit_chunks(gen, group)
                continue
        for c in group:
            if len(group) == 1 and decoding:
                c.buckets = scheduler.captured_sizes(c.end - c.start, gen.chunk_buckets())
            gen.guard(c.job, results, lambda c=c: (run_chunk(gen, c), commit_chunks(gen, [c])))
    for job in dict.fromkeys(c.job for c in planned):
        if job in gen.active and not job.finished:
            report(job, results)


def run_shared(gen: ExLlamaV2DynamicGenerator, chunks: list[Chunk]) -> None:
    """Prompt chunks of several sequences as one forward pass (model/batch.py `mixed_batch`): their tokens end to
    end in one row, so the weights are read once (and an EXL2 model's dequantized once) for all of them, and
    attention runs per chunk over its own sequence's pages. Nothing past the cache writes is computed."""
    groups = [[(c.seq.page_ids(), c.start, c.end - c.start)] for c in chunks]
    batch = mixed_batch(groups, gen.cache, gen.device(), gen.page_size, 0)
    gen.model.forward_batch(torch.cat([c.ids for c in chunks]).view(1, -1), batch, preprocess_only=True)


def plan_chunk(gen: ExLlamaV2DynamicGenerator, job: ExLlamaV2DynamicJob, q: SeqState, decoding: int, budget: int,
               spent: int, room: int | None = None) -> tuple[Chunk | None, bool]:
    """Sequence q's prompt chunk for this iteration (None: none now), after skipping what the cache already holds;
    and whether it progressed (a chunk, or pages found cached). `room`: the chunk will run eagerly (no captured
    sizes) in a pass shared with other rows (the decode step's, or other prompts'), `room` tokens at most."""
    serial = job.serial or 0
    gen.cached_tokens += scheduler.skip_cached_pages(q)
    copy_partial_page(gen, q, serial)
    gen.cached_tokens += scheduler.skip_cached_pages(q)
    if gen.spec is not None:
        gen.spec.on_cached(q)
    if q.is_prefilled():
        return None, True
    limit = scheduler.prefill_limit(gen, q, decoding, budget, spent)
    if room is not None:
        limit = max(0, min(limit, room))
    # Next to decoding jobs a chunk of up to CAPTURED_MAX tokens runs captured where it can: an eager one costs
    # the host its kernel launches (~20 ms on an 8B), and the decode step launched after it waits for them. A
    # chunk inside the decode step (mixed) is eager: the step's launches hide behind the chunk's GPU time; so is one
    # in a shared prompt pass (`run_together`), whose launches hide behind the pass's many tokens.
    buckets: tuple[int, ...] = ()
    if decoding and not job.embeddings and room is None:
        buckets = scheduler.captured_sizes(limit, gen.chunk_buckets())
    if buckets:
        limit = scheduler.captured_tokens(limit, q.prefill_target - q.prefill_pos, buckets)
    if limit == 0:
        job.wait_reason = "waiting for its turn to prefill next to the running jobs"
        return None, False
    plan = scheduler.plan_prefill(q, serial, limit)
    if plan is None:
        job.wait_reason = "waiting for another job to finish computing a shared prefix page"
        return None, False
    start, end = plan
    if job.embeddings:  # Gemma 3: a chunk holds whole images (their tokens see each other)
        from exlpy.vision.mm import extend_to_image_end

        end = extend_to_image_end(gen.model.config, q.ids, end, q.prefill_target, job.embeddings)
    return (Chunk(job, q, start, end, buckets) if end > start else None), True


def run_chunk(gen: ExLlamaV2DynamicGenerator, c: Chunk) -> None:
    """One chunk's forward pass(es) of its own: captured pieces where it has `buckets`, else one eager pass."""
    job, q, start, end = c.job, c.seq, c.start, c.end
    if c.buckets:
        a = start
        for n in scheduler.chunk_pieces(end - start, c.buckets):
            batch = paged_batch([(q.page_ids(), a, n)], gen.cache, gen.device(), gen.page_size, [job.lora_slot])
            gen.model.prefill_chunk(q.ids[a:a + n].unsqueeze(0), batch)
            a += n
        return
    batch = paged_batch([(q.page_ids(), start, end - start)], gen.cache, gen.device(), gen.page_size,
                        [job.lora_slot])
    if job.embeddings:  # image rows, and M-RoPE angles of the chunk's tokens
        from exlpy.vision.mm import chunk_inputs

        batch.mm = chunk_inputs(gen.model.config, q.ids, start, end, job.embeddings)
        if batch.mm.rope is not None:
            batch.rope_positions = torch.arange(end - start, device=gen.device()).view(1, -1)
    gen.model.forward_batch(c.ids.unsqueeze(0), batch, preprocess_only=True)


def commit_chunks(gen: ExLlamaV2DynamicGenerator, chunks: list[Chunk],
                  results: list[dict[str, Any]] | None = None) -> None:
    """Record chunks whose K/V the cache now holds (their pages' fill, the sequences' prefill position); with
    `results`, report each job's progress once."""
    size = gen.page_size
    for c in chunks:
        q, start, end = c.seq, c.start, c.end
        if gen.spec is not None:
            gen.spec.on_prefill(q, start, end)
        gen.prefill_tokens += end - start
        for p in range(start // size, (end - 1) // size + 1):
            q.pages[p].kv_position = max(q.pages[p].kv_position, min(size, end - p * size))
        q.prefill_pos = end
    for job in dict.fromkeys(c.job for c in chunks) if results is not None else ():
        report(job, results)


def completes_prompt(job: ExLlamaV2DynamicJob, chunks: list[Chunk]) -> bool:
    """Whether the job's prompt is prefilled once `chunks` (not yet committed) are: it decodes in the same pass."""
    ends = {id(c.seq): c.end for c in chunks if c.job is job}
    return bool(ends) and all(q.is_prefilled() or ends.get(id(q)) == q.prefill_target for q in job.seqs)


def report(job: ExLlamaV2DynamicJob, results: list[dict[str, Any]]) -> None:
    """A "prefill" progress result for the job."""
    job.wait_reason = None
    r = job.base_result("prefill")
    r.update(curr_progress=sum(q.prefill_pos for q in job.seqs), max_progress=sum(q.prefill_target for q in job.seqs))
    results.append(r)


def copy_partial_page(gen: ExLlamaV2DynamicGenerator, q: SeqState, serial: int) -> None:
    """At a page start, copy K/V from a free page that followed the same prefix and holds the same leading
    tokens (e.g. the previous turn of a chat, whose last page was not full): those tokens skip prefill."""
    pos, target, size = q.prefill_pos, q.prefill_target, gen.page_size
    if not gen.copy_partial_pages:
        return
    p = pos // size
    if pos % size or pos >= target or (p > 0 and p - 1 >= len(q.hashes)):
        return
    page = q.pages[p]
    if page.complete or page.kv_position or page.filler not in (None, serial):
        return
    donor, n = gen.page_table.find_partial(q.hashes[p - 1] if p else q.salt, q.ids[pos:target])
    if donor is None or n == 0:
        return
    try:
        gen.cache.copy_states(gen.cache, donor.index * size, n, page.index * size, n, 0, 1, 0, 1)
        if gen.spec is not None:
            gen.spec.on_copy(donor.index * size, page.index * size, n)
    except NotImplementedError:
        gen.copy_partial_pages = False  # e.g. quantized caches: recompute instead
        return
    page.filler, page.kv_position = serial, n
    q.prefill_pos += n
    gen.cached_tokens += n
