"""Tensor-parallel forward on CPU "devices": sharded logits equal the single-device logits (fp32)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config
from exlpy.cache.tp import ExLlamaV2Cache_TP
from exlpy.errors import GpuSplitError, TensorParallelError
from exlpy.model.parallel_linear import ColumnParallel, RowParallel
from exlpy.runtime import RuntimeOptions

sys.path.insert(0, str(Path(__file__).parent))
from conftest import shared_path  # noqa: E402
from tp_util import make_model_dir  # noqa: E402


def _single(path: Path) -> ExLlamaV2:
    m = ExLlamaV2(ExLlamaV2Config(str(path)))
    m.load(device="cpu") if "device" in m.load.__code__.co_varnames else m.load()
    return m


def load_tp(m: ExLlamaV2, split: list[float] | None, **kw: object) -> None:
    m.load_tp(split, **kw)  # type: ignore[arg-type]


def _tp(path: Path, split: list[float], **kw: object) -> ExLlamaV2:
    m = ExLlamaV2(ExLlamaV2Config(str(path)))
    load_tp(m, split, devices=["cpu"] * len(split), **kw)
    return m


def closers(m: ExLlamaV2, slot: int = 0) -> list[object]:
    """The closing projections (o_proj, down_proj) of slot `slot`'s first layer."""
    mods = m.strategy.stages[0].lanes[slot].modules
    return [mods[1].o_proj, mods[2].down_proj]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("tp") / "llama", hidden=256, heads=6, kv_heads=3, vocab=2048)


@pytest.mark.parametrize("mode", ["row", "column"])
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_tp_equals_single(tmp_path: Path, arch: str, mode: str) -> None:
    opts = RuntimeOptions(tp_layout=mode)
    d = make_model_dir(tmp_path / "m", arch=arch, hidden=512, heads=6, kv_heads=3, vocab=1100,
                       tie=arch == "Qwen2ForCausalLM", seed=3)
    ids = torch.randint(0, 1100, (2, 7), generator=torch.Generator().manual_seed(0))
    ref = _single(d).forward(ids)
    for split in ([1, 1], [1, 1, 1], [3, 2, 2]):
        m = _tp(d, split, options=opts)
        kind = RowParallel if mode == "row" else ColumnParallel
        assert all(isinstance(c, kind) for c in closers(m))
        out = m.forward(ids)
        assert out.shape == ref.shape and out.dtype == torch.float32
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
        m.unload()
        assert m.tp_context is None and "_run" not in vars(m)


