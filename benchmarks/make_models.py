"""Random-weight Llama models of real shapes, written as safetensors shards: fp16, EXL2 (uniform width in
128-row groups, or `exl2_mix="converter"`: each matrix laid out by one of the converter's own option tables,
spec §4.4, mixed 2-8 bit widths and 32/64/128-row groups as `exlpy convert` writes them) and GPTQ 4-bit g128.

Speed depends on shapes and formats only, so random weights (fp16 std 0.02; for EXL2 random packed codes,
random 4-bit scale codes with q_scale_max ~0.01, a random act-order permutation per input, shared by q/k/v and
by gate/up as in real files; for GPTQ random nibbles, zeros and fp16 scales ~0.01) measure what real weights
would. Tensors are drawn on the GPU when there is one (fast), then written per shard.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from safetensors.torch import save_file

SHAPES: dict[str, dict] = {
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
                      rope_theta=500000.0),
    "llama3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                        head_dim=64, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                        rope_theta=500000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                         rope_theta=100000.0),
}

_DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _config(shape: dict, max_pos: int = 8192) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "max_position_embeddings": max_pos, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2,
            "torch_dtype": "float16", "attention_bias": False, "mlp_bias": False, **shape}


def _linears(shape: dict, i: int) -> Iterator[tuple[str, int, int]]:
    """(name, in_features, out_features) of layer i's projections."""
    h, d, im = shape["hidden_size"], shape["head_dim"], shape["intermediate_size"]
    hq, hk = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    p = f"model.layers.{i}"
    yield from [(f"{p}.self_attn.q_proj", h, hq), (f"{p}.self_attn.k_proj", h, hk), (f"{p}.self_attn.v_proj", h, hk),
                (f"{p}.self_attn.o_proj", hq, h), (f"{p}.mlp.gate_proj", h, im), (f"{p}.mlp.up_proj", h, im),
                (f"{p}.mlp.down_proj", im, h)]


def _dense(out_f: int, in_f: int) -> torch.Tensor:
    return (torch.randn(out_f, in_f, device=_DEV, dtype=torch.float16) * 0.02).cpu()


def _norm(n: int) -> torch.Tensor:
    return (1.0 + 0.1 * torch.randn(n, device=_DEV)).half().cpu()


def _rnd(*shape: int) -> torch.Tensor:
    return torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int64, device=_DEV).to(torch.int32).cpu()


