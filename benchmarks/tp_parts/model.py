"""The tensor-parallel benchmark's model: 70B-layer-shaped Llama layers (hidden 8192, intermediate 28672, 64 Q /
8 KV heads, head_dim 128), fp16 random weights written once."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def build_model(path: Path, layers: int, vocab: int, hidden: int = 8192, inter: int = 28672, heads: int = 64,
                kv: int = 8, hd: int = 128) -> Path:
    from safetensors.torch import save_file

    if (path / "done").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv, "head_dim": hd, "vocab_size": vocab, "rms_norm_eps": 1e-5,
           "rope_theta": 500000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
           "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2}
    (path / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator(device="cuda:0").manual_seed(0)

    def r(*shape: int, std: float = 0.01) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device="cuda:0", dtype=torch.float16) * std).cpu()

    # One random layer reused for every layer keeps the build fast; the benchmark only needs the shapes.
    layer = {"input_layernorm.weight": torch.ones(hidden, dtype=torch.float16),
             "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.float16),
             "self_attn.q_proj.weight": r(heads * hd, hidden), "self_attn.k_proj.weight": r(kv * hd, hidden),
             "self_attn.v_proj.weight": r(kv * hd, hidden), "self_attn.o_proj.weight": r(hidden, heads * hd),
             "mlp.gate_proj.weight": r(inter, hidden), "mlp.up_proj.weight": r(inter, hidden),
             "mlp.down_proj.weight": r(hidden, inter, std=0.006)}
    wmap = {}
    for i in range(layers):
        name = f"layer{i}.safetensors"
        save_file({f"model.layers.{i}.{k}": v for k, v in layer.items()}, str(path / name))
        wmap.update({f"model.layers.{i}.{k}": name for k in layer})
    save_file({"model.embed_tokens.weight": r(vocab, hidden, std=1.0), "model.norm.weight":
               torch.ones(hidden, dtype=torch.float16), "lm_head.weight": r(vocab, hidden)},
              str(path / "outer.safetensors"))
    wmap.update({k: "outer.safetensors" for k in ("model.embed_tokens.weight", "model.norm.weight",
                                                  "lm_head.weight")})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    (path / "done").write_text("ok")
    return path
