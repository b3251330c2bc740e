"""Captured prompt chunks (exlpy/engine/graphs.py `run_chunk`): a chunk of n tokens padded to its bucket writes
and computes what the eager chunk does; the scheduler's chunk sizes next to decoding jobs (plain values); the
generator's prompt prefilled that way equals the eager one; a capture that fails falls back to eager chunks."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config
from exlpy.engine.graphs import CHUNK_BUCKETS, StepGraphs, chunk_bucket
from exlpy.engine.split import layer_split
from exlpy.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler
from exlpy.generator.dynamic import scheduler
from exlpy.generator.dynamic.warmup import plan_shapes, warm_chunks
from exlpy.model import Transformer
from exlpy.model.batch import pack, paged_batch
from exlpy.runtime import RuntimeOptions, options, use_options
from tests.conftest import rel_err, requires_cuda, shared_path
from tests.hf_models import make_hf_model
from tests.test_generator_helpers import _load as _load_aidreams
from tests.test_generator_helpers import decode_next_to_long_prompt
from tests.test_graphs import _load

TOL = 1e-5
PAGE = 16  # the test cache [4, 64, H, D] addressed as 16 pages of 16 rows
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _chunk_graphs_on() -> Iterator[None]:
    """These tests are about captured prompt chunks (on by default; EXLPY_PREFILL_GRAPHS=0 in the environment: off)."""
    with use_options(dataclasses.replace(options(), prefill_graphs=True)):
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("chunk_graphs_model")
    make_hf_model(path, "llama")  # GQA 4/2 heads, as test_graphs.py's
    return path


def _random_cache(model: ExLlamaV2, seed: int) -> tuple[ExLlamaV2Cache, ExLlamaV2Cache]:
    g = torch.Generator().manual_seed(seed)
    a = ExLlamaV2Cache(model, batch_size=4)
    for t in a.all_tensors():
        t.copy_(torch.randn(t.shape, generator=g).to(t.device, t.dtype))
    return a, ExLlamaV2Cache(model, batch_size=4, copy_from=a)


# --- plain values ------------------------------------------------------------------------------------------------
def test_chunk_buckets_and_scheduler_sizes() -> None:
    assert CHUNK_BUCKETS == (32, 64, 128, 256)
    assert [chunk_bucket(n) for n in (0, 1, 32, 33, 200, 256, 257)] == [None, 32, 32, 64, 256, 256, None]
    b = CHUNK_BUCKETS
    # chunks of 256, the last share rounded to the nearest size by ratio, never past the prompt's end
    assert scheduler.captured_tokens(256, 16000, b) == 256
    assert scheduler.captured_tokens(255, 16000, b) == 256
    assert scheduler.captured_tokens(129, 16000, b) == 128
    assert scheduler.captured_tokens(100, 16000, b) == 128
    assert scheduler.captured_tokens(85, 16000, b) == 64
    assert scheduler.captured_tokens(51, 16000, b) == 64  # deep into a long prompt: one 64-token chunk
    assert scheduler.captured_tokens(300, 16000, b) == 288  # 256 + 44 -> 256 + 32
    assert scheduler.captured_tokens(2048, 16000, b) == 2048  # a crowd's budget: eight full chunks
    assert scheduler.captured_tokens(256, 37, b) == 37  # the prompt's last tokens, padded by the runner
    assert scheduler.captured_tokens(5, 37, b) == 32  # a small budget still moves the prompt on
    assert scheduler.captured_tokens(0, 500, b) == 0 and scheduler.captured_tokens(100, 0, b) == 0
    assert scheduler.captured_tokens(100, 500, ()) == 0
    # up to CAPTURED_MAX tokens of a sequence per iteration run captured; a crowd's larger budget eagerly
    assert scheduler.captured_sizes(256, b) == b and scheduler.captured_sizes(scheduler.CAPTURED_MAX, b) == b
    assert scheduler.captured_sizes(scheduler.CAPTURED_MAX + 1, b) == () and scheduler.captured_sizes(0, b) == ()
    assert scheduler.captured_sizes(256, ()) == ()
    # as few chunks as possible, each at most the largest bucket
    assert scheduler.chunk_pieces(320, b) == [256, 64]
    assert scheduler.chunk_pieces(2048, b) == [256] * 8
    assert scheduler.chunk_pieces(37, b) == [37]
    assert scheduler.chunk_pieces(513, b) == [256, 256, 1]


def test_pack_pads_a_row_that_writes_nowhere_and_is_seen_by_no_real_token() -> None:
    values = pack([5], 8, [[3, 7]], PAGE, 1, 2, None, lengths=[3])
    positions, slots = values[:8], values[8:16]
    assert positions == [5, 6, 7, 7, 7, 7, 7, 7]  # padding at the last real position (inside the RoPE tables)
    assert slots == [53, 54, 55, -1, -1, -1, -1, -1]
    assert values[16] == 8  # the row's length counts its real tokens only
    assert values[17:19] == [3, 7] and values[19] == -1
    assert pack([5], 8, [[3, 7]], PAGE, 1, 2) == pack([5], 8, [[3, 7]], PAGE, 1, 2, lengths=[8])


def test_warmup_plans_every_chunk_bucket_per_width_bucket() -> None:
    plan = plan_shapes(max_batch_size=64, max_seq_len=20480, page_size=256, max_chunk_size=2048, num_pages=640)
    assert {(n, w) for _, n, w in plan.chunks} == {(n, w) for n in CHUNK_BUCKETS for w in (1, 2, 4, 8, 16, 32, 64,
                                                                                          128)}
    assert len(plan.chunks) == 32
    for start, n, w in plan.chunks:
        assert start >= 0 and start + n <= min(w * 256, 20479)


# --- the runner's body on the CPU (capture=False): what a replay computes -----------------------------------------
@pytest.mark.parametrize("cuts", [(), (2,), "after_last_attention"])
def test_padded_chunk_matches_eager_chunk(model_dir: Path, cuts: tuple[int, ...] | str) -> None:
    model = _load(model_dir)
    if cuts == "after_last_attention":  # a layer split whose last segment holds no attention: it never runs
        cuts = (len(model.modules) - 2,)
    runner = StepGraphs(layer_split(Transformer(model.modules), cuts), capture=False)
    eager, graphed = _random_cache(model, 0)
    g = torch.Generator().manual_seed(1)
    for start, n, table in ((5, 20, [3, 7]), (25, 37, [3, 7, 12, 9]), (0, 32, [14, 2])):
        ids = torch.randint(3, 320, (1, n), generator=g)
        model.forward_batch(ids, paged_batch([(table, start, n)], eager, CPU, PAGE), preprocess_only=True)
        batch = paged_batch([(table, start, n)], graphed, CPU, PAGE)
        batch.logits = "none"
        assert runner.run_chunk(ids, batch)
        for a, b in zip(eager.all_tensors(), graphed.all_tensors()):
            assert rel_err(b, a) <= TOL  # the same rows written; the padding wrote nowhere
    assert {(k[2], k[3]) for k in runner.steps} == {(32, 2), (64, 4)}  # (bucket, width bucket)
    assert runner.chunks_run == 3
    # a decode step over what the chunks wrote: the same logits
    tok = torch.tensor([[7]])
    table = [3, 7, 12, 9]
    ref = model.forward_batch(tok, paged_batch([(table, 62, 1)], eager, CPU, PAGE))
    out = model.forward_batch(tok, paged_batch([(table, 62, 1)], graphed, CPU, PAGE))
    assert rel_err(out, ref) <= TOL
    # shapes the chunk graphs do not take: the caller runs them eagerly
    big = paged_batch([([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 0], 0, 257)], graphed, CPU, PAGE)
    big.logits = "none"
    assert not runner.run_chunk(torch.randint(3, 320, (1, 257)), big)
    logits = paged_batch([(table, 0, 20)], graphed, CPU, PAGE)  # wants logits
    assert not runner.run_chunk(torch.randint(3, 320, (1, 20)), logits)


def _graph_model_cpu() -> tuple[ExLlamaV2, object]:
    model, tok = _load_aidreams.__wrapped__(str(shared_path("models", "aidreams260K")), "cpu")  # not the shared one
    strategy = model.strategy_for_forward()
    strategy.graph_safe = True  # as on a CUDA model; the runner runs its body eagerly
    strategy.graph_cache["runner"] = StepGraphs(strategy, capture=False)
    return model, tok


def test_generator_prefills_in_captured_chunks_next_to_decoding_jobs() -> None:
    """The same workload with eager chunks and with chunks through the runner's body: equal cache contents for
    the prompt and equal tokens; the captured run's chunks come from the buckets."""
    model, tok = _graph_model_cpu()
    runs = {}
    for graphs in (False, True):
        cache = ExLlamaV2Cache(model, max_seq_len=8 * 256)
        gen = ExLlamaV2DynamicGenerator(model, cache, tok, max_prefill_per_step=100)
        gen.prefill_graphs = graphs
        gen.mixed_step = False  # chunks as passes of their own (inside the decode step they are never captured)
        assert gen.chunk_buckets() == (CHUNK_BUCKETS if graphs else ())
        seen: list[int] = []
        runner = model.strategy_for_forward().graph_cache["runner"]
        original = runner.run_chunk

        def spy(ids: torch.Tensor, batch: object, _orig=original, _seen=seen) -> bool:
            _seen.append(ids.shape[-1])
            return _orig(ids, batch)

        runner.run_chunk = spy  # type: ignore[method-assign]
        try:
            long, chunks = decode_next_to_long_prompt(gen, 400, 16, 6)
        finally:
            del runner.run_chunk
        rows = torch.cat([torch.arange(p * 256, (p + 1) * 256) for p in long.seqs[0].page_ids()])[:399]
        kv = [t.view(-1, *t.shape[2:])[rows].clone() for t in cache.all_tensors()]
        while gen.num_remaining_jobs():
            gen.iterate()
        runs[graphs] = (kv, torch.as_tensor(long.sequence).view(-1)[-6:].tolist(), chunks, seen)
    (kv0, toks0, chunks0, seen0), (kv1, toks1, chunks1, seen1) = runs[False], runs[True]
    assert not seen0 and seen1 and sum(chunks1) == 399
    assert all(n <= 256 for n in seen1) and set(chunks1[:-1]) <= {32, 64, 128, 256}
    assert max(chunks0) <= 100 and max(chunks1) <= 128  # 100 rounded to the nearest size
    assert toks0 == toks1
    for a, b in zip(kv0, kv1):
        assert rel_err(b, a) <= TOL


