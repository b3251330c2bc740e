"""The step-graph runner's buffer logic, run with its eager body on CPU (and captured on CUDA), for every
strategy: one device, a layer split (cuts stand in for device boundaries) and tensor parallelism."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config
from exlpy.engine.forward import graph_runner
from exlpy.engine.graphs import CAPTURE_TRIES, StepGraphs, bucket_for
from exlpy.engine.split import layer_split
from exlpy.model import Transformer
from exlpy.model.batch import ForwardBatch, paged_batch
from tests.conftest import rel_err, requires_cuda
from tests.hf_models import make_hf_model

TOL = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("graphs_model")
    make_hf_model(path, "llama")  # GQA 4/2 heads
    return path


def _load(path: Path, device: str | None = None) -> ExLlamaV2:
    config = ExLlamaV2Config(str(path))
    config.max_seq_len = 64
    model = ExLlamaV2(config)
    if device is None:
        model.load()
    else:
        for i in range(len(model.modules)):
            model.place_module(i, torch.device(device))
        model.loaded = True
    return model


def _runner(model: ExLlamaV2, cuts: tuple[int, ...] = ()) -> StepGraphs:
    return StepGraphs(layer_split(Transformer(model.modules), cuts), capture=False)


def test_buckets_and_support(model_dir: Path) -> None:
    assert [bucket_for(n) for n in (1, 3, 5, 32, 33)] == [1, 4, 8, 32, 64]
    assert bucket_for(10_000) is None
    model = _load(model_dir, "cpu")
    strategy = model.strategy_for_forward()
    assert not strategy.graph_safe  # CPU: the model runs eagerly
    assert graph_runner(model, strategy) is None


@pytest.mark.parametrize("cuts", [(), (2,), (1, 3)])  # cuts: segments as on a model split over GPUs
def test_contiguous_decode_matches_eager(model_dir: Path, cuts: tuple[int, ...]) -> None:
    model = _load(model_dir)
    prompt = torch.randint(3, 320, (2, 9), generator=torch.Generator().manual_seed(0))
    eager_cache, graph_cache = ExLlamaV2Cache(model, batch_size=2), ExLlamaV2Cache(model, batch_size=2)
    model.forward(prompt, eager_cache, preprocess_only=True)
    model.forward(prompt, graph_cache, preprocess_only=True)
    runner = _runner(model, cuts)
    assert len(runner.strategy.stages) == len(cuts) + 1
    tok = prompt[:, -1:]
    for _ in range(3):
        ref = model.forward(tok, eager_cache)
        past = graph_cache.current_seq_len
        out = runner.run_rows(tok, graph_cache, [past] * 2, None, graph_cache.max_seq_len)
        graph_cache.current_seq_len = past + 1
        assert out is not None and out.shape == ref.shape and rel_err(out, ref) <= TOL
        tok = ref[:, -1].argmax(-1, keepdim=True)
    for a, b in zip(eager_cache.all_tensors(), graph_cache.all_tensors()):
        assert rel_err(a[:, :12], b[:, :12]) <= TOL
    assert len(runner.steps) == 1  # one step per (cache, shape), reused


@pytest.mark.parametrize("cuts", [(), (3,)])
def test_multi_token_step_matches_eager(model_dir: Path, cuts: tuple[int, ...]) -> None:
    """Speculative verification: 4 tokens per row through the same static step (T is part of its shape)."""
    model = _load(model_dir)
    prompt = torch.randint(3, 320, (2, 9), generator=torch.Generator().manual_seed(3))
    eager_cache, graph_cache = ExLlamaV2Cache(model, batch_size=2), ExLlamaV2Cache(model, batch_size=2)
    model.forward(prompt, eager_cache, preprocess_only=True)
    model.forward(prompt, graph_cache, preprocess_only=True)
    runner = _runner(model, cuts)
    draft = torch.randint(3, 320, (2, 4), generator=torch.Generator().manual_seed(4))
    ref = model.forward(draft, eager_cache)
    out = runner.run_rows(draft, graph_cache, [9, 9], None, graph_cache.max_seq_len)
    assert out is not None and out.shape == (2, 4, 320) and rel_err(out, ref) <= TOL
    for a, b in zip(eager_cache.all_tensors(), graph_cache.all_tensors()):
        assert rel_err(a[:, :13], b[:, :13]) <= TOL
    assert runner.run_rows(torch.zeros(2, 9, dtype=torch.long), graph_cache, [13, 13], None, 64) is None


def test_forward_graph_path_builds_no_eager_batch(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _load(model_dir)
    prompt = torch.randint(3, 320, (2, 9), generator=torch.Generator().manual_seed(2))
    eager_cache, graph_cache = ExLlamaV2Cache(model, batch_size=2), ExLlamaV2Cache(model, batch_size=2)
    model.forward(prompt, eager_cache, preprocess_only=True)
    model.forward(prompt, graph_cache, preprocess_only=True)
    tok = prompt[:, -1:]
    ref = model.forward(tok, eager_cache)
    strategy = model.strategy_for_forward()
    strategy.graph_safe = True  # as on a CUDA model; the runner below runs its body eagerly
    strategy.graph_cache["runner"] = StepGraphs(strategy, capture=False)

    def no_eager_batch(*args: object, **kwargs: object) -> None:
        raise AssertionError("the graph path built the eager path's per-step batch")

    monkeypatch.setattr("exlpy.engine.forward.build_batch", no_eager_batch)
    monkeypatch.setattr("exlpy.engine.forward.execute", no_eager_batch)
    out = model.forward(tok.int(), graph_cache)  # int32 ids are copied into the static int64 buffer
    assert graph_cache.current_seq_len == 10 and out.shape == ref.shape and rel_err(out, ref) <= TOL


def _paged(cache: ExLlamaV2Cache, page: int, tables: list[list[int]], lens: list[int]) -> ForwardBatch:
    """One decode token per sequence; `lens` are the lengths after this step."""
    B, width = len(tables), max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    pos = torch.tensor(lens).view(B, 1) - 1
    slots = bt.long().gather(1, pos // page) * page + pos % page
    return ForwardBatch(B, 1, pos, cache=cache, slots=slots, block_table=bt, page_size=page,
                        seqlens=torch.tensor(lens, dtype=torch.int32), max_seqlen=max(lens))


@pytest.mark.parametrize("cuts", [(), (2,)])
def test_paged_decode_matches_eager_and_padding_writes_nothing(model_dir: Path, cuts: tuple[int, ...]) -> None:
    model = _load(model_dir)
    # The contiguous cache [4, 64, H, D] viewed as 16 pages of 16 rows (page p = flat rows p*16..p*16+15).
    g = torch.Generator().manual_seed(1)
    eager_cache = ExLlamaV2Cache(model, batch_size=4)
    for t in eager_cache.all_tensors():
        t.copy_(torch.randn(t.shape, generator=g))
    graph_cache = ExLlamaV2Cache(model, batch_size=4, copy_from=eager_cache)
    runner = _runner(model, cuts)
    tables, lens = [[5, 2], [9], [0, 3, 11]], [20, 7, 40]  # 3 live rows: bucket 4 with one padding row
    ids = torch.randint(3, 320, (3, 1), generator=g)
    ref = model.forward_batch(ids, _paged(eager_cache, 16, tables, lens))
    out = runner.run_batch(ids, _paged(graph_cache, 16, tables, lens))
    assert out is not None and out.shape == (3, 1, 320) and rel_err(out, ref) <= TOL
    for a, b in zip(eager_cache.all_tensors(), graph_cache.all_tensors()):
        assert rel_err(b, a) <= TOL  # same rows written, and the padding row wrote nowhere
    # A 4-row step then a 3-row step in the same bucket: the stale 4th row must not write again.
    ids4 = torch.randint(3, 320, (4, 1), generator=g)
    tables4, lens4 = tables + [[14]], [21, 8, 41, 3]
    model.forward_batch(ids4, _paged(eager_cache, 16, tables4, lens4))
    runner.run_batch(ids4, _paged(graph_cache, 16, tables4, lens4))
    lens3 = [22, 9, 42]
    ref = model.forward_batch(ids, _paged(eager_cache, 16, tables, lens3))
    out = runner.run_batch(ids, _paged(graph_cache, 16, tables, lens3))
    assert out is not None and rel_err(out, ref) <= TOL
    for a, b in zip(eager_cache.all_tensors(), graph_cache.all_tensors()):
        assert rel_err(b, a) <= TOL
    # The same step from host integers (build_batch keeps them): re-packed into the static layout.
    lens4b = [23, 10, 43]
    ref = model.forward_batch(ids, _paged(eager_cache, 16, tables, lens4b))
    built = paged_batch([(t, n - 1, 1) for t, n in zip(tables, lens4b)], graph_cache, torch.device("cpu"), 16)
    out = runner.run_batch(ids, built)
    assert out is not None and rel_err(out, ref) <= TOL
    for a, b in zip(eager_cache.all_tensors(), graph_cache.all_tensors()):
        assert rel_err(b, a) <= TOL


def test_failed_decode_capture_runs_eagerly(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step whose capture fails (on a GPU: CUDA refusing an operation mid-capture) still computes its
    logits, eagerly, with a warning; after CAPTURE_TRIES failures the shape is not captured again."""
    model = _load(model_dir)
    prompt = torch.randint(3, 320, (2, 9), generator=torch.Generator().manual_seed(3))
    eager_cache, graph_cache = ExLlamaV2Cache(model, batch_size=2), ExLlamaV2Cache(model, batch_size=2)
    model.forward(prompt, eager_cache, preprocess_only=True)
    model.forward(prompt, graph_cache, preprocess_only=True)
    runner = StepGraphs(layer_split(Transformer(model.modules), ()), capture=True)
    tries: list[int] = []

    def refuse(self: StepGraphs, step: object) -> None:  # a failing capture on any machine, GPU or not
        # On a GPU model.forward's own graphs (the eager reference's) fail too: only this runner's tries count.
        tries.extend([1] if self is runner else [])
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(StepGraphs, "_capture", refuse)
    tok = prompt[:, -1:]
    for k in range(CAPTURE_TRIES + 2):
        ref = model.forward(tok, eager_cache)
        past = graph_cache.current_seq_len
        with pytest.warns(UserWarning, match="capturing a decode step .* failed") if k < CAPTURE_TRIES else \
                contextlib.nullcontext():
            out = runner.run_rows(tok, graph_cache, [past] * 2, None, graph_cache.max_seq_len)
        graph_cache.current_seq_len = past + 1
        assert out is not None and rel_err(out, ref) <= TOL
        tok = ref[:, -1].argmax(-1, keepdim=True)
    assert len(tries) == runner.capture_failures == CAPTURE_TRIES
    assert not next(iter(runner.steps.values())).captured

    def oom(self: StepGraphs, step: object) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(StepGraphs, "_capture", oom)  # out of memory is the caller's (the warm-up stops there)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        StepGraphs(runner.strategy, capture=True).run_rows(tok, graph_cache, [graph_cache.current_seq_len] * 2,
                                                           None, graph_cache.max_seq_len)


