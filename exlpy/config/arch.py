"""Declarative table of supported architectures: what differs between the decoder-only models exlpy runs.

An architecture is data, not code: the key names its checkpoints use (remapped at load to one canonical,
Llama-style naming), the norm and MLP kinds, how RoPE is laid out, the block layout and a few flags. The one
model (exlpy/model/) is built from these values; its forward pass has no branch per architecture. Values a
config.json can override (biases, tied heads, windows, multipliers) are read in exlpy/config/hf.py.

Canonical tensor names (after remapping): `model.embed_tokens`, `model.wpe` (learned positions),
`model.layers.N.self_attn.{q,k,v,o}_proj` (+ `q_norm`, `k_norm`), `model.layers.N.mlp.{gate,up,down}_proj`
(`up` alone for a non-gated MLP), an MoE layer's `model.layers.N.mlp.router` and
`model.layers.N.mlp.experts.E.{gate,up,down}_proj`, `model.norm`, `lm_head`; a layer's norms are named per
architecture by role (`norms`: attn_pre / attn_post / mlp_pre / mlp_post), as their checkpoints name them.
Fused checkpoint tensors (`qkv_proj`, `gate_up_proj`, GPT-2's `c_attn`, InternLM2's `wqkv`) are read through
row-slice views with these names (exlpy/weights/views.py), so loaders, the planner and the converter see one
naming.
"""

from __future__ import annotations

from dataclasses import dataclass

# Block-norm roles -> canonical norm names. A role absent from an architecture's `norms` is not used.
NORM_ROLES = ("attn_pre", "attn_post", "mlp_pre", "mlp_post")
_SEQ = (("attn_pre", "input_layernorm"), ("mlp_pre", "post_attention_layernorm"))
# Gemma 2 / GLM-4 layout: a norm before and after each sub-block (the residual adds the normed output).
_FOUR = (("attn_pre", "input_layernorm"), ("attn_post", "post_attention_layernorm"),
         ("mlp_pre", "pre_feedforward_layernorm"), ("mlp_post", "post_feedforward_layernorm"))
# Cohere: one norm whose output feeds attention and MLP side by side.
_PARALLEL = (("attn_pre", "input_layernorm"),)


@dataclass(frozen=True)
class ArchParams:
    name: str
    # Checkpoint key rewrites (old, new), applied in order to every tensor name; "$" anchors at the start.
    remap: tuple[tuple[str, str], ...] = ()
    # Fused checkpoint tensors read as canonical parts: "qkv" (q|k|v rows), "qkv_altpack" (InternLM2: per KV
    # group [q x groups, k, v]), "gate_up" ([gate; up] rows). Keys after remapping, under model.layers.N.
    fused_qkv: str | None = None
    fused_qkv_layout: str = "qkv"
    fused_gate_up: str | None = None
    transposed: bool = False  # GPT-2's Conv1D stores linear weights as [in, out]
    norm: str = "rms"  # rms | layer (mean-subtracted, optional bias)
    norm_constant_bias: float = 0.0  # Gemma: the weight is stored minus one
    norm_eps_keys: tuple[str, ...] = ("rms_norm_eps",)
    norms: tuple[tuple[str, str], ...] = _SEQ  # (role, canonical name) per block norm
    parallel_blocks: bool = False  # Cohere: x + attn(norm(x)) + mlp(norm(x))
    gated_mlp: bool = True  # act(gate) * up, else act(up)
    default_act: str = "silu"
    rope_style: str = "neox"  # neox (rotate halves) | gptj (rotate adjacent pairs) | none (learned positions)
    qk_norm: bool = False  # a norm over head_dim on q and k before RoPE (config `use_qk_norm` can set it)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tied_head: bool = False  # the head falls back to the embedding whatever tie_word_embeddings says
    normalize_embeddings: bool = False  # Gemma: embeddings x sqrt(hidden_size)
    residual_fp32: bool = False  # Gemma 2: the residual stream stays in fp32 between blocks
    requires_bos: bool = False
    sliding_window: bool = False  # config.json's sliding_window / layer_types are honoured
    swa_pattern: int = 0  # default layer pattern without `layer_types`: every n-th layer is global (0: all local)
    swa_first_local: bool = True  # Gemma 2: even layers local; Cohere 2: layer n-1 of each n is global
    rope_on_global: bool = True  # Cohere 2: full-attention layers have no RoPE
    ignores_sliding_window: bool = False  # Mistral v0.1: exllamav2 ignores its window; so do we, with a warning
    supports_tp: bool = False
    # Mixture of experts (exlpy/config/moe.py): routed expert MLPs in place of the dense one.
    moe: bool = False
    moe_renormalize: bool = True  # the top-k routing weights renormalised to sum 1 (Mixtral)
    moe_renormalize_key: str | None = None  # config key that sets it (Qwen3-MoE: norm_topk_prob)
    moe_dense_layers: bool = False  # config's mlp_only_layers / decoder_sparse_step leave dense layers
    moe_fused_experts: bool = False  # DBRX: experts stored as [E*I, H] tensors w1 / v1 / w2 (exlpy/weights/views.py)
    # Vision-language models (exlpy/vision/): the vision tower's kind; its tensors live under `visual.` etc.
    vision: str | None = None
    image_bidirectional: bool = False  # Gemma 3: an image's tokens attend to each other in both directions
    rope_local: bool = False  # Gemma 3: sliding-window layers use their own RoPE base (rope_local_base_freq)
    mrope: bool = False  # Qwen2-VL: rotary frequencies in t / h / w sections (rope_scaling.mrope_section)