def test_capture_failure_warns_and_runs_chunks_eagerly(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _load(model_dir)
    strategy = model.strategy_for_forward()
    strategy.graph_safe = True
    runner = strategy.graph_cache["runner"] = StepGraphs(strategy, capture=True)

    def refuse(self: StepGraphs, step: object) -> None:  # a failing capture on any machine, GPU or not
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(StepGraphs, "_capture", refuse)
    eager, graphed = _random_cache(model, 2)
    ids = torch.randint(3, 320, (1, 20), generator=torch.Generator().manual_seed(4))
    model.forward_batch(ids, paged_batch([([3, 7], 5, 20)], eager, CPU, PAGE), preprocess_only=True)
    assert model.chunk_buckets() == CHUNK_BUCKETS
    with pytest.warns(UserWarning, match="prompt chunks run eagerly"):
        model.prefill_chunk(ids, paged_batch([([3, 7], 5, 20)], graphed, CPU, PAGE))
    assert runner.chunks_failed and model.chunk_buckets() == () and not any(k[5] for k in runner.steps)
    for a, b in zip(eager.all_tensors(), graphed.all_tensors()):
        assert rel_err(b, a) <= TOL
    assert RuntimeOptions.from_env({}).prefill_graphs  # on by default
    assert not RuntimeOptions.from_env({"EXLPY_PREFILL_GRAPHS": "0"}).prefill_graphs
    with use_options(RuntimeOptions.from_env({"EXLPY_PREFILL_GRAPHS": "0"})):
        runner.chunks_failed = False
        assert model.chunk_buckets() == ()


@pytest.mark.gpu
@requires_cuda
def test_captured_chunk_equals_eager_cuda(model_dir: Path) -> None:
    model = _load(model_dir, "cuda:0")
    if not model.strategy_for_forward().graph_safe:
        pytest.skip("Triton kernels unavailable: graphs are off")
    eager, graphed = _random_cache(model, 5)
    dev = torch.device("cuda:0")
    g = torch.Generator().manual_seed(6)
    for start, n, table in ((5, 20, [3, 7]), (25, 37, [3, 7, 12, 9]), (0, 63, [14, 2, 5, 6]), (30, 18, [14, 2, 5])):
        ids = torch.randint(3, 320, (1, n), generator=g)
        model.forward_batch(ids, paged_batch([(table, start, n)], eager, dev, PAGE), preprocess_only=True)
        model.prefill_chunk(ids, paged_batch([(table, start, n)], graphed, dev, PAGE))
        for a, b in zip(eager.all_tensors(), graphed.all_tensors()):
            assert rel_err(b.float(), a.float()) <= 2e-2
    runner = model.strategy.graph_cache["runner"]
    chunk_steps = [s for s in runner.steps.values() if s.chunk]
    assert not runner.chunks_failed and len(chunk_steps) == 3  # (32, 2), (64, 4), (32, 4)
    assert all(s.captured for s in chunk_steps)
    tok = torch.tensor([[7]])
    table = [3, 7, 12, 9]
    model.config.no_graphs = True
    ref = model.forward_batch(tok, paged_batch([(table, 62, 1)], eager, dev, PAGE))
    out = model.forward_batch(tok, paged_batch([(table, 62, 1)], graphed, dev, PAGE))
    model.config.no_graphs = False
    assert rel_err(out, ref) <= 2e-2


def test_warmup_runs_every_captured_chunk_shape() -> None:
    """The serving warm-up's chunk phase runs each planned (bucket, width) chunk through the runner (its body on
    the CPU here; captured on a GPU) over scratch pages; the generator works normally afterwards."""
    model, tok = _graph_model_cpu()
    gen = ExLlamaV2DynamicGenerator(model, ExLlamaV2Cache(model, max_seq_len=2 * 256), tok, max_batch_size=2,
                                    max_chunk_size=256)
    plan = plan_shapes(gen.max_batch_size, gen.max_seq_len, gen.page_size, gen.max_chunk_size, gen.num_pages)
    warm_chunks(gen, plan.chunks)
    runner = model.strategy_for_forward().graph_cache["runner"]
    assert {(k[2], k[3]) for k in runner.steps if k[5]} == {(n, w) for n in CHUNK_BUCKETS for w in (1, 2)}
    gen.page_table.reset()
    job = ExLlamaV2DynamicJob(torch.tensor([[1, 5, 9, 13]]), 6, stop_conditions=[],
                              gen_settings=ExLlamaV2Sampler.Settings.greedy())
    gen.enqueue(job)
    while gen.num_remaining_jobs():
        gen.iterate()
    assert job.new_tokens == 6


@pytest.mark.interpreter
@pytest.mark.parametrize("quant", [False, True])
def test_padded_chunk_with_triton_kernels(monkeypatch: pytest.MonkeyPatch, quant: bool) -> None:
    """The attention kernels themselves (Triton's interpreter on CPU tensors) on a padded chunk: the flash kernel
    bounds each query by its own position and the row's length, the quantized store skips slot -1, and the
    quantized attention reads the chunk's own K/V only up to the row's length."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need TRITON_INTERPRET=1 before triton is imported")
    pytest.importorskip("triton")
    from exlpy.cache import ExLlamaV2Cache_Q4
    from tests.test_attend_flash import _with_kernels

    config = ExLlamaV2Config(str(shared_path("models", "tiny-llama-fp16")))
    config.max_seq_len = 64
    model = ExLlamaV2(config)
    model.load(device="cpu")
    _with_kernels(monkeypatch)
    runner = StepGraphs(model.strategy_for_forward(), capture=False)
    cls = ExLlamaV2Cache_Q4 if quant else ExLlamaV2Cache
    eager, graphed = cls(model, batch_size=4), cls(model, batch_size=4)
    g = torch.Generator().manual_seed(7)
    for start, n, table in ((0, 20, [3, 7]), (20, 37, [3, 7, 12, 9])):
        ids = torch.randint(3, 500, (1, n), generator=g)
        model.forward_batch(ids, paged_batch([(table, start, n)], eager, CPU, PAGE), preprocess_only=True)
        batch = paged_batch([(table, start, n)], graphed, CPU, PAGE)
        batch.logits = "none"
        assert runner.run_chunk(ids, batch)
        for a, b in zip(eager.all_tensors(), graphed.all_tensors()):
            assert torch.equal(a, b) if not a.is_floating_point() else rel_err(b, a) <= 1e-4
    tok = torch.tensor([[7]])
    ref = model.forward_batch(tok, paged_batch([([3, 7, 12, 9], 57, 1)], eager, CPU, PAGE))
    out = model.forward_batch(tok, paged_batch([([3, 7, 12, 9], 57, 1)], graphed, CPU, PAGE))
    assert rel_err(out, ref) <= 1e-4
    model.unload()