def test_step_rebuilt_when_cache_tensors_change(model_dir: Path) -> None:
    model = _load(model_dir)
    cache = ExLlamaV2Cache(model)
    runner = _runner(model)
    tok = torch.tensor([[5]])
    runner.run_rows(tok, cache, [0], None, cache.max_seq_len)
    first = next(iter(runner.steps.values()))
    cache.key_states[0] = cache.key_states[0].clone()  # e.g. reallocated after a reload
    runner.run_rows(tok, cache, [1], None, cache.max_seq_len)
    assert next(iter(runner.steps.values())) is not first
    model.strategy_for_forward()
    model.unplace_module(1)
    assert model.strategy is None  # the strategy and its graphs went with the moved module


@requires_cuda
def test_captured_graph_equals_eager_cuda(model_dir: Path) -> None:
    model = _load(model_dir, "cuda:0")
    if not model.strategy_for_forward().graph_safe:
        pytest.skip("Triton kernels unavailable: graphs are off")
    prompt = torch.randint(3, 320, (2, 9), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    caches = [ExLlamaV2Cache(model, batch_size=2) for _ in range(2)]
    for c in caches:
        model.forward(prompt, c, preprocess_only=True)
    tok = prompt[:, -1:]
    for _ in range(4):
        model.config.no_graphs = True
        ref = model.forward(tok, caches[0])
        model.config.no_graphs = False
        out = model.forward(tok, caches[1])
        assert rel_err(out, ref) <= 2e-2
        tok = ref[:, -1].argmax(-1, keepdim=True)
    runner = model.strategy.graph_cache["runner"]
    assert all(ls.graph is not None for s in runner.steps.values() for _, lanes in s.stages for ls in lanes)
