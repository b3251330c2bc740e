"""Mixture-of-experts models (Mixtral, Qwen3-MoE, DBRX) beyond the fp32 comparisons of test_architectures.py: both
formulations of the routed experts, half precision, the planner, and the refusals (TP, LoRA). Conversion:
tests/test_convert_moe.py; EXL2 experts: tests/test_moe_exl2.py."""

from __future__ import annotations

import argparse
import types
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config
from exlpy.errors import LoraConfigError, TensorParallelError
from exlpy.kernels import reference, reference_moe
from tests.arch_models import VOCAB, make_arch_model
from tests.conftest import logits_tol, rel_err, requires_cuda


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object]]:
    out = {}
    for case in ("mixtral", "qwen3_moe", "dbrx"):
        path = tmp_path_factory.mktemp(case)
        out[case] = (path, make_arch_model(path, case))
    return out


def _load(path: Path, dtype: torch.dtype | None = None, device: str | None = None) -> ExLlamaV2:
    config = ExLlamaV2Config(str(path))
    config.max_seq_len = 128
    config.dtype = dtype
    model = ExLlamaV2(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if device is None:
            model.load_autosplit(ExLlamaV2Cache(model, lazy=True))
        else:
            model.load(device=device)
    return model


def _naive(h: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, gu: torch.Tensor, down: torch.Tensor
           ) -> torch.Tensor:
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g, u = (gu[e] @ h[t]).chunk(2)
            out[t] += w[t, j] * (down[e] @ (torch.nn.functional.silu(g) * u))
    return out


def _case(tokens: int, E: int = 5, k: int = 2, H: int = 24, inter: int = 40, seed: int = 0
          ) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, H, generator=g)
    gu, down = torch.randn(E, 2 * inter, H, generator=g) / 5, torch.randn(E, H, inter, generator=g) / 6
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
    return h, torch.rand(tokens, k, generator=g), ids, gu, down


# every formulation of the torch paths: (gather limit of the old reference, host slices, gather bytes)
_PATHS = {"slices": (0, True, 0), "gather": (10**9, False, 2**62), "masked": (0, False, 0)}


@pytest.mark.parametrize("path", list(_PATHS))
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_every_experts_path_equals_a_per_token_loop(monkeypatch: pytest.MonkeyPatch, tokens: int, path: str
                                                    ) -> None:
    """The old whole-op reference (gathered or grouped with host counts) and the sorted formulation the model
    calls (ops.moe_experts: host slices on CPU, the fixed-shape gather or masked paths elsewhere)."""
    from exlpy.kernels import ops

    h, w, ids, gu, down = _case(tokens)
    want = _naive(h, w, ids, gu, down)
    limit, slices, gather_bytes = _PATHS[path]
    monkeypatch.setattr(reference_moe, "MOE_GATHER_MAX", limit)
    monkeypatch.setattr(reference_moe, "MOE_HOST_SLICES", slices)
    monkeypatch.setattr(reference_moe, "MOE_GATHER_BYTES", gather_bytes)
    torch.testing.assert_close(reference.moe_experts(h, w, ids, gu, down, "silu"), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ops.moe_experts(h, w, ids, gu, down, "silu"), want, atol=1e-5, rtol=1e-5)


def test_sort_groups_pairs_by_expert() -> None:
    ids = torch.tensor([[2, 0], [0, 3], [2, 1]])
    order, counts = reference.moe_sort(ids, 5)
    assert counts.tolist() == [2, 1, 2, 1, 0]
    assert ids.reshape(-1)[order].tolist() == [0, 0, 1, 2, 2, 3]
    assert order.tolist() == [1, 2, 5, 0, 4, 3]  # stable: within an expert, pairs in token order


