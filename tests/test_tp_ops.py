"""What each tensor-parallel lane runs (torch profiler on CPU "devices"), and the step metadata the graphs
upload: one fused q/k/v GEMM + o_proj per lane per attention block, gate/up + down per MLP block."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from exlpy import ExLlamaV2, ExLlamaV2Config
from exlpy.model.batch import build_batch, contiguous_batch
from exlpy.runtime import RuntimeOptions

sys.path.insert(0, str(Path(__file__).parent))
from tp_util import make_model_dir  # noqa: E402

MATMULS = ("aten::linear", "aten::addmm", "aten::mm", "aten::matmul", "aten::bmm")


def load_tp(m: ExLlamaV2, split: list[float], **kw: object) -> None:
    m.load_tp(split, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> ExLlamaV2:
    d = make_model_dir(tmp_path_factory.mktemp("tpops") / "m", hidden=256, heads=4, kv_heads=2, vocab=640,
                       intermediate=512, layers=2, seed=5)
    m = ExLlamaV2(ExLlamaV2Config(str(d)))
    load_tp(m, [1, 1], devices=["cpu", "cpu"])
    return m


def _top_matmuls(ev: object) -> int:
    """Matmul ops directly issued under `ev` (nested aten calls of one matmul count once)."""
    n = 0
    for c in ev.cpu_children:  # type: ignore[attr-defined]
        n += 1 if c.name in MATMULS else _top_matmuls(c)
    return n


@torch.inference_mode()
def test_block_op_counts(model: ExLlamaV2, monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = model.tp_context
    lanes = model.strategy.stages[0].lanes
    kinds = ["embed", "attn", "mlp", "attn", "mlp", "norm", "head"]

    def wrap(label: str, fn: object) -> object:
        async def run(x: torch.Tensor, batch: object) -> object:
            with record_function(label):
                return await fn(x, batch)  # type: ignore[operator]
        return run

    for k, lane in enumerate(lanes):
        assert [type(m).__name__ for m in lane.modules] == ["Embedding", "Attention", "MLP", "Attention", "MLP",
                                                            "RMSNorm", "Head"]
        for i, m in enumerate(lane.modules):
            monkeypatch.setattr(m, "forward", wrap(f"{kinds[i]}{i}.slot{k}", m.forward))
    ids = torch.randint(0, 640, (1, 6), generator=torch.Generator().manual_seed(0))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model.forward(ids, last_id_only=True)
    counts: dict[str, int] = {}
    for ev in prof.events():
        if ev.name[:4] in ("embe", "attn", "mlp1", "mlp2", "mlp4", "norm", "head"):
            counts[ev.name] = _top_matmuls(ev)
    # Fused q/k/v + o_proj, fused gate/up + down_proj, one head slice per vocabulary slot.
    vocab_slots = {s for s, _, _ in ctx.vc_split}  # a small vocabulary stays on one slot (minimum share)
    expect = {}
    for k in (0, 1):
        for i, kind in enumerate(kinds):
            n = {"embed": 0, "norm": 0, "head": int(k in vocab_slots)}.get(kind, 2)
            expect[f"{kind}{i}.slot{k}"] = n
    assert counts == expect


def test_step_metadata_for_contiguous_rows() -> None:
    """The packed metadata (positions / cache slots / key counts) every strategy's step uploads equals the
    per-row arithmetic of a contiguous cache; padding rows write nowhere and read nothing."""
    B, S = 3, 40
    b = contiguous_batch(B, 1, 17, object(), S, torch.device("cpu"))
    assert torch.equal(b.positions, torch.full((B, 1), 17))
    assert torch.equal(b.slots, (torch.arange(B) * S + 17).view(B, 1))
    assert torch.equal(b.seqlens, torch.full((B,), 18))
    padded = build_batch([17] * B, 1, torch.device("cpu"), cache=object(), tables=[[r] for r in range(B)],
                         page_size=S, rows=4, width=2)
    assert torch.equal(padded.slots[:B], b.slots) and padded.slots[B:].eq(-1).all()
    assert padded.seqlens[B:].eq(0).all() and padded.block_table.shape == (4, 2)


def test_first_slot_without_mlp_share(tmp_path: Path) -> None:
    """The first slot adds the residual in its closing GEMM; with no intermediate / vocabulary share (its budget
    went to the cache) it passes the residual on unchanged and the sum is still exact."""
    d = make_model_dir(tmp_path / "m", hidden=192, heads=6, kv_heads=3, vocab=1600, intermediate=768, seed=9)
    ids = torch.randint(0, 1600, (2, 5), generator=torch.Generator().manual_seed(2))
    ref = ExLlamaV2(ExLlamaV2Config(str(d)))
    ref.load(device="cpu")
    m = ExLlamaV2(ExLlamaV2Config(str(d)))
    # 2.2M tokens of cache are ~1.6 GiB; slot 0 holds 2 of 3 KV heads, so its 1 GiB budget is used up.
    load_tp(m, [1, 1], devices=["cpu", "cpu"], expect_cache_tokens=2_200_000)
    ctx = m.tp_context
    assert [s for s, _, _ in ctx.id_split] == [1] and [s for s, _, _ in ctx.vc_split] == [1]
    assert [b - a for _, a, b in ctx.kv_split] == [2, 1]
    torch.testing.assert_close(m.forward(ids), ref.forward(ids), atol=2e-5, rtol=1e-5)


@torch.inference_mode()
def test_decode_launches_per_layer(model: ExLlamaV2) -> None:
    """Kernels per GPU of one TP decode step (benchmarks/tp_launches.py's model of the CUDA path): at one row
    norm + q|k|v GEMV, RoPE + cache write, split-K attention (2), o_proj GEMV (+ residual on the first GPU),
    all-reduce; norm + gate|up + SwiGLU GEMV, down GEMV, all-reduce. At 32 rows the norms and SwiGLU are
    kernels of their own. The vocabulary-parallel lookup is one kernel before its all-reduce."""
    from benchmarks.tp_launches import count_launches, per_layer
    from exlpy.cache.tp import ExLlamaV2Cache_TP

    for rows, attn, mlp in ((1, 6, 3), (32, 7, 5)):
        cache = ExLlamaV2Cache_TP(model, batch_size=rows, max_seq_len=32)
        ids = torch.randint(3, 640, (rows, 6), generator=torch.Generator().manual_seed(rows))
        model.forward(ids[:, :-1], cache, preprocess_only=True)
        counts = count_launches(model, lambda c=cache, i=ids: model.forward(i[:, -1:], c))
        for lane in ("lane0", "lane1"):
            for layer in (0, 1):
                assert per_layer(counts, lane, layer) == {"attn": attn, "mlp": mlp, "collectives": 2}
            assert counts[lane]["embed"] == {"kernels": 2, "collectives": 1, "syncs": 0}
            assert all(v["syncs"] == 0 for v in counts[lane].values())


@torch.inference_mode()
def test_norm_fused_into_the_all_reduce(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend that fuses the next block's RMSNorm into the all-reduce (the host-memory kernel; here the
    CPU backend flagged so, whose group runs all-reduce + norm): every closer but the last MLP's links the
    next norm, batched decode logits equal the unfused model's bit for bit, one-row steps and prefill keep
    the plain all-reduce, and a batched layer costs one kernel less per block."""
    from benchmarks.tp_launches import count_launches, per_layer
    from exlpy.cache.tp import ExLlamaV2Cache_TP
    from exlpy.model.parallel_linear import RowParallel
    from exlpy.parallel.tp_comm import LocalComm

    d = make_model_dir(tmp_path / "m", hidden=256, heads=4, kv_heads=2, vocab=640, intermediate=512, layers=2,
                       seed=5)
    plain = ExLlamaV2(ExLlamaV2Config(str(d)))
    load_tp(plain, [1, 1], devices=["cpu", "cpu"])
    monkeypatch.setattr(LocalComm, "fuses_norm", True, raising=False)
    fused = ExLlamaV2(ExLlamaV2Config(str(d)))
    load_tp(fused, [1, 1], devices=["cpu", "cpu"], options=RuntimeOptions(tp_fuse_norm=True))
    for lane in fused.strategy.stages[0].lanes:
        closers = [m.o_proj if hasattr(m, "o_proj") else m.down_proj for m in lane.modules[1:5]]
        assert all(isinstance(c, RowParallel) and c.next_norm is not None for c in closers)
        assert closers[0].next_norm[0] is lane.modules[2].norm_w  # o_proj -> the MLP's norm
        assert closers[3].next_norm[0] is lane.modules[5].weight  # the last down_proj -> the final norm
    assert all(m.down_proj.next_norm is None for m in plain.strategy.stages[0].lanes[0].modules[2:5:2])
    off = ExLlamaV2(ExLlamaV2Config(str(d)))
    load_tp(off, [1, 1], devices=["cpu", "cpu"])  # the default until the fused norm has run on two GPUs
    assert all(m.o_proj.next_norm is None for m in off.strategy.stages[0].lanes[0].modules[1:5:2])
    g = torch.Generator().manual_seed(4)
    for rows in (1, 4):
        ids = torch.randint(3, 640, (rows, 12), generator=g)
        outs = []
        for m in (plain, fused):
            cache = ExLlamaV2Cache_TP(m, batch_size=rows, max_seq_len=32)
            m.forward(ids[:, :8], cache, preprocess_only=True)
            outs.append(torch.cat([m.forward(ids[:, k:k + 1], cache) for k in range(8, 12)], 1))
        assert torch.equal(outs[0], outs[1])
    cache = ExLlamaV2Cache_TP(fused, batch_size=4, max_seq_len=32)
    fused.forward(ids[:, :8], cache, preprocess_only=True)
    counts = count_launches(fused, lambda: fused.forward(ids[:, 8:9], cache))
    # 7 and 5 unfused; the first attention's input comes from the embedding's all-reduce, which stays plain
    assert per_layer(counts, "lane0", 1) == {"attn": 6, "mlp": 4, "collectives": 2}
    assert per_layer(counts, "lane1", 0) == {"attn": 7, "mlp": 4, "collectives": 2}
    assert "norm" not in counts["lane0"]  # the final norm launched nothing: it came with the last sum
