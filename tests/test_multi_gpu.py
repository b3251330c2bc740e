"""Two GPUs: tensor-parallel decode graphs (the whole step with the peer or NCCL collectives inside) equal
eager TP decode and the single-GPU model; a layer-split model's per-device graphs equal its eager decode. Needs two CUDA
devices; skipped elsewhere."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config
from exlpy.cache.tp import ExLlamaV2Cache_TP
from exlpy.parallel.tp_comm import LocalComm
from exlpy.runtime import RuntimeOptions

sys.path.insert(0, str(Path(__file__).parent))
from tp_util import make_model_dir  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


def _decode(model: ExLlamaV2, cache: object, ids: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of each decode step after prefilling `ids`, fed the given `tokens` [B, steps] (teacher forcing:
    a near-tie argmax flip in one run must not send the runs down different paths)."""
    model.forward(ids[:, :-1], cache, preprocess_only=True)
    out = [model.forward(ids[:, -1:], cache)[:, -1].float().cpu()]
    for t in range(tokens.shape[1] - 1):
        out.append(model.forward(tokens[:, t:t + 1], cache)[:, -1].float().cpu())
    return torch.stack(out, 1)


def _tokens(vocab: int, steps: int) -> torch.Tensor:
    return torch.randint(3, vocab, (2, steps), generator=torch.Generator().manual_seed(9))


def _runner_steps(m: ExLlamaV2) -> list[object]:
    runner = m.strategy.graph_cache.get("runner") if m.strategy is not None else None
    return [] if runner is None else list(runner.steps.values())


@pytest.mark.parametrize("comm", ["peer", "nccl", "local", "hostmem"])
def test_tp_graph_decode_equals_eager(tmp_path: Path, comm: str) -> None:
    """The whole TP decode step (vocab-parallel embedding, every all-reduce, the logits gather) as one graph
    per GPU with peer, NCCL or host-memory collectives; the local backend cannot be captured and runs eagerly."""
    if comm == "peer" and not torch.cuda.can_device_access_peer(0, 1):
        pytest.skip("no P2P access between GPUs 0 and 1 (the peer all-reduce needs it; nvidia-h100-x2 had none)")
    d = make_model_dir(tmp_path / "m", hidden=512, heads=8, kv_heads=2, head_dim=64, intermediate=1024,
                       vocab=3000, layers=3, dtype=torch.float16, seed=5)
    ids = torch.randint(3, 3000, (2, 17), generator=torch.Generator().manual_seed(0))

    single = ExLlamaV2(ExLlamaV2Config(str(d)))
    single.load()
    ref = _decode(single, ExLlamaV2Cache(single, batch_size=2, max_seq_len=64), ids, _tokens(3000, 12))
    single.unload()

    m = ExLlamaV2(ExLlamaV2Config(str(d)))
    m.load_tp([1, 1], options=RuntimeOptions(tp_comm=comm))
    ctx = m.tp_context
    assert ctx.comm.name == comm
    cache = ExLlamaV2Cache_TP(m, batch_size=2, max_seq_len=64)
    graphed = _decode(m, cache, ids, _tokens(3000, 12))
    steps = _runner_steps(m)
    if comm == "local":
        assert not m.strategy.graph_safe and not steps
    else:
        assert len(steps) == 1 and all(ls.graph is not None for _, lanes in steps[0].stages for ls in lanes)
        assert len(steps[0].stages[0][1]) == 2  # one graph per GPU
    cache.reset()
    m.config.no_graphs = True
    eager = _decode(m, cache, ids, _tokens(3000, 12))
    m.config.no_graphs = False
    torch.testing.assert_close(graphed, eager, atol=2e-3, rtol=0)
    torch.testing.assert_close(graphed, ref, atol=2e-2, rtol=0)
    m.unload()


def test_split_model_graph_decode_equals_eager(tmp_path: Path) -> None:
    """Layers split over 2 GPUs: one graph per device segment, the hidden state hopped between replays."""
    d = make_model_dir(tmp_path / "m", hidden=512, heads=8, kv_heads=2, head_dim=64, intermediate=1024,
                       vocab=3000, layers=4, dtype=torch.float16, seed=6)
    ids = torch.randint(3, 3000, (2, 17), generator=torch.Generator().manual_seed(1))
    m = ExLlamaV2(ExLlamaV2Config(str(d)))
    m.load(gpu_split=[0.016, 10])  # 16 MB on GPU 0: the embedding and layers 0-1 (exlpy plan), the rest on 1
    assert {str(x.device) for x in m.modules} == {"cuda:0", "cuda:1"}
    cache = ExLlamaV2Cache(m, batch_size=2, max_seq_len=64)
    graphed = _decode(m, cache, ids, _tokens(3000, 12))
    assert m.strategy.graph_safe and len(m.strategy.stages) >= 2
    steps = _runner_steps(m)
    assert steps and all(ls.graph is not None for st in steps for _, lanes in st.stages for ls in lanes)
    cache.current_seq_len = 0
    m.config.no_graphs = True
    eager = _decode(m, cache, ids, _tokens(3000, 12))
    torch.testing.assert_close(graphed, eager, atol=2e-3, rtol=0)
    m.unload()