_GPT2_KEYS = (
    ("$transformer.", ""), ("$h.", "model.layers."), ("$wte.", "model.embed_tokens."), ("$wpe.", "model.wpe."),
    ("$ln_f.", "model.norm."), (".ln_1.", ".input_layernorm."), (".ln_2.", ".post_attention_layernorm."),
    (".attn.c_attn.", ".self_attn.c_attn."), (".attn.c_proj.", ".self_attn.o_proj."),
    (".mlp.c_fc.", ".mlp.up_proj."), (".mlp.c_proj.", ".mlp.down_proj."),
)
_LEARNED = dict(norm="layer", norm_eps_keys=("layer_norm_epsilon",), gated_mlp=False, default_act="gelu_new",
                rope_style="none", qkv_bias=True, o_bias=True, mlp_bias=True, tied_head=True,
                fused_qkv="self_attn.c_attn", remap=_GPT2_KEYS)
_GEMMA = dict(norm_constant_bias=1.0, default_act="gelu_pytorch_tanh", tied_head=True, normalize_embeddings=True,
              requires_bos=True)
_COHERE = dict(norm="layer", norm_eps_keys=("layer_norm_eps",), norms=_PARALLEL, parallel_blocks=True,
               rope_style="gptj", tied_head=True, requires_bos=True)


_GEMMA3_KEYS = (("$model.vision_tower.vision_model.", "vision_tower."),
                ("$vision_tower.vision_model.", "vision_tower."),
                ("$model.vision_tower.", "vision_tower."), ("$model.multi_modal_projector.", "multi_modal_projector."),
                ("$model.language_model.", "model."), ("$language_model.model.", "model."),
                ("$language_model.lm_head.", "lm_head."))
_LLAVA_KEYS = (("$model.vision_tower.", "vision_tower."), ("$model.multi_modal_projector.", "multi_modal_projector."),
               ("$model.language_model.", "model."), ("$language_model.model.", "model."),
               ("$language_model.lm_head.", "lm_head."))
_QWEN_VL_KEYS = (("$model.visual.", "visual."), ("$model.language_model.", "model."),
                 ("$language_model.model.", "model."), ("$language_model.lm_head.", "lm_head."))


def _arch(name: str, **kw: object) -> tuple[str, ArchParams]:
    return name, ArchParams(name, **kw)  # type: ignore[arg-type]


