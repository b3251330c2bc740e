"""config.json and checkpoints of the new architectures: what is parsed, and bad or unimplemented values refused
by name (typed errors, before anything is allocated)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from exlpy import ExLlamaV2Config
from exlpy.config.rope import cos_sin_table
from exlpy.errors import ConfigError, UnsupportedArchitectureError, WeightsError
from exlpy.model.rotary import head_permutation
from tests.arch_models import make_arch_model


def _edit(d: Path, **changes: object) -> None:
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("g2")
    make_arch_model(d, "gemma2")
    return d


def test_gemma2_values_are_parsed(gemma2: Path) -> None:
    c = ExLlamaV2Config(str(gemma2))
    f = c.spec.features
    assert f.layer_window == (8, 0) and f.attn_softcap == 0.5 and f.final_softcap == 3.0
    assert math.isclose(f.attn_scale, 24 ** -0.5) and math.isclose(f.embed_scale, 8.0)
    assert f.act == "gelu_tanh" and f.tied_head and c.arch.residual_fp32 and c.arch.requires_bos
    assert c.attn_logit_softcapping == 0.5 and c.final_logit_softcapping == 3.0


def test_older_configs_without_layer_types_use_the_architecture_pattern(tmp_path: Path, gemma2: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    for f in gemma2.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    _edit(d, layer_types=None)
    assert ExLlamaV2Config(str(d)).spec.features.layer_window == (8, 0)  # even layers local (Gemma 2)


@pytest.mark.parametrize("changes, error, needle", [
    ({"layer_types": ["sliding_attention"]}, ConfigError, "layer_types"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, ConfigError, "layer_types"),
    ({"attn_logit_softcapping": -1.0}, ConfigError, "attn_logit_softcapping"),
    ({"query_pre_attn_scalar": 0}, ConfigError, "query_pre_attn_scalar"),
    ({"hidden_activation": "xielu", "hidden_act": None}, UnsupportedArchitectureError, "xielu"),
    ({"rope_local_base_freq": 10000.0}, UnsupportedArchitectureError, "rope_local_base_freq"),  # Gemma 3 only
    ({"architectures": ["GemmoeForCausalLM"]}, UnsupportedArchitectureError, "mixture of experts"),
    ({"architectures": ["MixtralForCausalLM"], "layer_types": None}, ConfigError, "num_local_experts"),
    ({"architectures": ["MixtralForCausalLM"], "layer_types": None, "num_local_experts": 2,
      "num_experts_per_tok": 3}, ConfigError, "num_experts_per_tok"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "layer_types": None, "num_experts": 4, "num_experts_per_tok": 2,
      "mlp_only_layers": [7]}, ConfigError, "mlp_only_layers"),
])
def test_bad_values_are_named(tmp_path: Path, gemma2: Path, changes: dict, error: type, needle: str) -> None:
    d = tmp_path / "m"
    d.mkdir()
    for f in gemma2.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    _edit(d, **changes)
    with pytest.raises(error, match=needle):
        ExLlamaV2Config(str(d))


@pytest.mark.parametrize("case, changes, error, needle", [
    ("phi3", {"partial_rotary_factor": 0.05}, ConfigError, "partial_rotary_factor"),
    ("phi3", {"partial_rotary_factor": 1.5}, ConfigError, "partial_rotary_factor"),
    ("phi3_longrope", {"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 3,
                                           "long_factor": [1.0] * 3}}, ConfigError, "short_factor"),
    ("phi3_longrope", {"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 8}}, ConfigError,
     "long_factor"),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, UnsupportedArchitectureError, "inverse layer"),
    ("gpt2", {"activation_function": "quick_gelu"}, UnsupportedArchitectureError, "quick_gelu"),
])
def test_bad_values_of_other_architectures(tmp_path: Path, case: str, changes: dict, error: type,
                                           needle: str) -> None:
    make_arch_model(tmp_path, case)
    _edit(tmp_path, **changes)
    with pytest.raises(error, match=needle):
        ExLlamaV2Config(str(tmp_path))


def test_fused_tensor_of_the_wrong_size_is_named(tmp_path: Path) -> None:
    make_arch_model(tmp_path, "phi3")
    f = tmp_path / "model.safetensors"
    t = load_file(str(f))
    name = "model.layers.1.self_attn.qkv_proj.weight"
    t[name] = t[name][:-16].clone()
    save_file(t, str(f), metadata={"format": "pt"})
    with pytest.raises(WeightsError, match="qkv_proj"):
        ExLlamaV2Config(str(tmp_path))


def test_gpt2_names_are_remapped_and_views_cover_each_stored_byte_once(tmp_path: Path) -> None:
    make_arch_model(tmp_path, "gpt2")
    idx = ExLlamaV2Config(str(tmp_path)).index
    assert "model.layers.0.self_attn.q_proj.weight" in idx and "model.wpe.weight" in idx
    assert not any(n.startswith("transformer.") or ".c_attn." in n for n in idx.tensors)
    assert idx.info("model.layers.0.self_attn.q_proj.weight").shape == (64, 64)  # [out, in] after the transpose
    assert sum(t.nbytes for t in idx.tensors.values()) == sum(t.nbytes for t in idx.stored.values())


@pytest.mark.parametrize("style, rot", [("gptj", 16), ("gptj", 8), ("neox", 8), ("neox", 12), ("none", 0)])
def test_head_permutation_makes_every_layout_a_neox_rotation(style: str, rot: int) -> None:
    """Rotating x[perm] with the padded NEOX table equals the layout's own rotation, then permuted."""
    import torch

    D = 16
    perm = head_permutation(style, D, rot) or list(range(D))
    cos, sin = cos_sin_table(D, 100.0, _default(), 1.0, 1.0, 8, "cpu",
                             torch.float32, rot)
    x = torch.randn(8, D)
    want = x.clone()
    f = 1.0 / 100.0 ** (torch.arange(0, rot, 2).float() / rot) if rot else torch.zeros(0)
    ang = torch.arange(8).float().view(-1, 1) * f
    pairs = [(2 * i, 2 * i + 1) for i in range(rot // 2)] if style == "gptj" else \
        [(i, i + rot // 2) for i in range(rot // 2)]
    for i, (a, b) in enumerate(pairs):
        c, s = ang[:, i].cos(), ang[:, i].sin()
        want[:, a], want[:, b] = x[:, a] * c - x[:, b] * s, x[:, b] * c + x[:, a] * s
    xp = x[:, perm]
    h = D // 2
    got = torch.cat((xp[:, :h] * cos[:, :h] - xp[:, h:] * sin[:, :h], xp[:, h:] * cos[:, h:] + xp[:, :h] * sin[:, h:]),
                    dim=-1)
    torch.testing.assert_close(got, want[:, perm])


def _default():  # noqa: ANN202
    from exlpy.config.rope import RopeScaling

    return RopeScaling()


def test_learned_positions_bound_max_seq_len(tmp_path: Path) -> None:
    from exlpy import ExLlamaV2

    make_arch_model(tmp_path, "gpt2")
    config = ExLlamaV2Config(str(tmp_path))
    assert config.max_seq_len == 256  # n_positions
    config.max_seq_len = 300
    with pytest.raises(ConfigError, match="learned positions"):
        ExLlamaV2(config).load(device="cpu")


@pytest.mark.parametrize("case, needle", [("gemma", "gelu_tanh"), ("cohere", "LayerNorm"), ("gpt2", "LayerNorm"),
                                          ("granite", "residual multiplier"), ("phi3", None), ("glm4", None)])
def test_lora_accepts_only_blocks_its_hooks_compute(tmp_path: Path, case: str, needle: str | None) -> None:
    from exlpy.errors import LoraConfigError
    from exlpy.lora.adapter import check_architecture

    make_arch_model(tmp_path, case)
    spec = ExLlamaV2Config(str(tmp_path)).spec
    if needle is None:
        check_architecture(spec)
    else:
        with pytest.raises(LoraConfigError, match=needle):
            check_architecture(spec)
