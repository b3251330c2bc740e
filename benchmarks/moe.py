"""Decode speed of mixture-of-experts models on one GPU against the active-weights bandwidth limit.

python benchmarks/moe.py [--work /tmp/exlpy_moe] [--shapes qwen3_moe,mixtral] [--layers 4] [--batches 1,32]
    [--prompt-len 256] [--gen-len 64]

Random fp16 checkpoints of real models' shapes (Qwen3-30B-A3B, Mixtral-8x7B), decoder depth cut by --layers
(the embedding and head keep their size), written with safetensors directly. For each shape and batch size:
decode tokens/s through model.forward (MoE models run eagerly, without CUDA graphs, for now), the bytes of the
weights one token reads (everything but the embedding, with each MoE layer's experts counted k / E: the active
experts), and the fraction of the limit that bytes / measured copy rate gives at batch 1. Prints one line per
(shape, batch).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from exlpy.cli.bench import copy_bandwidth, load_model, time_decode, weight_bytes_read  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
                      intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                      num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                      num_experts_per_tok=8, norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1e6,
                      max_position_embeddings=4096, tie_word_embeddings=False),
    "mixtral": dict(architectures=["MixtralForCausalLM"], vocab_size=32000, hidden_size=4096,
                    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=1e6,
                    max_position_embeddings=4096, tie_word_embeddings=False),
}


def write(path: str, cfg: dict[str, Any], device: str = "cuda") -> None:
    """A random fp16 checkpoint of `cfg` (canonical Llama names; Mixtral's experts under its own names)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    g = torch.Generator(device=device).manual_seed(0)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    d, hq, hk = cfg.get("head_dim", h // cfg["num_attention_heads"]), cfg["num_attention_heads"], \
        cfg["num_key_value_heads"]
    n = cfg.get("num_experts", cfg.get("num_local_experts"))
    inter = cfg.get("moe_intermediate_size", cfg["intermediate_size"])
    mixtral = cfg["architectures"][0] == "MixtralForCausalLM"

    def rnd(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, device=device, generator=g) * std).half().cpu()

    t = {"model.embed_tokens.weight": rnd(v, h), "model.norm.weight": rnd(h, std=0) + 1, "lm_head.weight": rnd(v, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        t |= {f"{p}.input_layernorm.weight": rnd(h, std=0) + 1,
              f"{p}.post_attention_layernorm.weight": rnd(h, std=0) + 1,
              f"{p}.self_attn.q_proj.weight": rnd(hq * d, h), f"{p}.self_attn.k_proj.weight": rnd(hk * d, h),
              f"{p}.self_attn.v_proj.weight": rnd(hk * d, h), f"{p}.self_attn.o_proj.weight": rnd(h, hq * d)}
        if not mixtral:
            t |= {f"{p}.self_attn.q_norm.weight": rnd(d, std=0) + 1,
                  f"{p}.self_attn.k_norm.weight": rnd(d, std=0) + 1}
        moe = f"{p}.block_sparse_moe" if mixtral else f"{p}.mlp"
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        t[f"{moe}.gate.weight"] = rnd(n, h, std=0.5)  # decisive, spread routing
        for e in range(n):
            t |= {f"{moe}.experts.{e}.{names[0]}.weight": rnd(inter, h), f"{moe}.experts.{e}.{names[1]}.weight":
                  rnd(inter, h), f"{moe}.experts.{e}.{names[2]}.weight": rnd(h, inter)}
    save_file(t, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/exlpy_moe")
    ap.add_argument("--shapes", default="qwen3_moe,mixtral")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=64)
    a = ap.parse_args()
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}, copy rate {bw / 1e9:.0f} GB/s")
    for name in a.shapes.split(","):
        cfg = {**SHAPES[name], "num_hidden_layers": a.layers}
        path = os.path.join(a.work, f"{name}_{a.layers}")
        if not os.path.exists(os.path.join(path, "model.safetensors")):
            write(path, cfg)
        model = load_model(path, a.prompt_len + a.gen_len + 8, max(int(b) for b in a.batches.split(",")))
        act = weight_bytes_read(model)  # an MoE layer's experts counted k / E
        for b in (int(x) for x in a.batches.split(",")):
            r = time_decode(model, b, a.prompt_len, a.gen_len)
            tps = b * a.gen_len / r.seconds
            limit = bw / act
            print(f"{name} layers={a.layers} batch={b}: {tps:,.1f} tokens/s ({tps / b:,.1f} steps/s), active "
                  f"weights {act / 2**20:,.0f} MiB/token, batch-1 limit {limit:,.1f} tokens/s, "
                  f"{100 * tps / b / limit:.0f}% of it per step")
        model.unload()
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