ARCHITECTURES: dict[str, ArchParams] = dict([
    _arch("LlamaForCausalLM", supports_tp=True),
    _arch("MistralForCausalLM", ignores_sliding_window=True, supports_tp=True),
    _arch("Qwen2ForCausalLM", qkv_bias=True, supports_tp=True),
    _arch("Qwen3ForCausalLM", qk_norm=True, supports_tp=True),
    _arch("YiForCausalLM", remap=((".ln1.", ".input_layernorm."), (".ln2.", ".post_attention_layernorm."))),
    _arch("OrionForCausalLM", norm="layer"),
    _arch("GemmaForCausalLM", **_GEMMA),
    _arch("Gemma2ForCausalLM", **_GEMMA, norms=_FOUR, residual_fp32=True, sliding_window=True, swa_pattern=2),
    _arch("Starcoder2ForCausalLM", norm="layer", norm_eps_keys=("norm_epsilon", "layer_norm_epsilon"),
          gated_mlp=False, default_act="gelu_pytorch_tanh", tied_head=True, sliding_window=True,
          remap=((".mlp.c_fc.", ".mlp.up_proj."), (".mlp.c_proj.", ".mlp.down_proj."))),
    _arch("CohereForCausalLM", **_COHERE),
    _arch("Cohere2ForCausalLM", **_COHERE, sliding_window=True, swa_pattern=4, swa_first_local=False,
          rope_on_global=False),
    _arch("Phi3ForCausalLM", fused_qkv="self_attn.qkv_proj", fused_gate_up="mlp.gate_up_proj",
          sliding_window=True),
    _arch("GPT2LMHeadModel", **_LEARNED, transposed=True),
    _arch("GPTBigCodeForCausalLM", **_LEARNED),
    _arch("MiniCPMForCausalLM"),
    _arch("InternLM2ForCausalLM", fused_qkv="self_attn.wqkv", fused_qkv_layout="qkv_altpack", remap=(
        ("$model.tok_embeddings.", "model.embed_tokens."), ("$output.", "lm_head."),
        (".attention_norm.", ".input_layernorm."), (".ffn_norm.", ".post_attention_layernorm."),
        (".attention.wqkv.", ".self_attn.wqkv."), (".attention.wo.", ".self_attn.o_proj."),
        (".feed_forward.w1.", ".mlp.gate_proj."), (".feed_forward.w3.", ".mlp.up_proj."),
        (".feed_forward.w2.", ".mlp.down_proj."))),
    _arch("IndexForCausalLM"),
    _arch("GraniteForCausalLM"),
    _arch("MixtralForCausalLM", moe=True, ignores_sliding_window=True, remap=(
        (".block_sparse_moe.gate.", ".mlp.router."), (".block_sparse_moe.experts.", ".mlp.experts."),
        (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))),
    # exllamav2 marks Qwen3-MoE TP-capable but has no TP split of its MoE layers; neither has exlpy.
    _arch("Qwen3MoeForCausalLM", qk_norm=True, moe=True, moe_renormalize=False,
          moe_renormalize_key="norm_topk_prob", moe_dense_layers=True, remap=((".mlp.gate.", ".mlp.router."),)),
    # DBRX: LayerNorm without bias, fused Wqkv with clip_qkv, experts fused per layer, top-k weights divided by
    # their L_p norm (ffn_config.moe_normalize_expert_weights; nested config keys are read as "a.b").
    _arch("DbrxForCausalLM", norm="layer", norm_eps_keys=("layer_norm_epsilon",), fused_qkv="self_attn.Wqkv",
          moe=True, moe_renormalize_key="ffn_config.moe_normalize_expert_weights", moe_fused_experts=True, remap=(
              ("$transformer.wte.", "model.embed_tokens."), ("$transformer.norm_f.", "model.norm."),
              ("$transformer.blocks.", "model.layers."), (".norm_attn_norm.norm_1.", ".input_layernorm."),
              (".norm_attn_norm.norm_2.", ".post_attention_layernorm."),
              (".norm_attn_norm.attn.Wqkv.", ".self_attn.Wqkv."),
              (".norm_attn_norm.attn.out_proj.", ".self_attn.o_proj."),
              (".ffn.router.layer.", ".mlp.router."), (".ffn.experts.mlp.", ".mlp.experts."))),
    _arch("Glm4ForCausalLM", fused_gate_up="mlp.gate_up_proj", rope_style="gptj", supports_tp=True,
          norms=(("attn_pre", "input_layernorm"), ("attn_post", "post_self_attn_layernorm"),
                 ("mlp_pre", "post_attention_layernorm"), ("mlp_post", "post_mlp_layernorm"))),
    # Gemma 3: Gemma 2's four norms and fp32 residual, q/k norms, every sixth layer global, local layers with their
    # own RoPE base. The multimodal checkpoint keeps the language model under `language_model.`.
    _arch("Gemma3ForCausalLM", **_GEMMA, norms=_FOUR, residual_fp32=True, sliding_window=True, swa_pattern=6,
          qk_norm=True, rope_local=True),
    _arch("Gemma3ForConditionalGeneration", **_GEMMA, norms=_FOUR, residual_fp32=True, sliding_window=True,
          swa_pattern=6, qk_norm=True, rope_local=True, vision="gemma3", image_bidirectional=True,
          remap=_GEMMA3_KEYS),
    # Mistral 3.1 / Pixtral-12B (Llava): a Mistral language model under `language_model.`, a Pixtral tower.
    _arch("Mistral3ForConditionalGeneration", ignores_sliding_window=True, vision="pixtral", remap=_LLAVA_KEYS),
    _arch("LlavaForConditionalGeneration", ignores_sliding_window=True, vision="pixtral", remap=_LLAVA_KEYS),
    # Qwen2-VL / Qwen2.5-VL: a Qwen2 language model with M-RoPE. Checkpoints name the language model `model.` (or,
    # as transformers >= 4.52 writes them, `model.language_model.`) and the tower `visual.` (`model.visual.`).
    _arch("Qwen2VLForConditionalGeneration", qkv_bias=True, vision="qwen2_vl", mrope=True, remap=_QWEN_VL_KEYS),
    _arch("Qwen2_5_VLForConditionalGeneration", qkv_bias=True, vision="qwen2_5_vl", mrope=True,
          remap=_QWEN_VL_KEYS),
])

FALLBACK = "LlamaForCausalLM"  # what an unknown architecture string runs as (exllamav2 does the same)

# Architectures exllamav2 runs that exlpy does not yet: refused by name rather than run as Llama.
NOT_YET: dict[str, str] = {
    "GemmoeForCausalLM": "mixture of experts",
    # not in exllamav2's table either (it would run it as Llama and miss mlp.gate_proj): routed experts plus a
    # gated shared expert in every layer
    "Qwen2MoeForCausalLM": "mixture of experts with a shared expert",
}


def remap_key(name: str, remap: tuple[tuple[str, str], ...]) -> str:
    """A checkpoint tensor name in canonical naming: each (old, new) applied in order, "$old" only at the start."""
    for old, new in remap:
        if old.startswith("$"):
            if name.startswith(old[1:]):
                name = new + name[len(old) - 1:]
        elif old in name:
            name = name.replace(old, new)
    return name
