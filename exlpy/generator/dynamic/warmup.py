"""Warm-up of every shape a serving generator will run, so no request pays for a Triton compile or a graph capture.

A kernel variant is compiled the first time a launch meets a new combination of its constexprs and of the
integer arguments Triton specializes (equal to 1, divisible by 16, other): prompt chunk lengths, block-table
widths and key-range split counts (which grow with the context) all pick variants. A decode step is captured as
a CUDA graph once per (row bucket, table-width bucket) (exlpy/engine/graphs.py). Unwarmed, the first requests of
a fresh server pay seconds for each (the 64-stream run of benchmarks/results/serving.md: TTFT median 30 s), and a
long prompt arriving later stalls every decoding stream while its deep chunks compile.

`plan_shapes` lists what to run from the generator's limits alone (tested on CPU); `run_warmup` runs it:
 - decode: for every row bucket up to `max_batch_size` and every width bucket up to `max_seq_len`, one step of
   that many rows through `forward_batch` (captures the graph; its warm-up runs compile the kernels), then
   real jobs of every row bucket through the generator, greedy and sampled, for the device sampler's kernels;
 - prefill: chunks of every length class up to `max_chunk_size`, starting at depths from 0 to the end of the
   context (split counts), with block tables of every width class; for models whose image tokens attend both
   ways (Gemma 3), each chunk of two or more tokens once more as a chunk holding an image (the attention
   kernels' variant with per-query key limits, exlpy/vision/attention.py);
 - captured prompt chunks (what a prompt runs next to decoding jobs, exlpy/engine/graphs.py `run_chunk`): every
   chunk size of `CHUNK_BUCKETS` with every width bucket up to `max_seq_len` (4 x 8 graphs for a 20k context of
   256-token pages), each captured once; a capture that fails warns and leaves prompt chunks eager.
Every row of these steps reads and writes pages of the cache whose contents are thrown away afterwards (the
page table is reset: no prefix hash survives).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from exlpy.engine.graphs import BUCKETS, CHUNK_BUCKETS, bucket_for
from exlpy.errors import InsufficientVRAMError
from exlpy.model.batch import paged_batch

if TYPE_CHECKING:
    from exlpy.generator.dynamic.generator import ExLlamaV2DynamicGenerator

# Chunk lengths: 1..9 (short chunks and graph-sized steps), both sides of each multiple of 16 the kernels'
# tiles and Triton's divisibility specialization care about, and the common budget sizes.
_LENGTHS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 100, 127, 128, 129, 200, 255, 256,
            257, 384, 511, 512, 513, 768, 1000, 1024, 1025, 1536, 2047, 2048)
_SHORT = (1, 7, 16, 17, 100, 256)  # at the intermediate depths: the classes that change the split count


@dataclass
class WarmupPlan:
    decode: list[tuple[int, int]] = field(default_factory=list)  # (rows, table width in pages)
    jobs: list[int] = field(default_factory=list)  # row buckets run as real jobs (device sampler)
    prefill: list[tuple[int, int, int]] = field(default_factory=list)  # (start, length, table width)
    chunks: list[tuple[int, int, int]] = field(default_factory=list)  # captured chunks: (start, bucket, width)


def width_classes(need: int) -> list[int]:
    """Table widths >= need covering Triton's integer classes: 1, a multiple of 16, anything else."""
    out = {need}
    if need == 1:
        out.add(2)
    elif need % 16 == 0:
        out.add(need + 1)
    out.add(-(-need // 16) * 16)
    return sorted(out)


def plan_shapes(max_batch_size: int, max_seq_len: int, page_size: int, max_chunk_size: int,
                num_pages: int) -> WarmupPlan:
    plan = WarmupPlan()
    max_rows = bucket_for(max_batch_size) or max_batch_size
    max_width = -(-max_seq_len // page_size)
    top_width = bucket_for(max_width) or max_width
    widths = [w for w in BUCKETS if w <= top_width]
    rows = [r for r in BUCKETS if r <= max_rows]
    plan.decode = [(r, w) for r in rows for w in widths]
    plan.jobs = [r for r in rows if r <= min(max_batch_size, num_pages)]
    for w in widths:
        for n in CHUNK_BUCKETS:
            end = min(w * page_size, max_seq_len - 1)  # a chunk that ends inside the table's last page
            if n <= end:
                plan.chunks.append((end - n, n, w))
    depths = [0] + [p * page_size for p in BUCKETS if p * page_size < max_seq_len - 1]
    deepest = max_seq_len - 1 - min(max_chunk_size, max_seq_len - 1)  # a last chunk ending at the context's end
    if deepest > depths[-1]:
        depths.append(deepest)
    seen = set()
    for i, start in enumerate(depths):
        lengths = _LENGTHS if i in (0, len(depths) - 1) else _SHORT
        for n in lengths:
            n = min(n, max_chunk_size, max_seq_len - 1 - start)
            if n < 1:
                continue
            for w in width_classes(-(-(start + n) // page_size)):
                if (start, n, w) not in seen:
                    seen.add((start, n, w))
                    plan.prefill.append((start, n, w))
    return plan


def _release(device: torch.device) -> None:
    """Give the allocator's cached free blocks back (between the warm-up's phases)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def image_chunk(n: int) -> object:
    """The multimodal part of an n-token warm-up chunk whose middle half is one image (text ids stand in for the
    image's rows: what compiles is the attention with key limits, whatever the rows hold)."""
    from exlpy.vision.mm import MMInputs

    blocks = torch.full((1, n), -1, dtype=torch.long)
    blocks[0, n // 4:n // 4 + max(2, n // 2)] = 0
    return MMInputs([], blocks=blocks)


def warm_chunks(gen: ExLlamaV2DynamicGenerator, chunks: list[tuple[int, int, int]]) -> None:
    """Run (capture) every planned prompt chunk (start, bucket, table width) as the generator runs them next to
    decoding jobs. Out of memory stops here with a warning (later shapes are captured when first used); a failed
    capture warns in the runner and leaves prompt chunks eager."""
    device, size = gen.device(), gen.page_size
    with torch.inference_mode():
        for start, n, width in chunks:
            table = [k % gen.num_pages for k in range(width)]
            ids = torch.randint(3, gen.model_vocab, (1, n))
            try:
                gen.model.prefill_chunk(ids, paged_batch([(table, start, n)], gen.cache, device, size))
            except (torch.cuda.OutOfMemoryError, InsufficientVRAMError):
                warnings.warn(f"warm-up: out of memory capturing a prompt chunk of {n} tokens x {width} pages; "
                              "larger shapes are captured when first used", stacklevel=2)
                _release(device)
                break


def run_warmup(gen: ExLlamaV2DynamicGenerator, log: bool = False) -> WarmupPlan:
    """Run every shape of `plan_shapes` for this generator (an idle one); see the module docstring."""
    from exlpy.generator.dynamic.job import ExLlamaV2DynamicJob
    from exlpy.generator.sampler import ExLlamaV2Sampler

    plan = plan_shapes(gen.max_batch_size, gen.max_seq_len, gen.page_size, gen.max_chunk_size, gen.num_pages)
    device, size, vocab = gen.device(), gen.page_size, gen.model_vocab
    t0 = time.perf_counter()
    with torch.inference_mode():
        for rows, width in plan.decode:
            table = [k % gen.num_pages for k in range(width)]
            pos = min(width * size, gen.max_seq_len) - 1
            ids = torch.randint(3, vocab, (rows, 1))
            batch = paged_batch([(table, pos, 1)] * rows, gen.cache, device, size)
            try:
                gen.model.forward_batch(ids, batch, last_id_only=True)
            except (torch.cuda.OutOfMemoryError, InsufficientVRAMError):
                # Every graph keeps its output rows: a full GPU cannot hold the largest ones. Requests of those
                # shapes capture their graph when they come (or run eagerly), as without the warm-up.
                warnings.warn(f"warm-up: out of memory capturing the decode step of {rows} rows x {width} pages; "
                              "larger shapes are captured when first used", stacklevel=2)
                _release(device)
                break
        # Blocks the allocator cached for the decode steps' activations would otherwise sit beside those of
        # the prefill chunks below (several GiB reserved and unused on an 8B; the cache was sized without them).
        _release(device)
        images = gen.model.config.spec.arch.image_bidirectional
        for start, n, width in plan.prefill:
            table = [k % gen.num_pages for k in range(width)]
            ids = torch.randint(3, vocab, (1, n))
            try:
                for mm in (None, image_chunk(n)) if images and n > 1 else (None,):
                    batch = paged_batch([(table, start, n)], gen.cache, device, size)
                    batch.mm = mm
                    gen.model.forward_batch(ids, batch, preprocess_only=True)
            except (torch.cuda.OutOfMemoryError, InsufficientVRAMError):
                warnings.warn(f"warm-up: out of memory in a prefill chunk of {n} tokens at depth {start}; the "
                              "remaining prefill shapes compile when first used", stacklevel=2)
                _release(device)
                break
        _release(device)
        if gen.chunk_buckets():
            warm_chunks(gen, plan.chunks)
            _release(device)
    sampled = ExLlamaV2Sampler.Settings(temperature=1.0, top_k=0, top_p=0.9, token_repetition_penalty=1.0)
    for rows in plan.jobs:
        # greedy; whole-vocabulary top-p; exllamav2's defaults (top-k and the penalty variant of the captured
        # sampler, exlpy/generator/sampling/graphed.py)
        for settings in (ExLlamaV2Sampler.Settings.greedy(), sampled, ExLlamaV2Sampler.Settings()):
            gen.enqueue([ExLlamaV2DynamicJob(torch.randint(3, vocab, (1, 2)), 3, stop_conditions=[],
                                             gen_settings=settings, seed=k) for k in range(rows)])
            while gen.num_remaining_jobs():
                gen.iterate()
    if plan.jobs:  # the captured sampler's candidate steps (typical, TFS, ...): one more kernel variant, once
        gen.enqueue(ExLlamaV2DynamicJob(torch.randint(3, vocab, (1, 2)), 3, stop_conditions=[], seed=0,
                                        gen_settings=ExLlamaV2Sampler.Settings(typical=0.9)))
        while gen.num_remaining_jobs():
            gen.iterate()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if log:
        print(f"warm-up: {len(plan.decode)} decode shapes, {len(plan.jobs) * 3} sampler batches, "
              f"{len(plan.prefill)} prefill shapes, {len(plan.chunks) if gen.chunk_buckets() else 0} captured "
              f"prompt chunks in {time.perf_counter() - t0:.1f} s", flush=True)
    return plan
