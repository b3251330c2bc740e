"""Tiny random models of every architecture beyond Llama, written by transformers' own `save_pretrained`
(fp16), and their fp32 reference.

The reference is the transformers model itself with the weights as saved (rounded to fp16, then back to
fp32), so that exlpy, loading the fp16 file in fp32, computes on exactly the reference's weights. Norm weights
and biases are randomized (the default init leaves them at 1 and 0, which would hide a missing or misplaced
one). Architectures transformers lacks (Yi, Orion, InternLM2, MiniCPM, Index) are written here from the spec
(`../shared/spec/exllamav2-facts.md` §1-2) as a Llama / Granite checkpoint renamed or repacked, with the
reference built from the same weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

VOCAB = 320
COMMON: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                              pad_token_id=0, bos_token_id=2, eos_token_id=1)
GPT: dict[str, Any] = dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=0,
                           eos_token_id=1)

# name -> (transformers model_type, config overrides)
HF_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma": ("gemma", {**COMMON, "head_dim": 16}),
    "gemma2": ("gemma2", {**COMMON, "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8,
                          "attn_logit_softcapping": 0.5, "final_logit_softcapping": 3.0,
                          "initializer_range": 0.2}),
    # Gemma 3 (text): Gemma 2's four norms and fp32 residual, q/k norms, a local layer then a global one with
    # their own RoPE bases, no soft-caps.
    "gemma3": ("gemma3_text", {**COMMON, "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8,
                               "layer_types": ["sliding_attention", "full_attention"]}),
    "phi3": ("phi3", {**COMMON}),
    "phi3_partial": ("phi3", {**COMMON, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                            "partial_rotary_factor": 0.5}}),
    "phi3_longrope": ("phi3", {**COMMON, "original_max_position_embeddings": 32, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.0 + 0.5 * i for i in range(8)]}}),
    "phi3_window": ("phi3", {**COMMON, "sliding_window": 8}),
    "granite": ("granite", {**COMMON, "embedding_multiplier": 3.0, "logits_scaling": 2.5,
                            "residual_multiplier": 0.4, "attention_multiplier": 0.2}),
    "cohere": ("cohere", {**COMMON, "logit_scale": 0.5}),
    "cohere_qk_norm": ("cohere", {**COMMON, "use_qk_norm": True, "num_key_value_heads": 4}),
    "cohere2": ("cohere2", {**COMMON, "sliding_window": 8, "head_dim": 16, "initializer_range": 0.1,
                            "layer_types": ["sliding_attention", "full_attention"]}),
    "starcoder2": ("starcoder2", {**COMMON, "sliding_window": 8, "use_bias": True}),
    "gpt2": ("gpt2", GPT),
    "gpt_bigcode": ("gpt_bigcode", {**GPT, "multi_query": True}),
    "glm4": ("glm4", {**COMMON, "head_dim": 16, "attention_bias": True}),
    # Mixture of experts: 4 experts, top 2. Qwen3-MoE with a dense layer (mlp_only_layers) and renormalised
    # top-k, and without renormalisation with its dense layer from decoder_sparse_step.
    "mixtral": ("mixtral", {**COMMON, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("qwen3_moe", {**COMMON, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                                "mlp_only_layers": [1], "norm_topk_prob": True}),
    "qwen3_moe_sparse_step": ("qwen3_moe", {**COMMON, "num_experts": 4, "num_experts_per_tok": 2,
                                            "moe_intermediate_size": 48, "decoder_sparse_step": 2,
                                            "norm_topk_prob": False}),
    # DBRX: fused Wqkv clipped at 0.5 (below the random projections' range, so the clamp acts), experts fused
    # per layer, LayerNorm without bias.
    "dbrx": ("dbrx", dict(vocab_size=VOCAB, d_model=64, n_heads=4, n_layers=2, max_seq_len=256,
                          attn_config={"kv_n_heads": 2, "clip_qkv": 0.5, "rope_theta": 10000.0},
                          ffn_config={"ffn_hidden_size": 48, "moe_num_experts": 4, "moe_top_k": 2})),
}


def _randomize(model: Any) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 2)[-2] if "." in name else name
            is_norm = "norm" in leaf or leaf.startswith("ln")
            if is_norm and name.endswith(".weight"):
                # Gemma stores weight - 1: values near 0 there, near 1 elsewhere; both well away from trivial.
                p.copy_((0.0 if "gemma" in type(model).__name__.lower() else 1.0) + 0.1 * torch.randn_like(p))
            elif name.endswith(("block_sparse_moe.gate.weight", "mlp.gate.weight", "ffn.router.layer.weight")):
                # MoE routers: decisive routing, so that no top-k choice hangs on a rounding difference
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.05 * torch.randn_like(p))


def reference_model(config: Any) -> Any:
    """transformers' model for `config` with its eager attention, the implementation that spells out every
    feature. Its default, SDPA, may drop some: transformers 5.17 runs Gemma 2 on SDPA, which ignores
    `attn_logit_softcapping` (later releases refuse SDPA for Gemma 2), and the reference silently differed from
    the model (relative logit error 1.3 against a correct exlpy)."""
    import transformers as tf

    return tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def save_fp16(model: Any, path: Path) -> Any:
    """Save `model` in fp16 and return it in fp32 with the saved (rounded) weights: the reference. Buffers
    (RoPE's inv_freq) are kept in fp32, as transformers computes them when it loads a model."""
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    model.to(torch.float16).save_pretrained(path, safe_serialization=True)
    model.float().eval()
    _restore_buffers(model, buffers)
    return model


def _restore_buffers(model: Any, buffers: dict[str, torch.Tensor]) -> None:
    for name, b in buffers.items():
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        module._buffers[leaf] = b


def make_arch_model(path: Path, case: str, seed: int = 0, **overrides: Any) -> Any:
    """Write the tiny model `case` (HF_CASES or SPEC_CASES) to `path`; return a callable ids -> fp32 logits.
    `overrides` change the transformers config (HF_CASES only)."""
    if case in SPEC_CASES:
        return SPEC_CASES[case](path, seed)
    import transformers as tf

    model_type, kw = HF_CASES[case]
    kw = {**kw, **overrides}
    torch.manual_seed(seed)
    config = tf.AutoConfig.for_model(model_type, **kw)
    model = reference_model(config)
    _randomize(model)
    return save_fp16(model, path)


# --- architectures transformers does not ship: checkpoints written from the spec --------------------------------

class _Half:
    """A Llama-shaped transformers model in fp16 (to write), `.float()` giving the fp32 reference with its
    RoPE buffers as transformers computes them."""

    def __init__(self, model: Any) -> None:
        self.buffers = {n: b.clone() for n, b in model.named_buffers()}
        self.model = model.to(torch.float16)

    def float(self) -> Any:
        self.model.float().eval()
        _restore_buffers(self.model, self.buffers)
        return self.model


def _llama(path: Path, seed: int, cls: str = "llama", **kw: Any) -> Any:
    import transformers as tf

    torch.manual_seed(seed)
    config = tf.AutoConfig.for_model(cls, **{**COMMON, **kw})
    model = reference_model(config)
    _randomize(model)
    return _Half(model)


def _write(path: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))


