"""Tiny random Hugging Face models of every supported architecture, written to disk for comparison tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

BASE: dict[str, Any] = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            rms_norm_eps=1e-6, rope_theta=10000.0)


def make_hf_model(path: Path, arch: str = "llama", dtype: torch.dtype = torch.float32, seed: int = 0,
                  **overrides: Any) -> Any:
    """Build a random model with transformers, save it as safetensors in `path`, return the HF model (fp32)."""
    import transformers as tf

    classes = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
    }
    cfg_cls, model_cls = classes[arch]
    kw = {**BASE, **overrides}
    if arch == "qwen3":
        kw.setdefault("head_dim", 32)
    torch.manual_seed(seed)
    config = cfg_cls(**kw)
    model = model_cls(config).eval()
    with torch.no_grad():
        # Default init leaves norms at 1 and biases at 0; randomize them so they are exercised.
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.05 * torch.randn_like(p))
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    return model.float()