def _exl2(prefix: str, k: int, n: int, bits: int | list[tuple[int, int]],
          invperm: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """EXL2 tensors of one linear (spec §3.1-3.4): `bits` a uniform width in groups of 128 rows, or the
    per-group (bits, rows) layout. `invperm`: the act order (projections of one input share it in real EXL2
    files: q/k/v, gate/up); random when None."""
    groups = [(bits, min(128, k - r)) for r in range(0, k, 128)] if isinstance(bits, int) else bits
    n_pad = (n + 31) // 32 * 32
    qg, words = [], 0
    for b, rows in groups:
        qg += [b, words]
        words += (rows * b + 31) // 32
    return {
        f"{prefix}.q_weight": _rnd(words, n_pad),  # any 32-bit word is a valid run of codes
        f"{prefix}.q_invperm": invperm if invperm is not None else torch.randperm(k).to(torch.int32),
        f"{prefix}.q_scale": _rnd(len(groups), n_pad // 8),
        f"{prefix}.q_scale_max": (0.01 * (0.5 + torch.rand(len(groups)))).half(),
        f"{prefix}.q_groups": torch.tensor(qg, dtype=torch.int16),
    }


def _gptq(prefix: str, k: int, n: int, gs: int = 128) -> dict[str, torch.Tensor]:
    """GPTQ 4-bit tensors of one linear (spec §3.6), groups of `gs` rows in order (no act order)."""
    g = (k + gs - 1) // gs
    return {f"{prefix}.qweight": _rnd(k // 8, n), f"{prefix}.qzeros": _rnd(g, n // 8),
            f"{prefix}.scales": (0.01 * (0.5 + torch.rand(g, n, device=_DEV))).half().cpu()}


def converter_layouts(shape: dict, target_bpw: float = 4.0) -> list[dict[str, list[tuple[int, int]]]]:
    """Per layer, the (bits, rows) group layout of each projection as `exlpy convert -b target_bpw` could write
    it: the converter's option tables (attention and MLP rows, spec §4.4), one option pair per layer, alternating
    above and below the target so that the model averages about target_bpw with several widths in use."""
    from exlpy.convert.qparams import ATTN_OPTIONS, MLP_OPTIONS

    dims = {name.rsplit(".", 1)[1]: (k, n) for name, k, n in _linears(shape, 0)}

    def bpw(option: dict) -> float:
        bits = sum(q.total_bits(*dims[key]) for key, q in option.items())
        return bits / sum(dims[key][0] * dims[key][1] for key in option)

    pairs = [(a, m) for a in ATTN_OPTIONS for m in MLP_OPTIONS]
    attn_w = sum(dims[key][0] * dims[key][1] for key in ATTN_OPTIONS[0])
    mlp_w = sum(dims[key][0] * dims[key][1] for key in MLP_OPTIONS[0])
    out = []
    for i in range(shape["num_hidden_layers"]):
        want = target_bpw + (0.35, -0.35, 0.0)[i % 3]
        a, m = min(pairs, key=lambda p: abs((bpw(p[0]) * attn_w + bpw(p[1]) * mlp_w) / (attn_w + mlp_w) - want))
        out.append({key: q.groups(dims[key][0]) for key, q in {**a, **m}.items()})
    return out


def write_model(out_dir: str, shape_name: str, exl2_bits: int = 0, head_bits: int = 6,
                shard_bytes: int = 4 * 2**30, exl2_mix: str | None = None, gptq: bool = False) -> str:
    """Write the model once (a `.complete` marker makes later calls free); returns out_dir. exl2_bits: uniform
    EXL2 width; exl2_mix="converter": the converter's mixed layouts at about 4.0 bpw (head 6-bit: 15% 8-bit,
    85% 6-bit, as `exlpy convert` writes it); gptq: GPTQ 4-bit g128 projections with an fp16 head."""
    if os.path.exists(os.path.join(out_dir, ".complete")):
        return out_dir
    os.makedirs(out_dir, exist_ok=True)
    shape = SHAPES[shape_name]
    h, v = shape["hidden_size"], shape["vocab_size"]
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    count = [0]

    def flush() -> None:
        if shard:
            name = f"model-{count[0]:05d}.safetensors"
            save_file(shard, os.path.join(out_dir, name), metadata={"format": "pt"})
            weight_map.update({t: name for t in shard})
            shard.clear()
            count[0] += 1

    def add(tensors: dict[str, torch.Tensor]) -> None:
        shard.update(tensors)
        if sum(t.numel() * t.element_size() for t in shard.values()) >= shard_bytes:
            flush()

    layouts = converter_layouts(shape) if exl2_mix == "converter" else None
    if exl2_mix is not None and layouts is None:
        raise ValueError(f"unknown exl2_mix {exl2_mix!r}")
    add({"model.embed_tokens.weight": _dense(v, h)})
    for i in range(shape["num_hidden_layers"]):
        add({f"model.layers.{i}.input_layernorm.weight": _norm(h),
             f"model.layers.{i}.post_attention_layernorm.weight": _norm(h)})
        shared = {"q_proj": torch.randperm(h).to(torch.int32), "gate_proj": torch.randperm(h).to(torch.int32)}
        shared.update(k_proj=shared["q_proj"], v_proj=shared["q_proj"], up_proj=shared["gate_proj"])
        for name, k, n in _linears(shape, i):
            key = name.rsplit(".", 1)[1]
            perm = shared.get(key)
            perm = perm.clone() if perm is not None else None  # safetensors stores no shared tensors
            if layouts is not None:
                add(_exl2(name, k, n, layouts[i][key], perm))
            elif exl2_bits:
                add(_exl2(name, k, n, exl2_bits, perm))
            elif gptq:
                add(_gptq(name, k, n))
            else:
                add({f"{name}.weight": _dense(n, k)})
    add({"model.norm.weight": _norm(h)})
    if not shape["tie_word_embeddings"]:
        if layouts is not None:
            from exlpy.convert.qparams import HEAD_OPTIONS

            add(_exl2("lm_head", h, v, HEAD_OPTIONS[6].groups(h)))
        elif exl2_bits:
            add(_exl2("lm_head", h, v, head_bits))
        else:
            add({"lm_head.weight": _dense(v, h)})
    flush()
    cfg = _config(shape)
    if exl2_bits or layouts is not None:
        cfg["quantization_config"] = {"quant_method": "exl2", "bits": exl2_bits or 4.0, "head_bits": head_bits}
    elif gptq:
        cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
                                      "sym": False}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    open(os.path.join(out_dir, ".complete"), "w").close()
    return out_dir
