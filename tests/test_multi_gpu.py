"""Two GPUs: tensor-parallel decode graphs (whole step with NCCL inside, and per stage) equal eager TP decode
and the single-GPU model; a layer-split model's per-device graphs equal its eager decode. Needs two CUDA
devices; skipped elsewhere."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config
from exlpy.cache.tp import ExLlamaV2Cache_TP

sys.path.insert(0, str(Path(__file__).parent))
from tp_util import make_model_dir  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


def _decode(model: ExLlamaV2, cache: object, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy decode from `ids`; the logits of every step, stacked."""
    out = []
    tok = model.forward(ids, cache, last_id_only=True)[:, -1:].argmax(-1)
    for _ in range(steps):
        logits = model.forward(tok.cpu(), cache)
        out.append(logits[:, -1].float().cpu())
        tok = logits[:, -1:].argmax(-1)
    return torch.stack(out, 1)


@pytest.mark.parametrize("graph_mode", ["step", "stage"])
def test_tp_graph_decode_equals_eager(tmp_path: Path, graph_mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXLPY_TP_GRAPH", graph_mode)
    d = make_model_dir(tmp_path / "m", hidden=512, heads=8, kv_heads=2, head_dim=64, intermediate=1024,
                       vocab=3000, layers=3, dtype=torch.float16, seed=5)
    ids = torch.randint(3, 3000, (2, 17), generator=torch.Generator().manual_seed(0))

    single = ExLlamaV2(ExLlamaV2Config(str(d)))
    single.load()
    ref = _decode(single, ExLlamaV2Cache(single, batch_size=2, max_seq_len=64), ids, 12)
    single.unload()

    m = ExLlamaV2(ExLlamaV2Config(str(d)))
    m.load_tp([1, 1])
    ctx = m.tp_context
    cache = ExLlamaV2Cache_TP(m, batch_size=2, max_seq_len=64)
    graphed = _decode(m, cache, ids, 12)
    sets = list(ctx.graphs.sets.values())
    assert len(sets) == 1
    expected = graph_mode if ctx.comm.name == "nccl" else "stage"
    assert sets[0].mode == expected
    cache.reset()
    graphs, ctx.graphs = ctx.graphs, None
    eager = _decode(m, cache, ids, 12)
    ctx.graphs = graphs
    torch.testing.assert_close(graphed, eager, atol=2e-3, rtol=0)
    torch.testing.assert_close(graphed, ref, atol=2e-2, rtol=0)
    assert torch.equal(graphed.argmax(-1), ref.argmax(-1))
    m.unload()


def test_split_model_graph_decode_equals_eager(tmp_path: Path) -> None:
    """Layers split over 2 GPUs: one graph per device segment, the hidden state hopped between replays."""
    from exlpy.model.graphs import graphs_supported

    d = make_model_dir(tmp_path / "m", hidden=512, heads=8, kv_heads=2, head_dim=64, intermediate=1024,
                       vocab=3000, layers=4, dtype=torch.float16, seed=6)
    ids = torch.randint(3, 3000, (2, 17), generator=torch.Generator().manual_seed(1))
    m = ExLlamaV2(ExLlamaV2Config(str(d)))
    m.load(gpu_split=[0.016, 10])  # 16 MB on GPU 0: the embedding and layers 0-1 (exlpy plan), the rest on 1
    assert {str(x.device) for x in m.modules} == {"cuda:0", "cuda:1"}
    assert graphs_supported(m)
    cache = ExLlamaV2Cache(m, batch_size=2, max_seq_len=64)
    graphed = _decode(m, cache, ids, 12)
    runner = m._graphs
    assert runner is not None and len(runner.ranges) >= 2
    assert all(seg.graph is not None for step in runner._steps.values() for seg in step.segments)
    cache.current_seq_len = 0
    m.config.no_graphs = True
    eager = _decode(m, cache, ids, 12)
    torch.testing.assert_close(graphed, eager, atol=2e-3, rtol=0)
    m.unload()
