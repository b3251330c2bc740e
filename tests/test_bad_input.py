"""Bad input gives a typed error that names the problem, never a stack trace from deep inside torch."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config
from exlpy.errors import (
    CacheTooSmallError,
    ConfigError,
    ModelStateError,
    SequenceLengthError,
    UnsupportedArchitectureError,
    WeightsError,
)
from tests.hf_models import make_hf_model


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    make_hf_model(tmp_path / "m", "llama")
    return tmp_path / "m"


def _edit_config(d: Path, **changes: object) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        ExLlamaV2Config(str(tmp_path / "nope"))


def test_missing_config(model_dir: Path) -> None:
    (model_dir / "config.json").unlink()
    with pytest.raises(ConfigError, match="config.json"):
        ExLlamaV2Config(str(model_dir))


def test_malformed_config(model_dir: Path) -> None:
    (model_dir / "config.json").write_text("{ not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ExLlamaV2Config(str(model_dir))


def test_config_wrong_type(model_dir: Path) -> None:
    _edit_config(model_dir, hidden_size="big")
    with pytest.raises(ConfigError, match="hidden_size"):
        ExLlamaV2Config(str(model_dir))


def test_unknown_architecture_runs_as_llama_with_a_warning(model_dir: Path) -> None:
    # exllamav2's behaviour: an unknown architecture string is loaded as Llama, with a warning naming it.
    _edit_config(model_dir, architectures=["MyLlamaForCausalLM"])
    with pytest.warns(UserWarning, match="MyLlamaForCausalLM.*LlamaForCausalLM"):
        config = ExLlamaV2Config(str(model_dir))
    assert config.arch.name == "LlamaForCausalLM" and config.architecture == "MyLlamaForCausalLM"


def test_multiple_architectures(model_dir: Path) -> None:
    _edit_config(model_dir, architectures=["LlamaForCausalLM", "MistralForCausalLM"])
    with pytest.raises(ConfigError, match="Multiple architectures"):
        ExLlamaV2Config(str(model_dir))


@pytest.mark.parametrize("changes, needle", [
    ({"hidden_act": "xielu"}, "hidden_act"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}, "rope_parameters": None}, "dynamic"),
    ({"quantization_config": {"quant_method": "awq"}}, "awq"),
    ({"alibi": True}, "alibi"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16}, "layer_types"),
])
def test_unsupported_settings_named(model_dir: Path, changes: dict, needle: str) -> None:
    _edit_config(model_dir, **changes)
    with pytest.raises(UnsupportedArchitectureError, match=needle):
        ExLlamaV2Config(str(model_dir))


def test_no_safetensors(model_dir: Path) -> None:
    for f in model_dir.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(WeightsError, match="No .safetensors files found"):
        ExLlamaV2Config(str(model_dir))


def _st_file(d: Path) -> Path:
    return next(d.glob("*.safetensors"))


def _truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _garble_header(data: bytes) -> bytes:
    return data[:8] + b"\xff\xfe{{" + data[12:]


def _huge_header_length(data: bytes) -> bytes:
    return struct.pack("<Q", 10**12) + data[8:]


def _empty(data: bytes) -> bytes:
    return b""


@pytest.mark.parametrize("corrupt, match", [
    (_truncate, "truncated or corrupt"),
    (_garble_header, "corrupt safetensors header"),
    (_huge_header_length, "header length"),
    (_empty, "truncated"),
])
def test_damaged_safetensors_file(model_dir: Path, corrupt, match: str) -> None:  # noqa: ANN001
    f = _st_file(model_dir)
    f.write_bytes(corrupt(f.read_bytes()))
    with pytest.raises(WeightsError, match=match) as e:
        ExLlamaV2Config(str(model_dir))
    assert str(f) in str(e.value)  # the message names the damaged file


def _rewrite(model_dir: Path, fn) -> None:  # noqa: ANN001
    from safetensors.torch import load_file, save_file

    f = _st_file(model_dir)
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def test_missing_tensor_named(model_dir: Path) -> None:
    _rewrite(model_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(WeightsError, match=r"model\.layers\.1\.mlp\.up_proj"):
        ExLlamaV2Config(str(model_dir))


def test_wrong_shape_names_tensor_and_file(model_dir: Path) -> None:
    def shrink(t: dict) -> None:
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:8].clone()

    _rewrite(model_dir, shrink)
    model = ExLlamaV2(ExLlamaV2Config(str(model_dir)))
    with pytest.raises(WeightsError, match=r"k_proj\.weight.*wrong shape|wrong shape.*k_proj") as e:
        model.load()
    assert _st_file(model_dir).name in str(e.value)


def test_stale_index_json_is_ignored(model_dir: Path) -> None:
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00001-of-00009.safetensors"}}))
    ExLlamaV2(ExLlamaV2Config(str(model_dir))).load()


def test_sharded_checkpoint(tmp_path: Path) -> None:
    """Shards found by globbing: split a checkpoint into three files."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    make_hf_model(src, "llama")
    dst = tmp_path / "sharded"
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(_st_file(src))
    names = sorted(tensors)
    for i in range(3):
        save_file({n: tensors[n] for n in names[i::3]}, dst / f"model-0000{i + 1}-of-00003.safetensors")
    a = ExLlamaV2(ExLlamaV2Config(str(src)))
    b = ExLlamaV2(ExLlamaV2Config(str(dst)))
    a.load(), b.load()
    ids = torch.randint(0, 320, (1, 9))
    assert torch.equal(a.forward(ids), b.forward(ids))


def test_prompt_longer_than_max_input_len(model_dir: Path) -> None:
    config = ExLlamaV2Config(str(model_dir))
    config.max_input_len = 16
    model = ExLlamaV2(config)
    model.load()
    with pytest.raises(SequenceLengthError, match="Maximum input length exceeded"):
        model.forward(torch.zeros(1, 17, dtype=torch.long))


def test_prompt_longer_than_cache(model_dir: Path) -> None:
    config = ExLlamaV2Config(str(model_dir))
    config.max_seq_len = 32
    model = ExLlamaV2(config)
    cache = ExLlamaV2Cache(model, lazy=True)
    model.load_autosplit(cache)
    with pytest.raises(CacheTooSmallError, match="exceeds cache size"):
        model.forward(torch.zeros(1, 33, dtype=torch.long), cache)
    model.forward(torch.zeros(1, 30, dtype=torch.long), cache)
    with pytest.raises(CacheTooSmallError, match="30 cached"):
        model.forward(torch.zeros(1, 3, dtype=torch.long), cache)
    assert cache.current_seq_len == 30  # nothing the user had is lost


def test_cache_batch_too_small(model_dir: Path) -> None:
    model = ExLlamaV2(ExLlamaV2Config(str(model_dir)))
    cache = ExLlamaV2Cache(model, lazy=True, max_seq_len=32)
    model.load_autosplit(cache)
    with pytest.raises(CacheTooSmallError, match="batch"):
        model.forward(torch.zeros(2, 4, dtype=torch.long), cache)


def test_forward_before_load_and_double_load(model_dir: Path) -> None:
    model = ExLlamaV2(ExLlamaV2Config(str(model_dir)))
    with pytest.raises(ModelStateError, match="not loaded"):
        model.forward(torch.zeros(1, 2, dtype=torch.long))
    model.load()
    with pytest.raises(ModelStateError, match="already loaded"):
        model.load()
