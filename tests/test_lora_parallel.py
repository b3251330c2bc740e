"""Adapters under every strategy on CPU: tensor parallelism (row- and column-split closers, uneven splits, an
EXL2 base), a layer split and the step-graph runner's static-buffer path (capture=False runs it eagerly),
which must give the eager results, and keep its steps when adapters are loaded and unloaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Lora
from exlpy.cache.tp import ExLlamaV2Cache_TP
from exlpy.engine.graphs import StepGraphs
from exlpy.engine.split import layer_split
from exlpy.errors import ModelStateError
from exlpy.lora import configure, registry_of
from exlpy.model import Transformer
from exlpy.model.batch import cache_rows_batch
from exlpy.model.parallel_linear import ColumnParallel, RowParallel
from exlpy.runtime import RuntimeOptions
from tests.conftest import rel_err, shared_path
from tests.lora_util import write_adapter
from tests.tp_util import make_model_dir

TOL = 1e-5
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("lora_par")
    d = make_model_dir(root / "m", hidden=192, heads=6, kv_heads=3, head_dim=32, intermediate=256, vocab=700,
                       seed=4)
    return {"dir": d, "a": write_adapter(root / "a", d, r=8, seed=1),
            "b": write_adapter(root / "b", d, r=4, alpha=4, targets=["q_proj", "v_proj", "down_proj"], seed=2),
            "c": write_adapter(root / "c", d, r=8, targets=["k_proj", "o_proj", "gate_proj"], seed=3)}


def _single(path: Path) -> ExLlamaV2:
    m = ExLlamaV2(ExLlamaV2Config(str(path)))
    m.load(device="cpu")
    return m


def _mixed_step(model: ExLlamaV2, cache: object, loras: list[list[ExLlamaV2Lora] | None], ids: torch.Tensor,
                runner: StepGraphs | None = None) -> torch.Tensor:
    """Prefill each row with its adapters, then one decode step over all rows at once (eagerly or through
    `runner`). Returns the decode logits [rows, 1, vocab]."""
    reg = registry_of(model)
    slots = [reg.acquire(lr) if lr else -1 for lr in loras]
    try:
        n = ids.shape[1] - 1
        for r, s in enumerate(slots):
            model.forward_batch(ids[r:r + 1, :n], cache_rows_batch(cache, [r], [0], n, CPU, [s]),
                                preprocess_only=True)
        if runner is None:
            return model.forward_batch(ids[:, n:], cache_rows_batch(cache, list(range(len(slots))), [n] * len(slots),
                                                                    1, CPU, slots))
        generation = reg.ensure(runner.strategy)
        out = runner.run_rows(ids[:, n:], cache, [n] * len(slots), None, cache.max_seq_len, adapters=slots,
                              lora=generation)
        assert out is not None
        return out
    finally:
        for s in slots:
            reg.release(s)


def _refs(case: dict, ids: torch.Tensor) -> tuple[torch.Tensor, list[list[str] | None]]:
    m = _single(case["dir"])
    ad = {k: ExLlamaV2Lora.from_directory(m, str(case[k])) for k in "abc"}
    rows = [["a"], ["b"], None, ["a", "c"]]
    ref = torch.cat([m.forward(ids[r:r + 1], loras=[ad[k] for k in rows[r]] if rows[r] else None)[:, -1:]
                     for r in range(ids.shape[0])])
    return ref, rows


@pytest.mark.parametrize("mode,split", [("row", [1, 1]), ("column", [1, 1]), ("row", [2, 1, 1]),
                                        ("column", [1, 2, 1])])
def test_tp_equals_single(case: dict, mode: str, split: list[int]) -> None:
    ids = torch.randint(3, 700, (4, 7), generator=torch.Generator().manual_seed(0))
    ref, rows = _refs(case, ids)
    m = ExLlamaV2(ExLlamaV2Config(str(case["dir"])))
    m.load_tp(split, devices=["cpu"] * len(split), options=RuntimeOptions(tp_layout=mode))
    kind = RowParallel if mode == "row" else ColumnParallel
    assert isinstance(m.strategy.stages[0].lanes[0].modules[1].o_proj, kind)
    ad = {k: ExLlamaV2Lora.from_directory(m, str(case[k])) for k in "abc"}
    loras = [[ad[k] for k in r] if r else None for r in rows]
    # Whole prompts with one adapter set (model.forward), then a mixed decode step eagerly and via the runner.
    for r in range(4):
        assert rel_err(m.forward(ids[r:r + 1], loras=loras[r])[:, -1:], ref[r:r + 1]) <= TOL, r
    out = _mixed_step(m, ExLlamaV2Cache_TP(m, batch_size=4, max_seq_len=16), loras, ids)
    assert rel_err(out, ref) <= TOL
    runner = StepGraphs(m.strategy, capture=False)
    out = _mixed_step(m, ExLlamaV2Cache_TP(m, batch_size=4, max_seq_len=16), loras, ids, runner)
    assert rel_err(out, ref) <= TOL


def test_tp_exl2_base(tmp_path: Path) -> None:
    d = shared_path("models", "tiny-llama-exl2-4.0")
    ad = write_adapter(tmp_path / "a", d, r=16, seed=5, std=0.03)
    ids = torch.randint(3, 500, (2, 6), generator=torch.Generator().manual_seed(1))
    single = _single(d)
    ref = single.forward(ids, loras=[ExLlamaV2Lora.from_directory(single, str(ad))])
    assert rel_err(ref, single.forward(ids)) > 0.01
    m = ExLlamaV2(ExLlamaV2Config(str(d)))
    m.load_tp([1, 1], devices=["cpu", "cpu"])
    assert isinstance(m.strategy.stages[0].lanes[0].modules[2].down_proj, ColumnParallel)
    assert rel_err(m.forward(ids, loras=[ExLlamaV2Lora.from_directory(m, str(ad))]), ref) <= 1e-4


@pytest.mark.parametrize("cuts", [(), (2,), (1, 4)])  # cuts: segments as on a model split over GPUs
def test_layer_split_runner_equals_eager(case: dict, cuts: tuple[int, ...]) -> None:
    ids = torch.randint(3, 700, (4, 7), generator=torch.Generator().manual_seed(2))
    ref, rows = _refs(case, ids)
    m = _single(case["dir"])
    ad = {k: ExLlamaV2Lora.from_directory(m, str(case[k])) for k in "abc"}
    loras = [[ad[k] for k in r] if r else None for r in rows]
    runner = StepGraphs(layer_split(Transformer(m.modules), cuts), capture=False)
    assert len(runner.strategy.stages) == len(cuts) + 1
    assert rel_err(_mixed_step(m, ExLlamaV2Cache(m, batch_size=4, max_seq_len=16), loras, ids, runner), ref) <= TOL
    assert rel_err(_mixed_step(m, ExLlamaV2Cache(m, batch_size=4, max_seq_len=16), loras, ids), ref) <= TOL


def test_graph_steps_survive_adapter_load_and_unload(case: dict) -> None:
    """model.forward's captured path: adapter steps have their own graph key; swapping adapters rewrites slot
    buffers and reuses the step (no recapture); steps without adapters are untouched."""
    m = _single(case["dir"])
    strategy = m.strategy_for_forward()
    strategy.graph_safe = True  # as on a CUDA model; the runner below runs its static-buffer body eagerly
    runner = strategy.graph_cache["runner"] = StepGraphs(strategy, capture=False)
    ids = torch.randint(3, 700, (2, 6), generator=torch.Generator().manual_seed(3))
    a = ExLlamaV2Lora.from_directory(m, str(case["a"]))
    cache = ExLlamaV2Cache(m, batch_size=2, max_seq_len=16)  # steps are per cache: one for every decode below

    def decode(loras: list[ExLlamaV2Lora] | None) -> torch.Tensor:
        cache.current_seq_len = 0
        m.forward(ids[:, :5], cache, preprocess_only=True, loras=loras)
        return m.forward(ids[:, 5:], cache, loras=loras)  # one token per row: the runner

    plain, with_a = decode(None), decode([a])
    keys = set(runner.steps)
    assert len(keys) == 2 and {k[-1] for k in keys} == {0, registry_of(m).generation}
    m.config.no_graphs = True
    assert rel_err(with_a, decode([a])) <= TOL and rel_err(plain, decode(None)) <= TOL
    m.config.no_graphs = False
    slot = registry_of(m).slot_for((a,))
    a.unload()
    assert int(m.modules[1].lora.groups["qkv"].ranks[slot]) == 0  # the slot is zeroed
    with pytest.raises(ModelStateError, match="unloaded"):
        m.forward(ids, loras=[a])
    c = ExLlamaV2Lora.from_directory(m, str(case["c"]))  # same rank, fewer projections: fits the buffers
    with_c = decode([c])
    assert set(runner.steps) == keys  # same captured steps, new weights in the slot
    m.config.no_graphs = True
    assert rel_err(with_c, decode([c])) <= TOL and rel_err(with_c, with_a) > 1e-3
    m.config.no_graphs = False
    big = write_adapter(case["dir"].parent / "big", case["dir"], r=40, targets=["q_proj"], seed=9)
    decode([ExLlamaV2Lora.from_directory(m, str(big))])  # more rank than the buffers: reallocated
    assert {k[-1] for k in runner.steps} == {0, registry_of(m).generation} and len(runner.steps) == 2


def test_reload_reattaches_resident_adapters(case: dict) -> None:
    m = _single(case["dir"])
    a = ExLlamaV2Lora.from_directory(m, str(case["a"]))
    ids = torch.randint(3, 700, (1, 5), generator=torch.Generator().manual_seed(4))
    ref = m.forward(ids, loras=[a])
    m.unload()
    assert all(getattr(x, "lora", None) is None for x in m.modules)  # buffers went with the weights
    m.load(device="cpu")
    assert rel_err(m.forward(ids, loras=[a]), ref) <= TOL


def test_slots_grow_then_idle_ones_are_reused(case: dict) -> None:
    m = _single(case["dir"])
    reg = registry_of(m)
    ids = torch.randint(3, 700, (1, 5), generator=torch.Generator().manual_seed(5))
    loras = [ExLlamaV2Lora.from_directory(m, str(case["a"]), lora_scaling=0.1 * (i + 1)) for i in range(10)]
    assert reg.num_slots == 8 and all(s is not None for s in reg.slots)  # 1, 2, 4, 8 as they arrived
    first = m.forward(ids, loras=[loras[0]])  # evicted by the 9th and 10th: written back into an idle slot
    assert reg.num_slots == 8 and rel_err(first, m.forward(ids, loras=[loras[0]])) <= TOL
    ref = _single(case["dir"])
    assert rel_err(first, ref.forward(ids, loras=[ExLlamaV2Lora.from_directory(ref, str(case["a"]),
                                                                                 lora_scaling=0.1)])) <= TOL


def test_configure_and_load_while_unloaded(case: dict) -> None:
    m = _single(case["dir"])
    a = ExLlamaV2Lora.from_directory(m, str(case["a"]))
    ids = torch.randint(3, 700, (1, 5), generator=torch.Generator().manual_seed(6))
    ref = m.forward(ids, loras=[a])
    m.unload()
    configure(m, max_adapters=3, max_rank=64)  # nothing loaded: recorded for the next load
    c = ExLlamaV2Lora.from_directory(m, str(case["c"]))
    m.load(device="cpu")
    reg = registry_of(m)
    assert rel_err(m.forward(ids, loras=[a]), ref) <= TOL and reg.num_slots == 3 and reg.rank == 64
    assert m.forward(ids, loras=[c]).shape == ref.shape