@pytest.mark.parametrize("path", list(_PATHS))
def test_unrouted_experts_are_not_read(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """An expert no token chose may hold anything (NaN here): it never enters the result."""
    from exlpy.kernels import ops

    g = torch.Generator().manual_seed(1)
    h, gu, down = torch.randn(20, 8, generator=g), torch.randn(3, 12, 8, generator=g), torch.randn(3, 8, 6, generator=g)
    gu[2], down[2] = float("nan"), float("nan")
    ids = torch.randint(0, 2, (20, 1), generator=g)
    limit, slices, gather_bytes = _PATHS[path]
    monkeypatch.setattr(reference_moe, "MOE_GATHER_MAX", limit)
    monkeypatch.setattr(reference_moe, "MOE_HOST_SLICES", slices)
    monkeypatch.setattr(reference_moe, "MOE_GATHER_BYTES", gather_bytes)
    assert torch.isfinite(reference.moe_experts(h, torch.ones(20, 1), ids, gu, down, "silu")).all()
    assert torch.isfinite(ops.moe_experts(h, torch.ones(20, 1), ids, gu, down, "silu")).all()


@pytest.mark.parametrize("gather_bytes", [reference_moe.MOE_GATHER_BYTES, 0])
@pytest.mark.parametrize("tokens", [1, 40])
def test_moe_block_forward_needs_no_host_sync(moe_models: dict, monkeypatch: pytest.MonkeyPatch, tokens: int,
                                              gather_bytes: int) -> None:
    """The whole MoE block (norm, router, top-k, sort, grouped experts, combine) runs on meta tensors, which refuse
    what a host sync needs (.item(), .tolist(), boolean indexing, data-dependent shapes): the same code a CUDA
    decode step runs inside its graph, in both fixed-shape formulations of the torch fallback."""
    from exlpy.model.module import drive
    from exlpy.model.moe import MoEMLP

    monkeypatch.setattr(reference_moe, "MOE_GATHER_BYTES", gather_bytes)
    for case in ("mixtral", "qwen3_moe", "dbrx"):
        model = _load(moe_models[case][0], torch.float32, "cpu")
        block = next(m for m in model.modules if isinstance(m, MoEMLP))
        assert block.graph_safe
        for name in ("norm_w", "norm_b", "router", "w_gate_up", "w_down"):
            t = getattr(block, name)
            if t is not None:
                setattr(block, name, t.to("meta"))
        x = torch.empty(tokens, 1, model.config.hidden_size, device="meta")
        out = drive(block.forward(x, None))  # type: ignore[arg-type]
        assert out.shape == x.shape and out.device.type == "meta"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe", "dbrx"])
def test_half_precision_matches_reference(moe_models: dict, case: str, dtype: torch.dtype) -> None:
    path, ref = moe_models[case]
    ids = torch.randint(2, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(ids).logits  # type: ignore[operator]
    model = _load(path, dtype)
    assert rel_err(model.forward(ids), want) <= logits_tol(model, 2e-3)


def test_routing_settings_exposed(moe_models: dict) -> None:
    config = ExLlamaV2Config(str(moe_models["qwen3_moe"][0]))
    assert config.num_experts == 4 and config.num_experts_per_token == 2
    assert config.spec is not None and config.spec.moe is not None
    assert config.spec.moe.sparse_layers == (True, False) and config.spec.moe.norm_p == 1.0
    config.num_experts_per_token = 2  # the model's own value: accepted
    assert config.num_experts_per_token == 2


def test_experts_per_token_override_matches_a_model_trained_so(moe_models: dict, tmp_path: Path) -> None:
    """exllamav2's -ept: config.num_experts_per_token = 3 on the top-2 Mixtral routes like transformers' Mixtral
    with num_experts_per_tok = 3 and the same weights."""
    from exlpy.errors import ConfigError

    ref3 = make_arch_model(tmp_path, "mixtral", num_experts_per_tok=3)  # same seed: the same weights
    config = ExLlamaV2Config(str(moe_models["mixtral"][0]))
    with pytest.raises(ConfigError, match="num_experts_per_token"):
        config.num_experts_per_token = 5  # only 4 experts
    config.num_experts_per_token = 3
    model = ExLlamaV2(config)
    model.load(device="cpu")
    ids = torch.randint(2, VOCAB, (2, 20), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        want = ref3(ids).logits  # type: ignore[operator]
    assert rel_err(model.forward(ids), want) <= logits_tol(model, 2e-3)


def test_dense_moe_models_are_graph_captured(moe_models: dict) -> None:
    from exlpy.engine.forward import graph_runner

    model = _load(moe_models["mixtral"][0])
    strategy = types.SimpleNamespace(graph_safe=True, graph_cache={})
    assert graph_runner(model, strategy) is not None  # type: ignore[arg-type]


def check_runner_decode(model: ExLlamaV2, steps: int = 3) -> tuple[object, torch.Tensor, ExLlamaV2Cache,
                                                                    ExLlamaV2Cache]:
    """Decode a batch of 3 through the graph runner's static buffers (its body run eagerly on the CPU, as on a
    CUDA model but without capture; padded to a bucket of 4 rows whose padding routes somewhere and writes
    nowhere) and plainly, `steps` tokens after the prompt's last; the logits must agree. Returns (the runner,
    the last token, the eager cache, the runner's cache) for further steps. Also tests/test_moe_exl2.py's."""
    from exlpy.engine.graphs import StepGraphs

    prompt = torch.randint(2, VOCAB, (3, 9), generator=torch.Generator().manual_seed(5))
    eager_cache, graph_cache = ExLlamaV2Cache(model, batch_size=3), ExLlamaV2Cache(model, batch_size=3)
    model.forward(prompt, eager_cache, preprocess_only=True)
    model.forward(prompt, graph_cache, preprocess_only=True)
    ref = [model.forward(prompt[:, -1:], eager_cache)]
    strategy = model.strategy_for_forward()
    strategy.graph_safe = True  # as on a CUDA model; the runner runs its body eagerly
    runner = strategy.graph_cache["runner"] = StepGraphs(strategy, capture=False)
    out = [model.forward(prompt[:, -1:], graph_cache)]
    assert len(runner.steps) == 1  # the step went through the runner
    for _ in range(steps):
        tok = ref[-1][:, -1].argmax(-1, keepdim=True)
        ref.append(model.forward(tok, eager_cache))
        out.append(model.forward(tok, graph_cache))
    assert rel_err(torch.cat(out, 1), torch.cat(ref, 1)) <= 1e-5
    return runner, tok, eager_cache, graph_cache


def check_replays_with_new_routing(run: Callable[[], torch.Tensor], refill: Callable[[int], None],
                                   want: Callable[[], torch.Tensor]) -> None:
    """An MoE op over static buffers, run(), captured once in a CUDA graph (capture refuses any host sync) after
    refill(0) and a first call on a side stream (the kernels compile outside the capture); then per seed 1-3
    refill(seed) routes the tokens elsewhere and a replay must be within 5e-3 of want() for that routing. Also
    tests/test_moe_kernels_triton.py's and tests/test_moe_exl2.py's."""
    refill(0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for seed in (1, 2, 3):
        refill(seed)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, want()) < 5e-3


def check_cuda_graph_decode(load: Callable[[], ExLlamaV2], want: torch.Tensor, ids: torch.Tensor,
                            between_tol: float | None = None) -> None:
    """fp16 models from `load()` on a GPU decode ids [2, 30] (a 20-token prompt, then token by token) replayed
    from CUDA graphs and eagerly (no_graphs): graphs were captured exactly when on, each path's logits are within
    logits_tol(model, 2e-3) of `want` and within `between_tol` (default: that bound) of each other. Also
    tests/test_moe_exl2.py's."""
    outs = {}
    for graphs in (True, False):
        model = load()
        model.config.no_graphs = not graphs
        cache = ExLlamaV2Cache(model, batch_size=2)
        parts = [model.forward(ids[:, :20], cache)] + [model.forward(ids[:, i:i + 1], cache) for i in range(20, 30)]
        outs[graphs] = torch.cat(parts, dim=1).cpu()
        runner = model.strategy_for_forward().graph_cache.get("runner")
        assert (runner is not None and any(s.captured for s in runner.steps.values())) == graphs
        assert rel_err(outs[graphs], want) <= logits_tol(model, 2e-3)
    assert rel_err(outs[True], outs[False]) <= (logits_tol(model, 2e-3) if between_tol is None else between_tol)


@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe"])
def test_decode_through_the_graph_runner_equals_eager(moe_models: dict, case: str) -> None:
    """Decode through the graph runner equals plain eager decode (check_runner_decode); when the experts per token
    change between calls (exllamav2's -ept), graphs of the old top-k are dropped."""
    model = _load(moe_models[case][0], torch.float32, "cpu")
    runner, tok, eager_cache, graph_cache = check_runner_decode(model)
    old_step = next(iter(runner.steps.values()))
    model.config.num_experts_per_token = 3
    out3 = model.forward(tok, graph_cache)
    assert len(runner.steps) == 1 and all(s is not old_step for s in runner.steps.values())
    assert rel_err(out3, model.forward(tok, eager_cache)) <= 1e-5


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe", "dbrx"])
def test_cuda_graph_decode_equals_eager(moe_models: dict, case: str) -> None:
    """fp16 on a GPU: token-by-token decode of 2 rows replayed from CUDA graphs equals eager decode (no_graphs)
    and the fp32 reference; the graphs were captured (the MoE blocks inside them)."""
    path, ref = moe_models[case]
    ids = torch.randint(2, VOCAB, (2, 30), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = ref(ids).logits  # type: ignore[operator]
    check_cuda_graph_decode(lambda: _load(path, torch.float16, "cuda:0"), want, ids, between_tol=2e-3)


def test_tensor_parallel_refused_by_name(moe_models: dict) -> None:
    model = ExLlamaV2(ExLlamaV2Config(str(moe_models["qwen3_moe"][0])))
    with pytest.raises(TensorParallelError, match="mixture-of-experts.*Qwen3MoeForCausalLM"):
        model.load_tp([1, 1], devices=["cpu", "cpu"])


def test_lora_refused_by_name(moe_models: dict, tmp_path: Path) -> None:
    from exlpy import ExLlamaV2Lora

    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "lora_alpha": 8, '
                                                  '"target_modules": ["q_proj"]}')
    model = _load(moe_models["mixtral"][0])
    with pytest.raises(LoraConfigError, match="mixture-of-experts"):
        ExLlamaV2Lora.from_directory(model, str(tmp_path))


def test_dbrx_fused_experts_read_as_canonical_parts(moe_models: dict) -> None:
    """DBRX stores each layer's experts as [E*I, H] w1 / v1 / w2 (w2 transposed): every expert's projections
    are views of them, with the canonical shapes, and the fused tensors are counted once."""
    from safetensors import safe_open

    path = moe_models["dbrx"][0]
    config = ExLlamaV2Config(str(path))
    index = config.index
    assert index is not None
    with safe_open(str(next(path.glob("*.safetensors"))), "pt") as f:
        w2 = f.get_tensor("transformer.blocks.1.ffn.experts.mlp.w2")
        v1 = f.get_tensor("transformer.blocks.1.ffn.experts.mlp.v1")
    assert index.info("model.layers.1.mlp.experts.2.down_proj.weight").shape == (64, 48)
    torch.testing.assert_close(index.get("model.layers.1.mlp.experts.2.down_proj.weight"), w2[96:144].t())
    torch.testing.assert_close(index.get("model.layers.1.mlp.experts.3.up_proj.weight"), v1[144:192])
    assert "model.layers.1.mlp.experts.w2" not in index.tensors


def test_dbrx_original_config_reads_nested_keys(moe_models: dict, tmp_path: Path) -> None:
    """databricks' own config.json has kv heads, RoPE base, clip and routing only under attn_config / ffn_config."""
    import json
    import shutil

    d = tmp_path / "dbrx"
    shutil.copytree(moe_models["dbrx"][0], d)
    cfg = json.loads((d / "config.json").read_text())
    for key in ("num_key_value_heads", "rope_parameters"):
        cfg.pop(key, None)
    cfg["attn_config"]["rope_theta"] = 5e5
    cfg["ffn_config"]["moe_normalize_expert_weights"] = 2
    (d / "config.json").write_text(json.dumps(cfg))
    spec = ExLlamaV2Config(str(d)).spec
    assert spec is not None and spec.moe is not None
    assert (spec.num_key_value_heads, spec.rope_theta, spec.features.clip_qkv) == (2, 5e5, 0.5)
    assert (spec.moe.num_experts, spec.moe.top_k, spec.moe.expert_size, spec.moe.norm_p) == (4, 2, 48, 2.0)
    cfg["ffn_config"]["moe_normalize_expert_weights"] = None  # null: the top-k weights as they are
    (d / "config.json").write_text(json.dumps(cfg))
    assert ExLlamaV2Config(str(d)).spec.moe.norm_p == 0.0  # type: ignore[union-attr]


def test_dbrx_l2_normalised_routing_matches_reference(tmp_path: Path) -> None:
    ffn = {"ffn_hidden_size": 48, "moe_num_experts": 4, "moe_top_k": 2, "moe_normalize_expert_weights": 2.0}
    ref = make_arch_model(tmp_path, "dbrx", ffn_config=ffn)
    model = _load(tmp_path, torch.float32, "cpu")
    ids = torch.randint(2, VOCAB, (2, 20), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        want = ref(ids).logits  # type: ignore[operator]
    assert rel_err(model.forward(ids), want) <= 2e-3


def test_plan_counts_every_expert(moe_models: dict, capsys: pytest.CaptureFixture[str]) -> None:
    from exlpy.cli import plan as plan_cli
    from exlpy.parallel.costs import module_costs

    path = moe_models["mixtral"][0]
    model = ExLlamaV2(ExLlamaV2Config(str(path)))
    costs = {c.name: c for c in module_costs(model.modules, 2)}
    # 4 experts x 3 projections of 64 x 128, the router (4 x 64) and the norm (64), at 2 bytes
    assert costs["model.layers.0.mlp"].weight_bytes == (4 * 3 * 64 * 128 + 4 * 64 + 64) * 2
    assert costs["model.layers.0.mlp"].kind == "mlp"
    # a token reads 2 of the 4 experts (fp16 on disk): what `exlpy bench` takes as the batch-1 bandwidth limit
    moe = model.modules[2]
    assert moe.active_weight_bytes() == (2 * 3 * 64 * 128 + 4 * 64 + 64) * 2
    parser = argparse.ArgumentParser()
    plan_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", "--model", str(path), "--devices", "1000,1000", "--max-seq-len", "256"])
    assert args._run(args) == 0
    assert "embedding" in capsys.readouterr().out


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe", "dbrx"])
def test_cuda_full_and_incremental(moe_models: dict, case: str) -> None:
    """On a GPU (fp16): full sequence and token by token through a cache; with two GPUs, autosplit balances the
    layers over both (a layer split through MoE blocks)."""
    path, ref = moe_models[case]
    ids = torch.randint(2, VOCAB, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = ref(ids).logits  # type: ignore[operator]
    config = ExLlamaV2Config(str(path))
    config.max_seq_len = 128
    model = ExLlamaV2(config)
    cache = ExLlamaV2Cache(model, lazy=True)
    model.load_autosplit(cache)
    if torch.cuda.device_count() > 1:
        assert len({str(m.device) for m in model.modules}) > 1
    assert rel_err(model.forward(ids), want) <= logits_tol(model, 2e-3)
    parts = [model.forward(ids[:, :20], cache)] + [model.forward(ids[:, i:i + 1], cache) for i in range(20, 40)]
    assert rel_err(torch.cat(parts, dim=1), want) <= logits_tol(model, 2e-3)


def test_exl2_experts_equal_their_dense_equivalent(moe_models: dict, tmp_path: Path) -> None:
    """Experts stored as EXL2 (as exllamav2 converts Mixtral) load packed into per-projection stacks and run by
    the grouped packed-weight path: the logits equal those of the same model with every expert written out
    densely as its packed weights decode; the blocks stay graph-safe (tests/test_moe_exl2.py goes further)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from exlpy.model.moe import MoEMLP
    from exlpy.quant.pack import random_exl2

    src = moe_models["mixtral"][0]
    dense = load_file(str(src / "model.safetensors"))
    quant = dict(dense)
    g = torch.Generator().manual_seed(9)
    for name, w in dense.items():
        if ".experts." in name:
            n, k = w.shape
            del quant[name]
            for suffix, t in random_exl2(k, n, [(4, k // 2), (6, k // 2)], g).items():
                quant[f"{name.removesuffix('.weight')}.{suffix}"] = t
    dirs = {"exl2": tmp_path / "exl2", "dense": tmp_path / "dense"}
    for d in dirs.values():
        d.mkdir()
        shutil.copy(src / "config.json", d / "config.json")
    save_file(quant, str(dirs["exl2"] / "model.safetensors"))
    model = _load(dirs["exl2"], torch.float32, "cpu")
    for m in model.modules:
        if isinstance(m, MoEMLP):
            assert m.packed is not None and m.experts is None and m.w_gate_up is None and m.graph_safe
            for stack, proj in zip(m.packed, ("w1", "w3", "w2")):
                for e in range(stack.num_experts):
                    w = stack.dequant(e).t().contiguous()  # [out, in], exactly what the packed stack holds
                    dense[f"model.layers.{m.layer_idx}.block_sparse_moe.experts.{e}.{proj}.weight"] = w
    save_file(dense, str(dirs["dense"] / "model.safetensors"))
    ref = _load(dirs["dense"], torch.float32, "cpu")
    ids = torch.randint(2, VOCAB, (2, 30), generator=torch.Generator().manual_seed(6))
    assert rel_err(model.forward(ids), ref.forward(ids)) < 1e-4
    from exlpy.engine.forward import graph_runner

    assert graph_runner(model, types.SimpleNamespace(graph_safe=True, graph_cache={})) is not None  # type: ignore[arg-type]


def test_nan_in_an_expert_is_named(moe_models: dict, tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    from exlpy.errors import WeightsError

    d = tmp_path / "m"
    shutil.copytree(moe_models["qwen3_moe"][0], d)
    f = next(d.glob("*.safetensors"))
    t = load_file(str(f))
    t["model.layers.0.mlp.experts.3.down_proj.weight"][5, 7] = float("nan")
    save_file(t, str(f))
    with pytest.raises(WeightsError, match="experts.3.down_proj"):
        _load(d, torch.float32, "cpu")
