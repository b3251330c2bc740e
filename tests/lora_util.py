"""Helpers for the LoRA tests: adapters made with PEFT itself, and PEFT-layout adapter directories written
directly (for models without a transformers twin, and for malformed adapters)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
         "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def peft_adapter(hf_model: Any, path: Path, r: int, alpha: float, targets: list[str] | None = None,
                 seed: int = 0, std: float = 0.05, **config: Any) -> Any:
    """Wrap `hf_model` with a PEFT LoRA adapter whose A and B are random (PEFT starts B at zero), save it to
    `path` and return the PEFT model in eval mode (fp32)."""
    import peft

    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ALL, lora_dropout=0.0, **config)
    model = peft.get_peft_model(hf_model, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(str(path))
    return model.eval()


def shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, int]]:
    h = cfg["hidden_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    hq, hk, inter = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d, cfg["intermediate_size"]
    return {"q_proj": (h, hq), "k_proj": (h, hk), "v_proj": (h, hk), "o_proj": (hq, h), "gate_proj": (h, inter),
            "up_proj": (h, inter), "down_proj": (inter, h)}


def write_adapter(path: Path, model_dir: Path, r: int, alpha: float = 16.0, targets: list[str] | None = None,
                  seed: int = 0, std: float = 0.05, config: dict[str, Any] | None = None,
                  tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """A PEFT-layout adapter for the model in `model_dir` with random A and B (or exactly `tensors`)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    path.mkdir(parents=True, exist_ok=True)
    targets = targets or ALL
    if tensors is None:
        g = torch.Generator().manual_seed(seed)
        tensors = {}
        for i in range(cfg["num_hidden_layers"]):
            for proj in targets:
                k, n = shapes(cfg)[proj]
                p = f"base_model.model.model.layers.{i}.{BLOCK[proj]}.{proj}"
                tensors[f"{p}.lora_A.weight"] = torch.randn(r, k, generator=g) * std
                tensors[f"{p}.lora_B.weight"] = torch.randn(n, r, generator=g) * std
    save_file(tensors, str(path / "adapter_model.safetensors"))
    meta = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": targets, "bias": "none",
            "use_rslora": False, "fan_in_fan_out": False, **(config or {})}
    (path / "adapter_config.json").write_text(json.dumps(meta))
    return path


def demo_with_two_adapters(root: Path, max_seq_len: int) -> dict[str, Any]:
    """A CPU instance of the bundled demo model of its own (adapters registered on it stay out of other tests'
    models) with two random adapters: `a` (rank 8, all projections) and `b` (rank 4, v/up/down)."""
    from exlpy import ExLlamaV2, ExLlamaV2Config, ExLlamaV2Lora, ExLlamaV2Tokenizer
    from exlpy.demo import DEMO_MODEL_DIR

    cfg = ExLlamaV2Config(DEMO_MODEL_DIR)
    cfg.max_seq_len = max_seq_len
    model = ExLlamaV2(cfg)
    model.load(device="cpu")
    d = Path(DEMO_MODEL_DIR)
    a = ExLlamaV2Lora.from_directory(model, str(write_adapter(root / "a", d, r=8, seed=1, std=0.3)))
    b = ExLlamaV2Lora.from_directory(model, str(write_adapter(root / "b", d, r=4, seed=2, std=0.3,
                                                              targets=["v_proj", "up_proj", "down_proj"])))
    return {"model": model, "tok": ExLlamaV2Tokenizer(cfg), "a": a, "b": b, "root": root}
