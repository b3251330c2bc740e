"""Scheduling for the dynamic generator: which queued jobs start, how much prompt runs next to the decoding
jobs, and whose pages a growing sequence takes when the cache is full.

Pages are taken on demand: a job starts with pages for its prompt, and each decode step first makes sure
every row owns the page it writes. When the cache is full the newest running job is preempted: its pages go
back (full pages keep their prefix hash, so they stay shareable), it returns to the front of the queue, and
on re-admission it recomputes its sequence so far as a prompt, skipping pages that are still cached. The
oldest job can always finish, because a job that could never fit is refused at enqueue().
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from exlpy.generator.dynamic import adapters
from exlpy.generator.dynamic.validate import check_job_args

if TYPE_CHECKING:
    from exlpy.generator.dynamic.generator import ExLlamaV2DynamicGenerator
    from exlpy.generator.dynamic.job import ExLlamaV2DynamicJob
    from exlpy.generator.dynamic.sequence import SeqState

# Prompt tokens per iteration while other jobs decode cost them latency; attention makes a token at context L cost
# about (1 + L / C) times a token at the start of a prompt, C from the model's shapes (`context_cost_tokens`).
# Attention's dots run at about half the rate of the projections' GEMMs (flash attention over a paged cache against
# cuBLAS), so a context token counts twice its share of the FLOPs.
ATTENTION_SLOWDOWN = 2
# Used where a model's shapes are unknown (a stand-in model): the 8B's C is ~13k.
CONTEXT_COST_FALLBACK = 4096
# The context scaling never cuts a chunk next to decoding jobs below this (or below the budget, if smaller). A chunk
# is a forward pass of its own: it reads every weight once (fp16 GEMMs stay memory-bound below ~300 rows on an H100:
# 989 TFLOPS / 3.35 TB/s), and an eager one costs the generator thread the same kernel launches (~10-20 ms on an 8B)
# whatever its length. A smaller chunk costs the decoders nearly as much time per step and the prompt more steps:
# a 16k prompt next to 32 streams (H100, 8B) went in chunks of 24-57 tokens deep into it, 194 steps, TTFT 4.3 s.
MIN_CHUNK_TOKENS = 128
BURST_CHUNKS = 4  # prompt tokens per iteration at most (chunks), so a burst of arrivals starts streaming in waves
PREFILL_WEIGHT = 4  # next to decoding jobs the budget grows by (waiting prompts x this) / max(decoding jobs, this)
# Next to decoding jobs, each waiting prompt adds this many tokens to the budget, up to `max_prefill_per_step`: a lone
# long prompt runs in small pieces (a 16k prompt next to 32 streams: their inter-token p99 1.6x its value alone with
# 256 tokens per step, 11x with 2048), while a crowd of arrivals gets the whole budget (under 64 streams, H100, 8B:
# 256 tokens per step held the server at 49.5% of the generator, 2048 at 84-88%; benchmarks/results/serving.md).
PROMPT_TOKENS = 256
# Up to this many prompt tokens of one sequence per iteration run as captured chunks next to decoding jobs (an eager
# chunk costs the generator thread ~20 ms of kernel launches on an 8B, which the next decode step waits for: the
# 16k-prompt stall). Above it an eager chunk's launches hide behind its own GPU time (~25 us a token on an 8B, H100)
# and one pass reads the weights once instead of once per 256 tokens: a crowd's large budget runs eagerly.
CAPTURED_MAX = 1024


def cache_summary(gen: ExLlamaV2DynamicGenerator) -> str:
    t = gen.page_table
    return (f"the cache holds {t.num_pages * t.page_size} tokens ({t.num_pages} pages of {t.page_size}), "
            f"{t.num_unreferenced()} pages free, {len(gen.active)} jobs running")


def growth_reserve(gen: ExLlamaV2DynamicGenerator) -> int:
    """Pages kept free at admission for the running jobs to grow into (fewer preemptions right after)."""
    return -(-len(gen.active) // 8)


def admit(gen: ExLlamaV2DynamicGenerator, results: list[dict[str, Any]]) -> None:
    """Start queued jobs while there is batch room and pages for their prompts. A job that does not fit is
    skipped; once it has been skipped `max_skips` times no later job may overtake it."""
    table = gen.page_table
    for job in list(gen.pending):
        if len(gen.active) >= gen.max_batch_size:
            job.wait_reason = f"batch full ({gen.max_batch_size} jobs running)"
            break
        try:
            # Checked again here: a job changed after enqueue() (max_new_tokens = 2.5) fails instead of
            # misbehaving later.
            check_job_args(job.max_new_tokens, job.min_new_tokens, job.max_skips, job.seed, job.return_top_tokens,
                           job.stop_conditions, job.banned_strings)
            needs = job.admission_needs()
            need = table.pages_needed(needs)
        except Exception as e:  # a job the enqueue checks missed ends here instead of blocking the queue
            gen.pending.remove(job)
            gen.fail(job, e, results)
            continue
        reserve = growth_reserve(gen) if gen.active else 0
        if need + reserve > table.num_unreferenced():
            tokens = sum(q.ids.numel() for q in job.seqs)
            job.wait_reason = (f"waiting for cache pages: its {tokens} tokens need {need} free pages"
                               + (f" (+{reserve} kept for running jobs to grow)" if reserve else "")
                               + f"; {cache_summary(gen)}")
            if job.skips >= job.max_skips:
                break  # skipped too often: later jobs may not overtake it any more
            continue
        if not (admitted := adapters.admit(gen, job, results)):  # its LoRA adapter slot, if it needs one
            if admitted is False and job.skips >= job.max_skips:
                break
            continue
        for other in gen.pending:
            if other is job:
                break
            other.skips += 1
        gen.pending.remove(job)
        gen.active.append(job)
        gen.admissions += 1
        job.admitted = gen.admissions
        # A job that cannot start (its filters' begin() raises...) ends with an error result, pages freed.
        gen.guard(job, results, lambda j=job, n=needs: _start(gen, j, n, results))


def _start(gen: ExLlamaV2DynamicGenerator, job: ExLlamaV2DynamicJob, needs: list[tuple[list[bytes], int]],
           results: list[dict[str, Any]]) -> None:
    reused = 0
    for q, (hashes, n) in zip(job.seqs, needs):
        q.pages, k = gen.page_table.allocate(hashes, n, job.serial or 0)
        reused += k
    if job.start(reused):
        results.append(job.base_result("started"))


def prefill_budget(gen: ExLlamaV2DynamicGenerator, decoding: int, prefilling: int) -> int:
    """Prompt tokens for this iteration. Without decoding jobs, a whole chunk per job, at most BURST_CHUNKS
    chunks: a burst of arrivals is prefilled in waves, first come first, so the first jobs stream while later
    ones prefill instead of every job waiting for all prompts. Next to decoding jobs, `max_prefill_per_step`,
    PROMPT_TOKENS per waiting prompt up to `max_prefill_per_step`, more when many more jobs wait for their prompt
    than decode (PREFILL_WEIGHT waiting prompts weigh as one decoding job: the decoders lose a little latency, the
    waiting jobs gain much); a lone long prompt runs PROMPT_TOKENS at a time."""
    cap = gen.max_chunk_size * BURST_CHUNKS
    if not decoding:
        return min(gen.max_chunk_size * max(prefilling, 1), cap)
    base = min(gen.max_prefill_per_step, PROMPT_TOKENS * max(prefilling, 1))
    scale = max(1, prefilling * PREFILL_WEIGHT // max(decoding, PREFILL_WEIGHT))
    return min(base * scale, max(cap, base))


def context_cost_tokens(config: Any) -> int:
    """The context length C at which a prompt token's attention costs as much as its projections, so that a token
    at context L costs (1 + L / C) times one at the start: the projections' FLOPs per token and layer (2 per
    weight: q|k|v, o, and the MLP's, `num_experts_per_token` experts' worth in an MoE layer) over attention's per
    context token (4 per query head dimension: q.k and p.v), divided by ATTENTION_SLOWDOWN. Llama-3-8B: 13.3k
    (the constant 4096 used before made a token 16k deep cost 5x one at the start instead of 2.2x)."""
    try:
        h, hq = int(config.hidden_size), int(config.num_attention_heads)
        hk, d = int(config.num_key_value_heads), int(config.head_dim)
        mlp = int(config.intermediate_size)
    except (AttributeError, TypeError, ValueError):
        return CONTEXT_COST_FALLBACK
    moe = getattr(getattr(config, "spec", None), "moe", None)
    if moe is not None:
        mlp = int(moe.expert_size) * int(config.num_experts_per_token or moe.top_k)
    if min(h, hq, hk, d, mlp) < 1:
        return CONTEXT_COST_FALLBACK
    projections = 2 * (h * (hq + 2 * hk) * d + hq * d * h + 3 * h * mlp)
    return max(1, projections // (4 * hq * d * ATTENTION_SLOWDOWN))


def prefill_limit(gen: ExLlamaV2DynamicGenerator, seq: SeqState, decoding: int, budget: int, spent: int) -> int:
    """Prompt tokens `seq` may run now: at most a chunk, and what is left of the budget (without decoding jobs the
    budget is a wave of BURST_CHUNKS chunks: the 64-stream load had every prompt prefilled before any job streamed,
    its TTFT median the whole burst's prefill); next to decoding jobs counting a token
    deep into a long prompt as more (attention over its context), but not fewer than MIN_CHUNK_TOKENS (a chunk's
    fixed cost: the weights read once, an eager pass's launches) unless the budget left is smaller."""
    left = budget - spent
    if left <= 0:
        return 0
    if not decoding:  # a wave of arrivals (prefill_budget): whole chunks while the budget lasts
        return min(gen.max_chunk_size, left)
    c = gen.context_cost_tokens
    scaled = int(left * c / (c + seq.prefill_pos))
    return min(gen.max_chunk_size, left, max(scaled, MIN_CHUNK_TOKENS))


def captured_sizes(limit: int, buckets: Sequence[int]) -> tuple[int, ...]:
    """The captured chunk sizes in which a sequence runs `limit` prompt tokens this iteration next to decoding jobs:
    none (an eager chunk) above CAPTURED_MAX."""
    return tuple(buckets) if 0 < limit <= CAPTURED_MAX else ()


def captured_tokens(limit: int, left: int, buckets: Sequence[int]) -> int:
    """Prompt tokens a sequence runs this iteration in captured chunks (`buckets`: their sizes, ascending), given
    `limit` (prefill_limit) and the `left` tokens of its prompt still to prefill: chunks of the largest size, the
    last one's share rounded to the nearest size (by ratio: within a factor sqrt(2)). A captured chunk costs its
    size whatever it holds, so a chunk is filled with real tokens where the prompt has them; never past the
    prompt's end; 0 when the budget is spent."""
    if limit <= 0 or left <= 0 or not buckets:
        return 0
    top = buckets[-1]
    full = (limit - 1) // top
    share = limit - full * top  # the last chunk's share, 1..top
    size = min(buckets, key=lambda b: (abs(math.log(b / share)), -b))
    return min(left, full * top + size)


def combines_prompts(waiting: int, decoding: int, budget: int) -> bool:
    """Whether this iteration's prompt chunks of `waiting` sequences (two or more) run as shared forward passes
    (`pass_sizes`) instead of a pass (or captured pieces) each. Every pass reads all the weights (an EXL2 pass above
    64 rows first dequantizes them all to fp16) and an eager one costs the host its kernel launches (~20 ms on an
    8B): without decoding jobs each chunk is such an eager pass, so fewer passes always win. Next to decoding jobs a
    sequence's chunk of up to CAPTURED_MAX tokens runs as captured pieces of at most 256 tokens, one weight read (and
    one EXL2 dequantization) each: with a budget above CAPTURED_MAX (`prefill_budget`: five or more waiting
    prompts next to many streams) the iteration runs more than four pieces' worth of prompt, whose weight reads cost
    the GPU more than one eager pass's launches cost the host, and that pass's own GPU time (~25 us a token on an
    8B, H100) hides its launches. Below it (a lone prompt, or a few next to the streams) the captured pieces stay:
    an eager pass of a few hundred tokens would leave the decode step waiting on its launches (the 16k-prompt
    stall, tests/test_serving_stalls.py)."""
    return waiting >= 2 and (not decoding or budget > CAPTURED_MAX)


def pass_sizes(lengths: Sequence[int], limit: int) -> list[int]:
    """How many of the chunks (of `lengths` tokens, in planning order) each shared pass runs: consecutive chunks,
    at most `limit` tokens a pass (`max_chunk_size`, the largest pass the activations are sized for), a chunk
    longer than that in a pass of its own."""
    sizes: list[int] = []
    tokens = 0
    for n in lengths:
        if sizes and tokens + n <= limit:
            sizes[-1] += 1
            tokens += n
        else:
            sizes.append(1)
            tokens = n
    return sizes


def chunk_pieces(n: int, buckets: Sequence[int]) -> list[int]:
    """Lengths of the captured chunks that run `n` prompt tokens: as few as possible (each forward pass reads all
    the weights), the largest bucket each, the last one what is left (padded to its bucket by the runner)."""
    top = buckets[-1]
    return [min(top, n - k) for k in range(0, n, top)]


def decode_pages(gen: ExLlamaV2DynamicGenerator, jobs: list[ExLlamaV2DynamicJob], tokens: int,
                 drain: Callable[[], bool]) -> list[ExLlamaV2DynamicJob]:
    """Give every job the pages its next step writes (`tokens` positions per sequence), oldest job first.
    With the cache full, `drain()` first reads the tokens in flight (a finished job frees its pages); then the
    newest running job is preempted, possibly the one asking. Returns the jobs that still decode."""
    table = gen.page_table
    for job in sorted(jobs, key=lambda j: j.admitted):
        while job in gen.active:
            need = sum(max(0, q.pages_for(job.next_position(q) + tokens) - len(q.pages)) for q in job.seqs)
            if need == 0:
                break
            if need <= table.num_unreferenced():
                for q in job.seqs:
                    table.grow(q.pages, q.pages_for(job.next_position(q) + tokens), job.serial or 0)
                break
            if drain():
                continue
            victim = max(gen.active, key=lambda j: j.admitted)
            preempt(gen, victim, f"preempted: job {job.serial} needed a cache page; {cache_summary(gen)}")
    return [j for j in jobs if j in gen.active]


def preempt(gen: ExLlamaV2DynamicGenerator, job: ExLlamaV2DynamicJob, reason: str) -> None:
    """Free a running job's pages (and LoRA slot) and queue it again ahead of every job that has not started
    yet."""
    gen.release_pages(job)
    gen.active.remove(job)
    job.preempt(reason)
    gen.preemptions += 1
    at = next((i for i, j in enumerate(gen.pending) if not j.started or j.admitted > job.admitted),
              len(gen.pending))
    gen.pending.insert(at, job)


def skip_cached_pages(seq: SeqState) -> int:
    """Advance the prefill position over leading pages whose K/V another job already computed; returns the
    number of tokens skipped."""
    size = seq.page_size
    target = seq.prefill_target
    pos = seq.prefill_pos
    start = pos
    while pos < target and pos % size == 0 and pos + size <= target and seq.pages[pos // size].complete:
        pos += size
    seq.prefill_pos = pos
    return pos - start


def plan_prefill(seq: SeqState, serial: int, max_chunk: int) -> tuple[int, int] | None:
    """Next prefill span (start, end) of one job sequence, after `skip_cached_pages`.

    A page that another running job is still filling is waited for: returns None, and the job tries again
    next iteration. An empty span means the sequence is prefilled (or has no budget this iteration).
    """
    size = seq.page_size
    pos, target = seq.prefill_pos, seq.prefill_target
    end = pos
    limit = min(target, pos + max_chunk)
    while end < limit:
        page = seq.pages[end // size]
        if page.complete:
            break
        if page.filler is not None and page.filler != serial:
            break
        page.filler = serial
        end = min(limit, (end // size + 1) * size)
    if end == pos and pos < limit:
        return None
    return (pos, end)
