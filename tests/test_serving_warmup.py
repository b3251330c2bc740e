"""Serving warm-up (exlpy/generator/dynamic/warmup.py): the shapes it plans cover every decode graph and prefill
variant class a server meets, and running them leaves the generator as it was (on the demo model, on the CPU)."""

from __future__ import annotations

import torch

from exlpy.engine.graphs import BUCKETS
from exlpy.generator import ExLlamaV2DynamicJob, ExLlamaV2Sampler
from exlpy.generator.dynamic.warmup import plan_shapes, width_classes
from tests.test_server_helpers import make_generator, single_torch_thread  # noqa: F401


def test_width_classes_cover_one_sixteen_and_other() -> None:
    assert width_classes(1) == [1, 2, 16]
    assert width_classes(16) == [16, 17]
    assert width_classes(5) == [5, 16]
    assert width_classes(33) == [33, 48]


def test_plan_covers_every_row_and_width_bucket_and_the_whole_context() -> None:
    plan = plan_shapes(max_batch_size=64, max_seq_len=20480, page_size=256, max_chunk_size=2048, num_pages=640)
    widths = {w for _, w in plan.decode}
    assert {r for r, _ in plan.decode} == {1, 2, 4, 8, 16, 32, 64}
    assert widths == {w for w in BUCKETS if w <= 128}  # 80 pages of context -> the 128 bucket
    assert plan.jobs == [1, 2, 4, 8, 16, 32, 64]
    lengths = {n for _, n, _ in plan.prefill}
    assert {1, 8, 15, 16, 17, 256, 2048} <= lengths and max(lengths) == 2048
    assert max(s + n for s, n, _ in plan.prefill) == 20479  # a chunk reaching the last position
    for start, n, w in plan.prefill:
        assert start + n <= 20479 and w * 256 >= start + n
    assert {w % 16 == 0 for _, _, w in plan.prefill} == {True, False}


def test_plan_respects_small_limits() -> None:
    plan = plan_shapes(max_batch_size=3, max_seq_len=128, page_size=256, max_chunk_size=256, num_pages=2)
    assert {r for r, _ in plan.decode} == {1, 2, 4} and {w for _, w in plan.decode} == {1}
    assert plan.jobs == [1, 2]  # a bucket larger than the cache's pages cannot run as jobs
    assert all(s + n <= 127 for s, n, _ in plan.prefill)


def test_full_warmup_runs_and_leaves_the_generator_clean() -> None:
    gen = make_generator(pages=4, max_batch_size=4)
    gen.warmup(full=True)
    assert gen.num_remaining_jobs() == 0 and gen.page_table.num_unreferenced() == gen.num_pages
    assert gen.prefill_tokens == gen.decode_tokens == gen.preemptions == 0
    job = ExLlamaV2DynamicJob(torch.tensor([[1, 5, 9, 13]]), 6, stop_conditions=[],
                              gen_settings=ExLlamaV2Sampler.Settings.greedy())
    gen.enqueue(job)
    while gen.num_remaining_jobs():
        gen.iterate()
    assert job.new_tokens == 6
