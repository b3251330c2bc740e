"""The two-GPU copy all-reduce for prefill-sized messages (exlpy/parallel/tp_copy.py, EXLPY_TP_PREFILL_COMM=copy).

On CPU "devices" the collective's steps (copies issued by `start`, the add by `finish`) and its use by the plain
lock-step runner and the two-micro-batch pipeline are checked against the plain TP forward and the torch sum; on
two GPUs the same with the copy engines and the send / receive streams, against the plain TP path and one GPU."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from exlpy import ExLlamaV2, ExLlamaV2Config
from exlpy.cache.tp import ExLlamaV2Cache_TP
from exlpy.engine import pipeline
from exlpy.errors import ConfigError, TensorParallelError
from exlpy.kernels import reference
from exlpy.parallel import tp_copy
from exlpy.parallel.tp_copy import CopyAllReduce, make_prefill_comm
from exlpy.runtime import RuntimeOptions

sys.path.insert(0, str(Path(__file__).parent))
from tp_util import PrefillCase, make_model_dir, prefill_as_reference  # noqa: E402

CPU2 = [torch.device("cpu")] * 2


def test_sum_is_issued_then_finished() -> None:
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)
    want = a + b
    ta, tb = a.clone(), b.clone()
    comm = CopyAllReduce(CPU2)
    pending = comm.start([ta, tb])
    # Begun, not summed: the partials are untouched until finish (the other micro-batch runs in between).
    assert torch.equal(ta, a) and torch.equal(tb, b)
    assert pending.finish() == [None, None]
    torch.testing.assert_close(ta, want, rtol=0, atol=0)
    assert torch.equal(ta, tb)  # both sides hold the same sum
    with pytest.raises(TensorParallelError, match="finished twice"):
        pending.finish()
    assert torch.equal(ta, want)


def test_sum_with_the_next_norm() -> None:
    """With norms, finish returns each side's RMSNorm of the sum (the next block's input) and leaves the sum."""
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(6, 64, generator=g).half(), torch.randn(6, 64, generator=g).half()
    w = (torch.rand(64, generator=g) + 0.5).half()
    ta, tb = a.clone(), b.clone()
    normed = CopyAllReduce(CPU2).start([ta, tb], [(w, 1e-5), (w, 1e-5)]).finish()
    want = a + b
    assert torch.equal(ta, want) and torch.equal(tb, want)
    for h in normed:
        assert h is not None
        torch.testing.assert_close(h, reference.rms_norm(want, w, 1e-5), rtol=0, atol=0)


def test_add_rms_norm_reference() -> None:
    g = torch.Generator().manual_seed(5)
    x, r = torch.randn(3, 4, 32, generator=g), torch.randn(3, 4, 32, generator=g)
    w = torch.rand(32, generator=g) + 0.5
    x0 = x.clone()
    y = reference.add_rms_norm(x, r, w, 1e-6)
    torch.testing.assert_close(x, x0 + r)  # the sum stays in x: the next residual
    s = (x0 + r).double()
    torch.testing.assert_close(y.double(), s / (s.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * w.double(),
                               rtol=1e-6, atol=1e-6)


def _kernel_case(device: str, rows: int, n: int, seed: int) -> None:
    from exlpy.kernels.rmsnorm import add_rms_norm

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g).half().to(device)
    r = torch.randn(rows, n, generator=g).half().to(device)
    w = (torch.rand(n, generator=g) + 0.5).half().to(device)
    want_x = x.clone()
    want = reference.add_rms_norm(want_x, r, w, 1e-5)
    got_x = x.clone()
    got = add_rms_norm(got_x, r, w, 1e-5)
    assert torch.equal(got_x, want_x)  # the sum rounds as torch's fp16 add does
    assert got.dtype == want.dtype and got.shape == want.shape
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert err < 2e-3, err


@pytest.mark.interpreter
def test_add_rms_norm_kernel_cpu() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need TRITON_INTERPRET=1 before triton is imported")
    pytest.importorskip("triton")
    _kernel_case("cpu", 5, 96, 0)  # a masked row (96 of 128 lanes)
    _kernel_case("cpu", 3, 128, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_add_rms_norm_kernel_cuda() -> None:
    pytest.importorskip("triton")
    _kernel_case("cuda", 2048, 8192, 2)  # a 70B-shaped prefill message
    _kernel_case("cuda", 7, 5120, 3)


def test_applies_from_min_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    comm = CopyAllReduce(CPU2)
    small = [torch.ones(4, 8, dtype=torch.float16) for _ in range(2)]
    monkeypatch.setattr(tp_copy, "MIN_BYTES", 64)
    assert comm.applies(small)
    monkeypatch.setattr(tp_copy, "MIN_BYTES", 65)
    assert not comm.applies(small)
    assert not comm.applies(small[:1])


def test_bad_settings() -> None:
    with pytest.raises(TensorParallelError, match="exactly two GPUs"):
        CopyAllReduce([torch.device("cpu")] * 3)
    with pytest.raises(TensorParallelError, match="EXLPY_TP_PREFILL_COMM"):
        make_prefill_comm(CPU2, "nvls")
    assert make_prefill_comm(CPU2, "default") is None
    with pytest.raises(TensorParallelError, match="unlike partials"):
        CopyAllReduce(CPU2).start([torch.ones(2, 3), torch.ones(3, 2)])
    with pytest.raises(ConfigError, match="EXLPY_TP_PREFILL_COMM"):
        RuntimeOptions.from_env({"EXLPY_TP_PREFILL_COMM": "fast"})
    assert RuntimeOptions.from_env({"EXLPY_TP_PREFILL_COMM": "copy"}).tp_prefill_comm == "copy"
    assert RuntimeOptions.from_env({}).tp_prefill_comm == "default"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("tpcopy") / "m", hidden=192, heads=6, kv_heads=3, vocab=640,
                          intermediate=512, layers=2, seed=7)


def _tp_cpu(d: Path, opts: RuntimeOptions, split: list[float] | None = None) -> ExLlamaV2:
    split = split or [1, 1]
    m = ExLlamaV2(ExLlamaV2Config(str(d)))
    m.load_tp(split, devices=["cpu"] * len(split), options=opts)
    return m


def test_three_devices_refused(model_dir: Path) -> None:
    with pytest.raises(TensorParallelError, match="exactly two GPUs"):
        _tp_cpu(model_dir, RuntimeOptions(tp_prefill_comm="copy"), [1, 1, 1])


class _Spy:
    """Wraps a model's copy collective: what it began and finished, in order (tokens per message)."""

    def __init__(self, comm: CopyAllReduce) -> None:
        self.log: list[tuple[str, int]] = []
        real = comm.start

        def start(tensors: list[torch.Tensor], norms: list | None = None) -> tp_copy.Pending:
            p = real(tensors, norms)
            tokens = tensors[0].shape[1]
            self.log.append(("start", tokens))
            finish = p.finish

            def logged() -> list:
                self.log.append(("finish", tokens))
                return finish()

            p.finish = logged  # type: ignore[method-assign]
            return p

        comm.start = start  # type: ignore[method-assign]


