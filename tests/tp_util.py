"""Helpers for the tensor-parallel tests: tiny random HF-layout model directories."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def make_model_dir(path: Path, arch: str = "LlamaForCausalLM", hidden: int = 192, heads: int = 6,
                   kv_heads: int = 3, head_dim: int = 32, intermediate: int = 768, vocab: int = 1600,
                   layers: int = 2, tie: bool = False, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """Write config.json + model.safetensors with random weights (std 0.05) for a Llama/Qwen2/Qwen3 model."""
    g = torch.Generator().manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    model_type = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                  "MistralForCausalLM": "mistral"}.get(arch, "llama")
    cfg = {"architectures": [arch], "model_type": model_type, "hidden_size": hidden,
           "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "max_position_embeddings": 256, "tie_word_embeddings": tie,
           "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
    (path / "config.json").write_text(json.dumps(cfg))

    def r(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.05).to(dtype)

    def norm(n: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(n, generator=g)).to(dtype)

    t = {"model.embed_tokens.weight": r(vocab, hidden), "model.norm.weight": norm(hidden)}
    if not tie:
        t["lm_head.weight"] = r(vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = norm(hidden)
        t[f"{p}.post_attention_layernorm.weight"] = norm(hidden)
        t[f"{p}.self_attn.q_proj.weight"] = r(heads * head_dim, hidden)
        t[f"{p}.self_attn.k_proj.weight"] = r(kv_heads * head_dim, hidden)
        t[f"{p}.self_attn.v_proj.weight"] = r(kv_heads * head_dim, hidden)
        t[f"{p}.self_attn.o_proj.weight"] = r(hidden, heads * head_dim)
        if arch == "Qwen2ForCausalLM":
            for n, size in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                t[f"{p}.self_attn.{n}_proj.bias"] = r(size * head_dim)
        if arch == "Qwen3ForCausalLM":
            t[f"{p}.self_attn.q_norm.weight"] = norm(head_dim)
            t[f"{p}.self_attn.k_norm.weight"] = norm(head_dim)
        t[f"{p}.mlp.gate_proj.weight"] = r(intermediate, hidden)
        t[f"{p}.mlp.up_proj.weight"] = r(intermediate, hidden)
        t[f"{p}.mlp.down_proj.weight"] = r(hidden, intermediate)
    save_file({k: v.contiguous() for k, v in t.items()}, str(path / "model.safetensors"))
    return path
