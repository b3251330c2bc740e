"""Bad adapters and bad adapter use get typed errors that name the file, tensor, setting or limit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from exlpy import ExLlamaV2, ExLlamaV2Config, ExLlamaV2Lora
from exlpy.errors import (
    ConfigError,
    LoraCapacityError,
    LoraConfigError,
    LoraError,
    LoraWeightsError,
    ModelStateError,
    WeightsError,
)
from exlpy.lora import configure, registry_of
from tests.lora_util import write_adapter
from tests.tp_util import make_model_dir

PREFIX = "base_model.model.model.layers"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("lora_bad") / "m", hidden=64, heads=4, kv_heads=2, head_dim=16,
                          intermediate=128, vocab=300)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> ExLlamaV2:
    m = ExLlamaV2(ExLlamaV2Config(str(model_dir)))
    m.load(device="cpu")
    return m


def _config(path: Path, **changes: object) -> Path:
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return path


def test_error_hierarchy() -> None:
    assert issubclass(LoraConfigError, ConfigError) and issubclass(LoraConfigError, LoraError)
    assert issubclass(LoraWeightsError, WeightsError) and issubclass(LoraWeightsError, LoraError)


@pytest.mark.parametrize("change,match", [
    ({"peft_type": "PREFIX_TUNING"}, "not a LoRA adapter"),
    ({"use_dora": True}, "DoRA"),
    ({"bias": "all"}, "bias"),
    ({"modules_to_save": ["lm_head", "norm"]}, r"modules_to_save 'norm': replacing these modules .* only "
                                                "embed_tokens, lm_head"),
    ({"modules_to_save": "lm_head"}, "modules_to_save must be a list"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"r": "eight"}, "r must be a positive integer"),
    ({"lora_alpha": None}, "lora_alpha must be a number"),
    ({"use_rslora": "yes"}, "use_rslora"),
    ({"rank_pattern": {"q_proj": 0}}, "rank_pattern"),
    ({"target_modules": ["q_proj", "c_attn", "lm_head", "score"]}, "'c_attn', 'score' do not exist in this model"),
])
def test_bad_config(model: ExLlamaV2, model_dir: Path, tmp_path: Path, change: dict, match: str) -> None:
    d = _config(write_adapter(tmp_path / "a", model_dir, r=4), **change)
    with pytest.raises(LoraConfigError, match=match) as e:
        ExLlamaV2Lora.from_directory(model, str(d))
    assert "adapter_config.json" in str(e.value)


def test_missing_or_malformed_config(model: ExLlamaV2, model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(LoraConfigError, match="not a directory"):
        ExLlamaV2Lora.from_directory(model, str(tmp_path / "nowhere"))
    d = write_adapter(tmp_path / "a", model_dir, r=4)
    (d / "adapter_config.json").unlink()
    with pytest.raises(LoraConfigError, match=r"adapter_config.json: not found"):
        ExLlamaV2Lora.from_directory(model, str(d))
    (d / "adapter_config.json").write_text('{"r": 4, "lora_alpha": ')
    with pytest.raises(LoraConfigError, match="not readable JSON"):
        ExLlamaV2Lora.from_directory(model, str(d))
    (d / "adapter_config.json").write_text("[4]")
    with pytest.raises(LoraConfigError, match="expected a JSON object"):
        ExLlamaV2Lora.from_directory(model, str(d))


def _tensors(model_dir: Path, r: int = 4) -> dict[str, torch.Tensor]:
    return {f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.randn(r, 64),
            f"{PREFIX}.0.self_attn.q_proj.lora_B.weight": torch.randn(64, r)}


@pytest.mark.parametrize("edit,tensor,match", [
    (lambda t: t.update({f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 48)}),
     "q_proj.lora_A.weight", r"shape \[4, 48\] .* takes 64 input features, so lora_A must be \[r, 64\]"),
    (lambda t: t.update({f"{PREFIX}.0.self_attn.q_proj.lora_B.weight": torch.randn(64, 5)}),
     "q_proj.lora_B.weight", r"lora_B must be \[64, 4\]"),
    (lambda t: t.update({f"{PREFIX}.7.mlp.up_proj.lora_A.weight": torch.randn(4, 64),
                         f"{PREFIX}.7.mlp.up_proj.lora_B.weight": torch.randn(128, 4)}),
     "layers.7.mlp.up_proj", "layer 7 does not exist: the base model has 2 layers"),
    (lambda t: t.update({f"{PREFIX}.0.self_attn.c_attn.lora_A.weight": torch.randn(4, 64)}),
     "c_attn", "which this model does not have"),
    (lambda t: t.update({"base_model.model.lm_head.weight": torch.randn(320, 64)}), "lm_head",
     r"shape \[320, 64\]: a replaced lm_head must be \[300, 64\] .* resized vocabulary"),
    (lambda t: t.update({"base_model.model.model.norm.weight": torch.randn(64)}), "model.norm.weight",
     "replaced or adapted module other than lm_head / embed_tokens"),
    (lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.randn(4, 64)}), "lm_head.lora_A",
     "the other half of lm_head's LoRA pair is missing"),
    (lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.randn(4, 64),
                         "base_model.model.lm_head.lora_B.weight": torch.randn(64, 4)}), "lm_head.lora_B",
     r"shape \[64, 4\] does not fit the base model: must be \[300, 4\]"),
    (lambda t: t.update({"base_model.model.model.embed_tokens.lora_A.weight": torch.randn(4, 300)}),
     "embed_tokens.lora_A", "not a LoRA tensor PEFT writes for model.embed_tokens"),
    (lambda t: t.update({"base_model.model.model.embed_tokens.weight": torch.full((300, 64), float("nan"))}),
     "embed_tokens.weight", "NaN or inf"),
    (lambda t: t.update({"base_model.model.lm_head.weight": torch.randn(300, 64),
                         "base_model.model.lm_head.base_layer.weight": torch.randn(300, 64)}),
     "lm_head", "lm_head is replaced twice"),
    (lambda t: t.pop(f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"), "q_proj.lora_A.weight", "lora_B of .* missing"),
    (lambda t: t.update({f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 64, dtype=torch.int32)}),
     "q_proj.lora_A.weight", "not a floating-point"),
    (lambda t: t.update({f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.randn(6, 64),
                         f"{PREFIX}.0.self_attn.q_proj.lora_B.weight": torch.randn(64, 6)}),
     "q_proj.lora_A.weight", "rank 6, but .*adapter_config.json gives rank 4"),
])
def test_bad_tensors_name_tensor_and_file(model: ExLlamaV2, model_dir: Path, tmp_path: Path, edit: object,
                                          tensor: str, match: str) -> None:
    t = _tensors(model_dir)
    edit(t)  # type: ignore[operator]
    d = write_adapter(tmp_path / "a", model_dir, r=4, tensors=t)
    with pytest.raises(LoraWeightsError, match=match) as e:
        ExLlamaV2Lora.from_directory(model, str(d))
    assert tensor in str(e.value) and "adapter_model.safetensors" in str(e.value)


def test_bin_and_unreadable_weights(model: ExLlamaV2, model_dir: Path, tmp_path: Path) -> None:
    d = write_adapter(tmp_path / "a", model_dir, r=4)
    ref = ExLlamaV2Lora.from_directory(model, str(d))
    # adapter_model.bin (PEFT's pickle format) is read as exllamav2 reads it, with torch.load(weights_only=True)
    from safetensors.torch import load_file

    torch.save(load_file(str(d / "adapter_model.safetensors")), str(d / "adapter_model.bin"))
    (d / "adapter_model.safetensors").unlink()
    for lora in (ExLlamaV2Lora.from_directory(model, str(d)),
                 ExLlamaV2Lora(model, str(d / "adapter_config.json"), str(d / "adapter_model.bin"))):
        assert lora.weights.keys() == ref.weights.keys()
        assert all(torch.equal(lora.weights[k][1], ref.weights[k][1]) for k in ref.weights)
        lora.unload()
    ref.unload()

    class Payload:  # a pickle that would run code: weights_only refuses it
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (print, ("pwned",))

    torch.save({"x": Payload()}, str(d / "adapter_model.bin"))
    with pytest.raises(LoraWeightsError, match="not a readable PyTorch weights file") as e:
        ExLlamaV2Lora.from_directory(model, str(d))
    assert "adapter_model.bin" in str(e.value)
    (d / "adapter_model.bin").write_bytes(b"garbage")
    with pytest.raises(LoraWeightsError, match="not a readable PyTorch weights file"):
        ExLlamaV2Lora.from_directory(model, str(d))
    torch.save([torch.zeros(2)], str(d / "adapter_model.bin"))
    with pytest.raises(LoraWeightsError, match="dict of tensor name"):
        ExLlamaV2Lora.from_directory(model, str(d))
    (d / "adapter_model.bin").unlink()
    with pytest.raises(LoraWeightsError, match="not found"):
        ExLlamaV2Lora.from_directory(model, str(d))
    (d / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(LoraWeightsError, match="not a readable safetensors file"):
        ExLlamaV2Lora.from_directory(model, str(d))
    save_file({}, str(d / "adapter_model.safetensors"))
    with pytest.raises(LoraWeightsError, match="holds no LoRA weights"):
        ExLlamaV2Lora.from_directory(model, str(d))


def test_bad_use(model: ExLlamaV2, model_dir: Path, tmp_path: Path) -> None:
    ids = torch.tensor([[1, 5, 9]])
    with pytest.raises(LoraConfigError, match="finite"):
        ExLlamaV2Lora.from_directory(model, str(write_adapter(tmp_path / "n", model_dir, r=4)),
                                     lora_scaling=float("nan"))
    with pytest.raises(LoraConfigError, match="ExLlamaV2Lora objects"):
        model.forward(ids, loras=["my-adapter"])
    with pytest.raises(LoraConfigError, match="ExLlamaV2Lora or a list"):
        model.forward(ids, loras="my-adapter")
    other = ExLlamaV2(ExLlamaV2Config(str(model_dir)))
    other.load(device="cpu")
    foreign = ExLlamaV2Lora.from_directory(other, str(write_adapter(tmp_path / "f", model_dir, r=4)))
    with pytest.raises(ModelStateError, match="another model"):
        model.forward(ids, loras=[foreign])
    a, b, c = (ExLlamaV2Lora.from_directory(model, str(write_adapter(tmp_path / n, model_dir, r=4, seed=i)))
               for i, n in enumerate("abc"))
    with pytest.raises(LoraConfigError, match="max_adapters must be >= 1"):
        configure(model, max_adapters=0)
    configure(model, max_adapters=2)
    try:
        reg = registry_of(model)
        held = [reg.acquire([a]), reg.acquire([b])]  # e.g. two running jobs
        with pytest.raises(LoraCapacityError, match=r"slot\(s\) \[1\] are in use by running jobs; cannot shrink to 1"):
            configure(model, max_adapters=1)
        with pytest.raises(LoraCapacityError, match="all 2 adapter slots hold adapters of running jobs"):
            model.forward(ids, loras=[c])
        with pytest.raises(ModelStateError, match="in use by 1 running"):
            a.unload()
        for h in held:
            reg.release(h)
        assert model.forward(ids, loras=[c]).shape == (1, 3, 300)  # a slot was free again: c took it
    finally:
        configure(model, max_adapters=8)
    a.unload()
    a.unload()  # twice is harmless
    with pytest.raises(ModelStateError, match="unloaded"):
        model.forward(ids, loras=[a])