@pytest.mark.parametrize("pipelined", [False, True])
@torch.inference_mode()
def test_forward_equals_plain_tp(model_dir: Path, pipelined: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 21 tokens (as 10 + 11 when pipelined) take the copy collective, one-token steps the decode
    backend; logits, the cache and the steps after the prefill equal the plain TP model's."""
    monkeypatch.setattr(pipeline, "MIN_TOKENS", 4)
    # Between a decode step's message (2 rows x 192 fp32 = 1,536 bytes) and a 10-token micro-batch's (15,360).
    monkeypatch.setattr(tp_copy, "MIN_BYTES", 4096)
    ids = torch.randint(3, 640, (2, 21), generator=torch.Generator().manual_seed(0))
    plain = _tp_cpu(model_dir, RuntimeOptions())
    assert plain.strategy.stages[0].group.prefill is None
    c0 = ExLlamaV2Cache_TP(plain, batch_size=2, max_seq_len=64)
    ref = plain.forward(ids, c0)
    ref_next = [plain.forward(ids[:, k:k + 1], c0) for k in range(3)]

    m = _tp_cpu(model_dir, RuntimeOptions(tp_prefill_comm="copy", tp_pipeline=pipelined))
    comm = m.tp_context.prefill_comm
    assert isinstance(comm, CopyAllReduce) and m.strategy.stages[0].group.prefill is comm
    # Every block's closing sum also norms it for the block after (the last one: the final norm before the head).
    closers = [b.o_proj if hasattr(b, "o_proj") else b.down_proj for lane in m.strategy.stages[0].lanes
               for b in lane.modules if hasattr(b, "o_proj") or hasattr(b, "down_proj")]
    assert len(closers) == 8 and all(c.prefill_norm is not None and c.next_norm is None for c in closers)
    spy = _Spy(comm)
    c = prefill_as_reference(m, ids, ref, c0)
    # Every all-reduce of the prefill went by copies: the embedding's and one per block (2 layers x 2), the blocks'
    # with the next norm.
    if pipelined:
        # Micro-batch A's copies are in flight while B runs up to its own collective: A begins, B begins, then
        # A's sum is finished when A resumes, and so on.
        assert spy.log[:6] == [("start", 10), ("start", 11), ("finish", 10), ("start", 10), ("finish", 11),
                               ("start", 11)]
        assert sorted(spy.log) == sorted([(k, t) for t in (10, 11) for k in ("start", "finish")] * 5)
    else:
        assert spy.log == [("start", 21), ("finish", 21)] * 5
    spy.log.clear()
    nxt = [m.forward(ids[:, k:k + 1], c) for k in range(3)]
    assert not spy.log  # decode-sized messages keep the decode backend
    for x, y in zip(nxt, ref_next):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-5)


