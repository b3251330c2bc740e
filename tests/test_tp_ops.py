"""What each TP stage runs (torch profiler on CPU "devices"), the stage timer, and the decode-graph input
derivation: one fused q/k/v GEMM + o_proj per slot per attention stage, gate/up + down per MLP stage."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from exlpy import ExLlamaV2, ExLlamaV2Config
from exlpy.cache.tp import ExLlamaV2Cache_TP
from exlpy.model.batch import contiguous_batch
from exlpy.parallel.tp_graph import _GraphSet
from exlpy.parallel.tp_layers import Stage
from exlpy.parallel.tp_load import _stage_list, load_tp, make_states, run_stages, stage_labels
from exlpy.parallel.tp_timing import StageTimer, average

sys.path.insert(0, str(Path(__file__).parent))
from tp_util import make_model_dir  # noqa: E402

MATMULS = ("aten::linear", "aten::addmm", "aten::mm", "aten::matmul", "aten::bmm")


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
def test_stage_op_counts(model: ExLlamaV2) -> None:
    ctx = model.tp_context
    assert ctx.modules[0].mode == "row"
    stages, _ = _stage_list(ctx)
    labels = stage_labels(ctx)
    assert labels == ["attn", "mlp", "attn", "mlp", "head"]
    assert [s.then for s in stages] == ["replace"] * 4 + ["out"]

    def wrap(i: int, stage: Stage) -> Stage:
        def fn(st: object) -> torch.Tensor:
            with record_function(f"stage{i}.slot{st.slot}"):  # type: ignore[attr-defined]
                return stage.fn(st)  # type: ignore[arg-type]
        return Stage(fn, stage.then)

    wrapped = [wrap(i, s) for i, s in enumerate(stages)]
    ids = torch.randint(0, 640, (1, 6), generator=torch.Generator().manual_seed(0))
    cache = ExLlamaV2Cache_TP(model, max_seq_len=16)
    batch = contiguous_batch(1, 6, 0, cache, 16, torch.device("cpu"))
    x = model.modules[0].forward(ids, batch)
    states = make_states(ctx, x, batch, last_only=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_stages(ctx, wrapped, states)
    counts: dict[str, int] = {}
    for ev in prof.events():
        if ev.name.startswith("stage"):
            counts[ev.name] = _top_matmuls(ev)
    # Fused q/k/v + o_proj, fused gate/up + down_proj, one head slice per vocabulary slot.
    vocab_slots = {s for s, _, _ in ctx.vc_split}  # a small vocabulary stays on one slot (minimum share)
    expect = {f"stage{i}.slot{k}": (int(k in vocab_slots) if labels[i] == "head" else 2)
              for i in range(5) for k in (0, 1)}
    assert counts == expect


@torch.inference_mode()
def test_stage_timer_cpu(model: ExLlamaV2) -> None:
    ctx = model.tp_context
    timer = StageTimer()
    ctx.timer = timer
    try:
        ids = torch.randint(0, 640, (1, 5), generator=torch.Generator().manual_seed(1))
        ref = None
        sums = []
        for _ in range(2):
            out = model.forward(ids)
            ref = out if ref is None else ref
            torch.testing.assert_close(out, ref)
            sums.append(timer.summary())
    finally:
        ctx.timer = None
    s = average(sums)
    assert s["stages"] == 5 and len(s["slots"]) == 2
    assert set(s["phases_ms"]) == {"start->embedded", "embedded->states", "states->stages", "stages->logits"}
    for sl in s["slots"]:
        assert sl["compute_ms"] > 0 and sl["collective_ms"] >= 0 and sl["stage_loop_ms"] >= sl["compute_ms"]
        assert set(sl["compute_by_kind_ms"]) == {"attn", "mlp", "head"}
    assert s["host_issue_ms"] > 0


def test_graph_input_derivation() -> None:
    """Decode graphs derive positions / cache slots / key counts from one device-side `past` per slot."""
    B, S = 3, 40
    rows = torch.arange(B)
    inp = {"past": torch.tensor([17]), "pos": torch.zeros(B, 1, dtype=torch.long),
           "slots": torch.zeros(B, 1, dtype=torch.long), "row_base": (rows * S).view(B, 1),
           "seqlens": torch.zeros(B, dtype=torch.int32)}
    _GraphSet._derive(inp)
    ref = contiguous_batch(B, 1, 17, object(), S, torch.device("cpu"))
    assert torch.equal(inp["pos"], ref.positions) and torch.equal(inp["slots"], ref.slots)
    assert torch.equal(inp["seqlens"], ref.seqlens)


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