def _llama_config(model: Any, arch: str, **extra: Any) -> dict[str, Any]:
    c = model.model.config
    return {"architectures": [arch], "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False, **extra}


def _renamed(model: Any, rename: dict[str, str]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in model.model.state_dict().items():
        for old, new in rename.items():
            k = k.replace(old, new)
        out[k] = v
    return out


def make_yi(path: Path, seed: int) -> Any:
    """Yi: Llama with its layer norms named ln1 / ln2."""
    model = _llama(path, seed)
    _write(path, _renamed(model, {".input_layernorm.": ".ln1.", ".post_attention_layernorm.": ".ln2."}),
           _llama_config(model, "YiForCausalLM"))
    return model.float()


def make_internlm2(path: Path, seed: int) -> Any:
    """InternLM2: Llama renamed, with q|k|v packed per KV group into `wqkv` (spec §1 "altpack")."""
    model = _llama(path, seed)
    c = model.model.config
    d, hk = c.hidden_size // c.num_attention_heads, c.num_key_value_heads
    g = c.num_attention_heads // hk
    sd = _renamed(model, {"model.embed_tokens.": "model.tok_embeddings.", "lm_head.": "output.",
                          ".input_layernorm.": ".attention_norm.", ".post_attention_layernorm.": ".ffn_norm.",
                          ".self_attn.o_proj.": ".attention.wo.", ".mlp.gate_proj.": ".feed_forward.w1.",
                          ".mlp.up_proj.": ".feed_forward.w3.", ".mlp.down_proj.": ".feed_forward.w2."})
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}.self_attn"
        q = sd.pop(f"{p}.q_proj.weight").view(hk, g, d, -1)
        k = sd.pop(f"{p}.k_proj.weight").view(hk, 1, d, -1)
        v = sd.pop(f"{p}.v_proj.weight").view(hk, 1, d, -1)
        sd[f"model.layers.{i}.attention.wqkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, c.hidden_size)
    _write(path, sd, _llama_config(model, "InternLM2ForCausalLM"))
    return model.float()


def make_index(path: Path, seed: int) -> Any:
    """Index: Llama with `norm_head` (the head's rows L2-normalized at load)."""
    model = _llama(path, seed)
    _write(path, model.model.state_dict(), _llama_config(model, "IndexForCausalLM", norm_head=True))
    ref = model.float()
    with torch.no_grad():
        w = ref.lm_head.weight
        w.copy_(w / w.norm(dim=-1, keepdim=True))
    return ref


def make_minicpm(path: Path, seed: int) -> Any:
    """MiniCPM: Llama names with scale_emb, scale_depth / sqrt(layers) residuals and logits divided by
    hidden / dim_model_base. transformers' Granite computes exactly that, so it is the reference."""
    scale_emb, scale_depth, base = 4.0, 1.4, 16
    model = _llama(path, seed, "granite", embedding_multiplier=scale_emb,
                   residual_multiplier=scale_depth / 2 ** 0.5, logits_scaling=64 / base,
                   attention_multiplier=(64 // 4) ** -0.5)
    _write(path, model.model.state_dict(), _llama_config(model, "MiniCPMForCausalLM", scale_emb=scale_emb,
                                                   scale_depth=scale_depth, dim_model_base=base))
    return model.float()


def make_orion(path: Path, seed: int) -> Any:
    """Orion: Llama with LayerNorms (weight and bias) in place of RMSNorms; the reference swaps them in."""
    import torch.nn as nn

    model = _llama(path, seed)
    torch.manual_seed(seed + 1)
    eps = 1e-5

    def layer_norm() -> nn.LayerNorm:
        ln = nn.LayerNorm(64, eps=eps)
        with torch.no_grad():
            ln.weight.copy_(1.0 + 0.1 * torch.randn(64))
            ln.bias.copy_(0.05 * torch.randn(64))
        return ln.half()

    for layer in model.model.model.layers:
        layer.input_layernorm, layer.post_attention_layernorm = layer_norm(), layer_norm()
    model.model.model.norm = layer_norm()
    _write(path, model.model.state_dict(), _llama_config(model, "OrionForCausalLM", rms_norm_eps=eps))
    return model.float()


SPEC_CASES = {"yi": make_yi, "internlm2": make_internlm2, "index": make_index, "minicpm": make_minicpm,
              "orion": make_orion}