def _capture_per_gpu(devs: list[torch.device], fn: Callable[[], None]) -> list[torch.cuda.CUDAGraph]:
    """One CUDA graph per device, all capturing the one call fn() (a collective that launches on each device's
    current stream; relaxed mode: the other devices' captures are open meanwhile)."""
    streams = [torch.cuda.Stream(d) for d in devs]
    prev = [torch.cuda.current_stream(d) for d in devs]
    graphs = [torch.cuda.CUDAGraph() for _ in devs]
    for gr, d, s in zip(graphs, devs, streams):
        with torch.cuda.device(d):
            torch.cuda.set_stream(s)
            gr.capture_begin(capture_error_mode="relaxed")
    fn()
    for gr, d, p in zip(graphs, devs, prev):
        with torch.cuda.device(d):
            gr.capture_end()
            torch.cuda.set_stream(p)
    return graphs


def _replay(graphs: list[torch.cuda.CUDAGraph], devs: list[torch.device]) -> None:
    for gr, d in zip(graphs, devs):
        with torch.cuda.device(d):
            gr.replay()


@pytest.mark.parametrize("shape", [(1, 8192), (3, 1000), (64, 8192), (5, 7)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_peer_all_reduce_equals_reference(shape: tuple[int, int], dtype: torch.dtype) -> None:
    from exlpy.kernels import reference
    from exlpy.kernels.peer_allreduce import PeerState, peer_all_reduce
    from exlpy.parallel.tp_comm import peer_comm

    devs = [torch.device("cuda", i) for i in range(2)]
    if peer_comm(devs, LocalComm()) is None:
        pytest.skip("no P2P access between the two GPUs")
    state = PeerState(devs)
    g = torch.Generator().manual_seed(shape[0] * 31 + shape[1])
    for _ in range(20):  # repeated calls advance the per-program epochs in step on both GPUs
        xs = [torch.randn(shape, generator=g).to(d, dtype) for d in devs]
        want = [x.clone() for x in xs]
        reference.peer_all_reduce(want)
        peer_all_reduce(xs, state)
        for x, w in zip(xs, want):
            torch.testing.assert_close(x, w, atol=1e-2 if dtype != torch.float32 else 1e-5, rtol=1e-2)
    assert state.error_count() == 0


@pytest.mark.parametrize("shape", [(1, 8192), (3, 1000), (64, 8192)])
def test_host_all_reduce_two_gpus(shape: tuple[int, int]) -> None:
    """The host-memory all-reduce between two GPUs (with or without P2P) equals the reference bit for bit,
    eagerly over 20 calls and captured in one graph per GPU over 30 replays."""
    from exlpy.kernels import reference
    from exlpy.kernels.host_allreduce import HostState, host_all_reduce

    devs = [torch.device("cuda", i) for i in range(2)]
    state = HostState(devs)
    g = torch.Generator().manual_seed(shape[0] * 13 + shape[1])
    for _ in range(20):
        xs = [torch.randn(shape, generator=g).to(d, torch.float16) for d in devs]
        want = [x.clone() for x in xs]
        reference.host_all_reduce(want)
        host_all_reduce(xs, state)
        for x, w in zip(xs, want):
            assert torch.equal(x.cpu(), w.cpu())
    for d in devs:
        torch.cuda.synchronize(d)
    graphs = _capture_per_gpu(devs, lambda: host_all_reduce(xs, state))
    for _ in range(30):
        src = [torch.randn(shape, generator=g).half() for _ in devs]
        for x, v in zip(xs, src):
            x.copy_(v)
        _replay(graphs, devs)
        want = (src[0].float() + src[1].float()).half()
        for x in xs:
            assert torch.equal(x.cpu(), want)
    assert state.error_count() == 0


@pytest.mark.parametrize("kernel", ["host", "peer"])
@pytest.mark.parametrize("rows", [2, 32])
def test_all_reduce_norm_two_gpus(rows: int, kernel: str) -> None:
    """The fused all-reduce + RMSNorm between two GPUs (through host memory, or peer memory where P2P works):
    sums equal the reference, norms equal each GPU's RMSNorm kernel of the sum, bit for bit (10 calls)."""
    from exlpy.kernels import ops, reference
    from exlpy.kernels.host_allreduce import NORM_MAXN, NORM_ROWS, HostState, host_all_reduce_norm
    from exlpy.kernels.peer_allreduce import PeerState, peer_all_reduce_norm
    from exlpy.parallel.tp_comm import peer_comm

    devs = [torch.device("cuda", i) for i in range(2)]
    if kernel == "peer":
        if peer_comm(devs, LocalComm()) is None:
            pytest.skip("no P2P access between the two GPUs")
    state = PeerState(devs, NORM_ROWS, NORM_MAXN) if kernel == "peer" else HostState(devs, NORM_ROWS, NORM_MAXN)
    fused = peer_all_reduce_norm if kernel == "peer" else host_all_reduce_norm  # the same contract
    g = torch.Generator().manual_seed(rows)
    w = torch.rand(8192, generator=g).half() + 0.5
    ws = [w.to(d) for d in devs]
    for _ in range(10):
        xs = [torch.randn(rows, 8192, generator=g).to(d, torch.float16) for d in devs]
        want = [x.clone() for x in xs]
        reference.host_all_reduce(want)
        hs = fused(xs, ws, 1e-5, state)  # type: ignore[arg-type]
        for x, h, wx, wd in zip(xs, hs, want, ws):
            assert torch.equal(x, wx)
            with torch.cuda.device(x.device):
                assert torch.equal(h, ops.rms_norm(wx, wd, 1e-5))
    assert state.error_count() == 0


def test_peer_all_reduce_in_graphs() -> None:
    """Captured once per GPU, replayed many times: fresh inputs each replay, right sums each time."""
    from exlpy.kernels.peer_allreduce import PeerState, peer_all_reduce
    from exlpy.parallel.tp_comm import peer_comm

    devs = [torch.device("cuda", i) for i in range(2)]
    if peer_comm(devs, LocalComm()) is None:
        pytest.skip("no P2P access between the two GPUs")
    state = PeerState(devs)
    xs = [torch.zeros(2, 8192, device=d, dtype=torch.float16) for d in devs]
    peer_all_reduce(xs, state)  # compile outside the capture
    for d in devs:
        torch.cuda.synchronize(d)
    graphs = _capture_per_gpu(devs, lambda: peer_all_reduce(xs, state))
    gen = torch.Generator().manual_seed(4)
    for _ in range(50):
        src = [torch.randn(2, 8192, generator=gen).half() for _ in devs]
        for x, v in zip(xs, src):
            x.copy_(v)
        _replay(graphs, devs)
        want = (src[0].float() + src[1].float()).half()
        for x in xs:
            torch.testing.assert_close(x.cpu(), want, atol=1e-2, rtol=1e-2)
    assert state.error_count() == 0


def test_split_model_paged_graph_decode_equals_eager(tmp_path: Path) -> None:
    """The generators' paged decode on a split model: per-step metadata mirrored to the second GPU's graph."""
    from exlpy.model.batch import ForwardBatch

    d = make_model_dir(tmp_path / "m", hidden=512, heads=8, kv_heads=2, head_dim=64, intermediate=1024,
                       vocab=3000, layers=4, dtype=torch.float16, seed=7)
    m = ExLlamaV2(ExLlamaV2Config(str(d)))
    m.load(gpu_split=[0.016, 10])
    g = torch.Generator().manual_seed(3)
    caches = [ExLlamaV2Cache(m, batch_size=4, max_seq_len=64) for _ in range(2)]
    for a, b in zip(caches[0].all_tensors(), caches[1].all_tensors()):
        a.copy_(torch.randn(a.shape, generator=g).to(a.device, a.dtype))
        b.copy_(a)

    def paged(cache: ExLlamaV2Cache, tables: list[list[int]], lens: list[int]) -> ForwardBatch:
        B, width = len(tables), max(len(t) for t in tables)
        bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        pos = torch.tensor(lens).view(B, 1) - 1
        slots = bt.long().gather(1, pos // 16) * 16 + pos % 16
        return ForwardBatch(B, 1, pos, cache=cache, slots=slots, block_table=bt, page_size=16,
                            seqlens=torch.tensor(lens, dtype=torch.int32), max_seqlen=max(lens))

    tables = [[5, 2], [9], [0, 3, 11]]
    for step in range(4):
        lens = [20 + step, 7 + step, 40 + step]
        ids = torch.randint(3, 3000, (3, 1), generator=g)
        m.config.no_graphs = True
        ref = m.forward_batch(ids, paged(caches[0], tables, lens))
        m.config.no_graphs = False
        out = m.forward_batch(ids, paged(caches[1], tables, lens))
        torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), atol=2e-3, rtol=0)
    assert any(len(st.stages) == 2 for st in _runner_steps(m))
    for a, b in zip(caches[0].all_tensors(), caches[1].all_tensors()):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=0)
    m.unload()