def test_tp_vocab_split_and_uneven(llama_dir: Path) -> None:
    m = _tp(llama_dir, [2, 1, 1])
    ctx = m.tp_context
    assert [b - a for _, a, b in ctx.kv_split] == [1, 1, 1]
    assert len(ctx.vc_split) == 3 and ctx.vc_split[-1][2] == 2048  # the head is split three ways
    assert [b - a for _, a, b in ctx.vc_split] == [1024, 512, 512]  # proportional to the budgets
    ids = torch.randint(0, 1600, (1, 9), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(m.forward(ids), _single(llama_dir).forward(ids), atol=2e-5, rtol=1e-5)


def test_tp_leaves_the_graph_setting_alone(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m = ExLlamaV2(ExLlamaV2Config(str(llama_dir)))
    assert m.config.no_graphs is False
    load_tp(m, [1, 1], devices=["cpu", "cpu"])
    assert m.config.no_graphs is False  # the user's setting: TP decides about its own graphs
    m.unload()
    assert m.config.no_graphs is False

    def broken(*args: object) -> None:
        raise RuntimeError("shard failed")

    monkeypatch.setattr("exlpy.engine.tensor_parallel.shard_mlp", broken)  # fails after the context is set up
    with pytest.raises(RuntimeError, match="shard failed"):
        load_tp(m, [1, 1], devices=["cpu", "cpu"])
    assert m.config.no_graphs is False and m.tp_context is None and not m.loaded


def test_tp_cache_incremental(llama_dir: Path) -> None:
    ids = torch.randint(0, 1600, (2, 12), generator=torch.Generator().manual_seed(2))
    ref = _single(llama_dir).forward(ids)
    m = _tp(llama_dir, [1, 1, 1])
    cache = ExLlamaV2Cache_TP(m, batch_size=2, max_seq_len=32)
    assert sorted(cache.caches) == [0, 1, 2]
    assert all(c.num_key_value_heads == 1 for c in cache.caches.values())
    outs = [m.forward(ids[:, :5], cache)]
    for t in range(5, 12):
        outs.append(m.forward(ids[:, t:t + 1], cache))
    assert cache.current_seq_len == 12 and all(c.current_seq_len == 12 for c in cache.caches.values())
    torch.testing.assert_close(torch.cat(outs, 1), ref, atol=2e-5, rtol=1e-5)
    # preprocess_only fills the cache without logits; last_id_only and return_last_state work as in _run.
    cache.reset()
    assert m.forward(ids[:, :11], cache, preprocess_only=True) is None
    last, state = m.forward(ids[:, 11:], cache, last_id_only=True, return_last_state=True)
    torch.testing.assert_close(last[:, -1], ref[:, -1], atol=2e-5, rtol=1e-5)
    assert state.shape == (2, 1, 256)
    k, v = cache.get_kv_state(0, 0, 0, 12)
    assert k.shape == (12, 3, 32)
    clone = cache.clone()
    assert clone.current_seq_len == 12 and torch.equal(clone.get_kv_state(0)[0], cache.get_kv_state(0)[0])


def test_tp_context_collectives(llama_dir: Path) -> None:
    from exlpy.tensor_p import BROADCAST_RS, BROADCAST_VC

    m = _tp(llama_dir, [1, 1, 2])
    ctx = m.tp_context
    assert ctx.num_devices == 3 and ctx.device == 0 and ctx.all_devices() == [0, 1, 2]
    sin, cos = ctx.get_sin_cos()
    assert all(t is not None for t in sin + cos)
    x = torch.randn(3, 2048)
    parts = [x[:, a:b].clone() for _, a, b in ctx.vc_split]
    torch.testing.assert_close(ctx.gather(0, parts, BROADCAST_VC), x)
    full = ctx.allgather(0, parts, BROADCAST_VC, BROADCAST_VC)
    assert len(full) == len(ctx.vc_split) and all(torch.equal(f, x) for f in full)
    tgt = [torch.zeros(3, b - a) for _, a, b in ctx.vc_split]
    ctx.add_residual(tgt, full, BROADCAST_VC)
    torch.testing.assert_close(torch.cat(tgt, -1), x)
    ctx.reserve_scratch(4096)
    ctx.begin_scratch_alloc_tp()
    sl = ctx.get_scratch_slice_tp(2, torch.float32, BROADCAST_RS)
    assert [t.shape for t in sl] == [(2, b - a) for _, a, b in ctx.rs_split]
    with pytest.raises(TensorParallelError, match="scratch"):
        ctx.get_scratch_slice_tp_bc(64, torch.float32, BROADCAST_VC)
    assert ctx.get_pinned(0, 1, 4, 8).shape == (1, 4, 8)


def test_tp_bad_input(llama_dir: Path, tmp_path: Path) -> None:
    m = ExLlamaV2(ExLlamaV2Config(str(llama_dir)))
    with pytest.raises(TensorParallelError, match="Cannot create TP cache"):
        ExLlamaV2Cache_TP(m)
    with pytest.raises(TensorParallelError, match="3 entries but only 2 devices"):
        load_tp(m, [1, 1, 1], devices=["cpu", "cpu"])
    with pytest.raises(TensorParallelError, match="no KV head"):
        load_tp(m, [10, 10, 0.1], devices=["cpu"] * 3)
    with pytest.raises(TensorParallelError, match="positive budget"):
        load_tp(m, [1, 0], devices=["cpu"] * 2)
    with pytest.raises(GpuSplitError):
        load_tp(m, None, devices=["cpu"] * 2)
    assert m.tp_context is None and not m.loaded
    odd = make_model_dir(tmp_path / "odd", intermediate=700)
    with pytest.raises(TensorParallelError, match="Model intermediate size must be divisible by 128"):
        load_tp(ExLlamaV2(ExLlamaV2Config(str(odd))), [1, 1], devices=["cpu"] * 2)
    # The memory plan assumed one cache type; a TP cache of another type is refused.
    from exlpy.cache.base import ExLlamaV2CacheBase

    class HalfWidth(ExLlamaV2CacheBase):
        bytes_per_element_k = bytes_per_element_v = 1.0

    m2 = _tp(llama_dir, [1, 1], expect_cache_base=HalfWidth)
    with pytest.raises(TensorParallelError, match="cache type mismatch"):
        ExLlamaV2Cache_TP(m2, base=ExLlamaV2Cache)
    assert ExLlamaV2Cache_TP(m2, base=HalfWidth).base is HalfWidth
    with pytest.raises(TensorParallelError, match="needs an ExLlamaV2Cache_TP"):
        m2.forward(torch.tensor([[1, 2]]), ExLlamaV2Cache(m2, max_seq_len=8))


def test_tp_unsupported_arch(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    cfg = ExLlamaV2Config(str(llama_dir))
    assert cfg.spec is not None
    cfg.spec = dataclasses.replace(cfg.spec, arch=dataclasses.replace(cfg.spec.arch, supports_tp=False))
    with pytest.raises(TensorParallelError, match="Tensor-parallel is not supported for LlamaForCausalLM"):
        load_tp(ExLlamaV2(cfg), [1, 1], devices=["cpu"] * 2)


def test_tp_shared_tiny_llama() -> None:
    d = shared_path("models", "tiny-llama-fp16")
    ids = torch.randint(0, 512, (1, 10), generator=torch.Generator().manual_seed(3))
    ref = _single(d).forward(ids)
    m = _tp(d, [1, 1])
    torch.testing.assert_close(m.forward(ids), ref, atol=1e-4, rtol=1e-4)


def test_tp_exl2_tiny_llama() -> None:
    d = shared_path("models", "tiny-llama-exl2-4.0")
    ids = torch.randint(0, 512, (1, 10), generator=torch.Generator().manual_seed(4))
    ref = _single(d).forward(ids)
    m = _tp(d, [1, 1])
    assert all(isinstance(c, ColumnParallel) for c in closers(m))  # EXL2 closes blocks with column splits
    cache = ExLlamaV2Cache_TP(m, max_seq_len=16)
    out = torch.cat([m.forward(ids[:, :6], cache)] + [m.forward(ids[:, t:t + 1], cache) for t in range(6, 10)], 1)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
