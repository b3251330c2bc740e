"""Hostile config.json values: each is a ConfigError naming the key (and the limit), raised before anything is
allocated from it; runtime settings assigned after construction are checked the same way."""

from __future__ import annotations

import json
import shutil
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch

from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config
from exlpy.errors import ConfigError


@pytest.fixture
def model_dir(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    d = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, d)
    return d


def _edit(d: Path, **changes: Any) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))  # NaN/Infinity are written as Python's json reads them


NAN, INF = float("nan"), float("inf")
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}

# case: (config changes, the key the message must name)
CASES: dict[str, tuple[dict[str, Any], str]] = {
    "rope_theta_nan": ({"rope_theta": NAN}, "rope_theta"),
    "rope_theta_zero": ({"rope_theta": 0}, "rope_theta"),
    "rope_theta_negative": ({"rope_theta": -10000.0}, "rope_theta"),
    "rope_theta_string": ({"rope_theta": "1e4"}, "rope_theta"),
    "rope_factor_zero": ({"rope_scaling": {"type": "linear", "factor": 0}}, "rope_scaling.factor"),
    "rope_factor_string": ({"rope_scaling": {"type": "linear", "factor": "two"}}, "rope_scaling.factor"),
    "rope_factor_list": ({"rope_scaling": {"type": "linear", "factor": [2]}}, "rope_scaling.factor"),
    "rope_factor_inf": ({"rope_scaling": {**YARN, "factor": INF}}, "rope_scaling.factor"),
    "llama3_low_freq_zero": ({"rope_scaling": {**LLAMA3, "low_freq_factor": 0}}, "low_freq_factor"),
    "llama3_high_freq_zero": ({"rope_scaling": {**LLAMA3, "high_freq_factor": 0}}, "high_freq_factor"),
    "llama3_high_equals_low": ({"rope_scaling": {**LLAMA3, "high_freq_factor": 1.0}}, "high_freq_factor"),
    "yarn_negative_original_length": ({"rope_scaling": {**YARN, "original_max_position_embeddings": -64}},
                                      "original_max_position_embeddings"),
    "yarn_original_length_string": ({"rope_scaling": {**YARN, "original_max_position_embeddings": "64"}},
                                    "original_max_position_embeddings"),
    "yarn_beta_zero": ({"rope_scaling": {**YARN, "beta_fast": 0}}, "beta_fast"),
    "rms_norm_eps_inf": ({"rms_norm_eps": INF}, "rms_norm_eps"),
    "rms_norm_eps_zero": ({"rms_norm_eps": 0}, "rms_norm_eps"),
    "rms_norm_eps_negative": ({"rms_norm_eps": -1e-6}, "rms_norm_eps"),
    "bos_id_string": ({"bos_token_id": "1"}, "bos_token_id"),
    "eos_ids_strings": ({"eos_token_id": ["2", "3"]}, "eos_token_id"),
    "pad_id_float": ({"pad_token_id": 0.5}, "pad_token_id"),
    "text_config_int": ({"text_config": 5}, "text_config"),
    "architectures_dict": ({"architectures": [{}]}, "architectures"),
    "architectures_string": ({"architectures": "LlamaForCausalLM"}, "architectures"),
    "max_positions_zero": ({"max_position_embeddings": 0}, "max_position_embeddings"),
    "max_positions_negative": ({"max_position_embeddings": -5}, "max_position_embeddings"),
    "max_positions_huge": ({"max_position_embeddings": 10**12}, "max_position_embeddings"),
    "layers_huge": ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    "layers_zero": ({"num_hidden_layers": 0}, "num_hidden_layers"),
    "hidden_huge": ({"hidden_size": 10**15}, "hidden_size"),
    "vocab_huge": ({"vocab_size": 10**400}, "vocab_size"),
    "heads_zero": ({"num_attention_heads": 0}, "num_attention_heads"),
    "head_dim_odd": ({"head_dim": 15}, "head_dim"),
    "intermediate_bool": ({"intermediate_size": True}, "intermediate_size"),
    "eos_outside_vocab": ({"eos_token_id": 10**6}, "eos_token_id"),
    "eos_list_outside_vocab": ({"eos_token_id": [2, 320]}, "eos_token_id"),  # the tiny model's vocab is 320
    "bos_outside_vocab": ({"bos_token_id": 320}, "bos_token_id"),
    "sliding_window_negative": ({"sliding_window": -4096}, "sliding_window"),
    "yarn_without_factor": ({"rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 64}},
                            "factor"),
    "linear_without_factor": ({"rope_scaling": {"type": "linear"}}, "factor"),
    "llama3_without_factor": ({"rope_scaling": {k: v for k, v in LLAMA3.items() if k != "factor"}}, "factor"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_config_value(model_dir: Path, case: str) -> None:
    changes, key = CASES[case]
    _edit(model_dir, **changes)
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError) as e:
            ExLlamaV2Config(str(model_dir))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert key in str(e.value)
    assert str(model_dir / "config.json") in str(e.value)  # which file
    assert peak < 16 * 2**20, f"{peak / 2**20:.0f} MiB allocated before the error"  # nothing sized from it


def test_limit_is_named(model_dir: Path) -> None:
    _edit(model_dir, num_hidden_layers=10**9)
    with pytest.raises(ConfigError, match=r"\[1, 4096\]"):
        ExLlamaV2Config(str(model_dir))


def test_integer_of_5000_digits(model_dir: Path) -> None:
    text = (model_dir / "config.json").read_text().replace('"vocab_size": 320', '"vocab_size": ' + "9" * 5000)
    (model_dir / "config.json").write_text(text)
    with pytest.raises(ConfigError, match="not valid JSON") as e:
        ExLlamaV2Config(str(model_dir))
    assert str(model_dir / "config.json") in str(e.value)


def test_config_json_is_a_directory(model_dir: Path) -> None:
    (model_dir / "config.json").unlink()
    (model_dir / "config.json").mkdir()
    with pytest.raises(ConfigError, match="directory") as e:
        ExLlamaV2Config(str(model_dir))
    assert str(model_dir / "config.json") in str(e.value)


def test_deeply_nested_config(model_dir: Path) -> None:
    (model_dir / "config.json").write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ConfigError, match="nested too deeply"):
        ExLlamaV2Config(str(model_dir))


@pytest.mark.parametrize("content", ['{"eos_token_id": "x"}', "[1]", "{"])
def test_bad_generation_config(model_dir: Path, content: str) -> None:
    (model_dir / "generation_config.json").write_text(content)
    with pytest.raises(ConfigError) as e:
        ExLlamaV2Config(str(model_dir))
    assert str(model_dir / "generation_config.json") in str(e.value)


def test_valid_rope_configs_still_load(model_dir: Path) -> None:
    for rs in (LLAMA3, YARN, {"type": "linear", "factor": 2}, {"rope_type": "default"}):
        _edit(model_dir, rope_scaling=rs)
        assert ExLlamaV2Config(str(model_dir)).spec is not None


# Runtime settings: exllamav2 scripts assign them between construction and load.
SETTINGS: dict[str, tuple[str, Any]] = {
    "scale_pos_emb_zero": ("scale_pos_emb", 0.0),
    "scale_pos_emb_nan": ("scale_pos_emb", NAN),
    "scale_alpha_negative": ("scale_alpha_value", -1.0),
    "max_seq_len_huge": ("max_seq_len", 10**12),
    "max_seq_len_float": ("max_seq_len", 64.5),
    "max_input_len_zero": ("max_input_len", 0),
    "max_batch_size_string": ("max_batch_size", "4"),
    "dtype_int32": ("dtype", torch.int32),
    "dtype_string": ("dtype", "float16"),
}


@pytest.mark.parametrize("case", list(SETTINGS))
def test_bad_runtime_setting(model_dir: Path, case: str) -> None:
    key, value = SETTINGS[case]
    config = ExLlamaV2Config(str(model_dir))
    with pytest.raises(ConfigError, match=key):  # refused when set (RoPE attributes) or when the model is built
        setattr(config, key, value)
        ExLlamaV2(config)
    # set after the model was built: refused at the latest at load, before any module or cache is allocated
    setattr(config, key, getattr(ExLlamaV2Config(str(model_dir)), key))
    model = ExLlamaV2(config)
    with pytest.raises(ConfigError, match=key):
        setattr(config, key, value)
        model.load(device="cpu")
    assert not model.loaded and all(m.device is None for m in model.modules)


def test_dtype_int32_at_cache(model_dir: Path) -> None:
    config = ExLlamaV2Config(str(model_dir))
    model = ExLlamaV2(config)
    model.load(device="cpu")
    config.dtype = torch.int32
    with pytest.raises(ConfigError, match="dtype"):
        ExLlamaV2Cache(model, max_seq_len=32)


def test_numpy_and_torch_integers_are_integers(model_dir: Path) -> None:
    import numpy as np

    config = ExLlamaV2Config(str(model_dir))
    config.max_seq_len, config.max_input_len = np.int64(64), torch.tensor(32)
    model = ExLlamaV2(config)
    model.load(device="cpu")
    cache = ExLlamaV2Cache(model, max_seq_len=np.int32(64), batch_size=np.int64(1))
    assert cache.max_seq_len == 64 and model.forward(torch.tensor([[1, 2, 3]]), cache).shape == (1, 3, 320)


def test_generation_config_eos_outside_vocab(model_dir: Path) -> None:
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5000]}))
    with pytest.raises(ConfigError, match=r"generation_config.json: eos_token_id 5000 is outside the vocabulary"):
        ExLlamaV2Config(str(model_dir))
