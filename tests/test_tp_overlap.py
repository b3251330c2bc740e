"""Row-chunked closing projections under tensor parallelism (RuntimeOptions.tp_overlap_chunks, EXLPY_TP_OVERLAP):
each chunk's all-reduce begins on a side stream while the next chunk's GEMM runs.

On CPU "devices" the chunking and the start / join protocol are checked against the unchunked TP forward (a started
all-reduce runs at once there); on two GPUs the side streams, against the unchunked TP path and one GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from exlpy import ExLlamaV2, ExLlamaV2Config
from exlpy.cache.tp import ExLlamaV2Cache_TP
from exlpy.errors import ConfigError
from exlpy.model import parallel_linear
from exlpy.runtime import RuntimeOptions

sys.path.insert(0, str(Path(__file__).parent))
from tp_util import PrefillCase, make_model_dir, prefill_as_reference  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("tpov") / "m", vocab=640)


def _tp_cpu(d: Path, chunks: int) -> ExLlamaV2:
    m = ExLlamaV2(ExLlamaV2Config(str(d)))
    m.load_tp([1, 1], devices=["cpu", "cpu"], options=RuntimeOptions(tp_overlap_chunks=chunks))
    return m


def _log_kinds(m: ExLlamaV2) -> list[str]:
    """The collectives the lanes meet, in order (op kind, with the message's rows for started sums)."""
    group = m.strategy.stages[0].group
    log: list[str] = []
    real = group.run

    def run(ops: list) -> list:  # noqa: ANN001
        op = ops[0]
        log.append(f"{op.kind}:{op.tensor.numel() // op.tensor.shape[-1]}" if op.kind == "start" else op.kind)
        return real(ops)

    group.run = run  # type: ignore[method-assign]
    return log


def test_option_parsed() -> None:
    assert RuntimeOptions.from_env({}).tp_overlap_chunks == 2
    assert RuntimeOptions.from_env({"EXLPY_TP_OVERLAP": "4"}).tp_overlap_chunks == 4
    for bad in ("0", "17", "two"):
        with pytest.raises(ConfigError, match="EXLPY_TP_OVERLAP"):
            RuntimeOptions.from_env({"EXLPY_TP_OVERLAP": bad})


@pytest.mark.parametrize("chunks", [2, 3])
@torch.inference_mode()
def test_chunked_equals_unchunked(model_dir: Path, chunks: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 2 x 21-token prefill (42 rows) with 8-row minimum chunks: every closing projection runs `chunks` GEMMs, each
    followed by a started all-reduce of its rows, then one join; logits, the cache and the decode steps after it
    equal the unchunked TP model's. Decode steps (2 rows) never chunk."""
    monkeypatch.setattr(parallel_linear, "OVERLAP_MIN_ROWS", 8)
    ids = torch.randint(3, 640, (2, 21), generator=torch.Generator().manual_seed(0))
    plain = _tp_cpu(model_dir, 1)
    plain_log = _log_kinds(plain)
    c0 = ExLlamaV2Cache_TP(plain, batch_size=2, max_seq_len=64)
    ref = plain.forward(ids, c0)
    ref_next = [plain.forward(ids[:, k:k + 1], c0) for k in range(3)]
    assert not any(k.startswith("start") for k in plain_log)

    m = _tp_cpu(model_dir, chunks)
    log = _log_kinds(m)
    c = prefill_as_reference(m, ids, ref, c0)
    rows = [42 * i // chunks for i in range(chunks + 1)]
    per_block = [f"start:{b - a}" for a, b in zip(rows, rows[1:])] + ["join"]
    # 2 layers x (attention, MLP): each closes with the chunked sum; the embedding's all-reduce stays whole
    assert log.count("join") == 4 and log[log.index("join") - chunks:log.index("join") + 1] == per_block
    assert [k for k in log if k.startswith("start")] == [k for k in per_block if k != "join"] * 4
    log.clear()
    nxt = [m.forward(ids[:, k:k + 1], c) for k in range(3)]
    assert not any(k.startswith("start") or k == "join" for k in log)
    for x, y in zip(nxt, ref_next):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-5)


@torch.inference_mode()
def test_short_prompts_stay_whole(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Below two minimum chunks of rows nothing chunks; above, the chunks are capped at rows // minimum (50 rows, 16
    at least: 3 chunks, not the 8 asked for)."""
    monkeypatch.setattr(parallel_linear, "OVERLAP_MIN_ROWS", 16)
    m = _tp_cpu(model_dir, 8)
    log = _log_kinds(m)
    c = ExLlamaV2Cache_TP(m, batch_size=1, max_seq_len=64)
    m.forward(torch.randint(3, 640, (1, 31), generator=torch.Generator().manual_seed(1)), c)
    assert "join" not in log
    log.clear()
    c.current_seq_len = 0
    m.forward(torch.randint(3, 640, (1, 50), generator=torch.Generator().manual_seed(1)), c)
    assert [k for k in log if k.startswith("start")][:4] == ["start:16", "start:17", "start:17", "start:16"]


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@torch.inference_mode()
def test_overlapped_prefill_two_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp16 on two GPUs, sums on the side streams beside the next chunk's GEMM: a 600-token prefill of 2 rows in
    2 and 4 chunks (300-row minimum) gives the unchunked TP model's logits and the one-GPU model's within fp16
    tolerance, and the decode steps after it too."""
    monkeypatch.setattr(parallel_linear, "OVERLAP_MIN_ROWS", 300)
    case = PrefillCase(tmp_path, n_steps=8)
    outs = {}
    for chunks in (1, 2, 4):
        m = case.load_tp(RuntimeOptions(tp_overlap_chunks=chunks))
        log = _log_kinds(m)
        outs[chunks] = case.run(m, case.tp_cache(m))
        assert log.count("join") == (0 if chunks == 1 else 6)  # 3 layers x 2 blocks
        assert sum(k.startswith("start") for k in log) == (0 if chunks == 1 else 6 * chunks)
        m.unload()
    for chunks in (2, 4):
        case.assert_close_to_one_gpu(outs[chunks])
        torch.testing.assert_close(outs[chunks][0], outs[1][0], atol=2e-2, rtol=0)