@torch.inference_mode()
def test_column_layout_equals_plain_tp(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The column layout (EXL2's: inputs and outputs all-gathered as zero-padded all-reduces) through the copies:
    two all-reduces per block, no norm to fold (the sum is added to the residual after the gather)."""
    monkeypatch.setattr(tp_copy, "MIN_BYTES", 4096)
    ids = torch.randint(3, 640, (2, 21), generator=torch.Generator().manual_seed(2))
    plain = _tp_cpu(model_dir, RuntimeOptions(tp_layout="column"))
    ref = plain.forward(ids, ExLlamaV2Cache_TP(plain, batch_size=2, max_seq_len=64))
    m = _tp_cpu(model_dir, RuntimeOptions(tp_layout="column", tp_prefill_comm="copy"))
    spy = _Spy(m.tp_context.prefill_comm)
    out = m.forward(ids, ExLlamaV2Cache_TP(m, batch_size=2, max_seq_len=64))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    assert spy.log == [("start", 21), ("finish", 21)] * (1 + 2 * 2 * 2)


def _two_gpus() -> list[torch.device]:
    return [torch.device("cuda", 0), torch.device("cuda", 1)]


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_copy_sum_two_gpus() -> None:
    """32 MB fp16 partials: the sum equals torch's on both GPUs, bit for bit, also when each GPU's compute stream
    runs GEMMs between start and finish and the partials were written just before start."""
    devs = _two_gpus()
    comm = CopyAllReduce(devs)
    g = torch.Generator().manual_seed(0)
    host = [torch.randn(2048, 8192, generator=g).half() for _ in devs]
    want = host[0] + host[1]
    for _ in range(3):
        parts = [h.to(d) for h, d in zip(host, devs)]
        for p in parts:  # the partials' last writes are still queued on the compute streams at start
            with torch.cuda.device(p.device):
                p.mul_(2.0).mul_(0.5)
        pending = comm.start(parts)
        busy = []
        for d in devs:
            with torch.cuda.device(d):
                w = torch.randn(4096, 4096, device=d, dtype=torch.float16)
                busy.append(w @ w)
        pending.finish()
        for p in parts:
            assert torch.equal(p.cpu(), want)
        assert all(torch.isfinite(b).all() for b in busy)


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@torch.inference_mode()
def test_copy_prefill_two_gpus(tmp_path: Path) -> None:
    """fp16 on two GPUs: a 600-token prefill with the copy collective (plain and pipelined) gives the plain TP
    model's and the one-GPU model's logits within fp16 tolerance, and the decode steps after it too."""
    case = PrefillCase(tmp_path, n_steps=8)
    outs = {}
    # 600 tokens x 2 rows x 512 x fp16 = 1.2 MB per message (the pipeline's halves: 0.6 MB), below MIN_BYTES:
    # lower the bound so that both ways take the copies (decode steps' 2 KB stay with the decode backend).
    mp = pytest.MonkeyPatch()
    mp.setattr(tp_copy, "MIN_BYTES", 256 << 10)
    try:
        for name, opts in (("plain", RuntimeOptions()), ("copy", RuntimeOptions(tp_prefill_comm="copy")),
                           ("copy_pipelined", RuntimeOptions(tp_prefill_comm="copy", tp_pipeline=True))):
            m = case.load_tp(opts)
            group = m.strategy.stages[0].group
            started: list[int] = []
            if group.prefill is not None:
                real = group.prefill.start
                group.prefill.start = lambda ts, norms=None, real=real, started=started: (
                    started.append(ts[0].shape[1]) or real(ts, norms))
            outs[name] = case.run(m, case.tp_cache(m))
            if name != "plain":  # the embedding's and 3 layers x 2 blocks' all-reduces, per micro-batch
                assert sorted(started) == ([300] * 7 + [300] * 7 if name == "copy_pipelined" else [600] * 7)
            m.unload()
    finally:
        mp.undo()
    for name in ("copy", "copy_pipelined"):
        got = outs[name]
        # fp16 orders of the same sums: held to one GPU and to the plain TP run as tests/test_tp_pipeline.py does
        case.assert_close_to_one_gpu(got)
        torch.testing.assert_close(got[0], outs["plain"][0], atol=2e-2, rtol=0)
