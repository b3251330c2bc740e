"""Mixture-of-experts decode on one GPU: eager vs CUDA graphs, against the active-weights bandwidth limit, and
the grouped expert kernels' achieved bandwidth.

GPU:  python benchmarks/moe.py [--shapes mixtral,qwen3_moe] [--formats fp16,exl2] [--layers 4] [--batches 1,32]
          [--prompt-len 256] [--gen-len 64] [--work /tmp/exlpy_moe] [--out benchmarks/results/moe.md]
CPU:  python benchmarks/moe.py --tiny     (tiny shapes through the same code, nothing written unless --out)
EXL2 experts at decode take split-K GEMV kernels, at 3-16 rows per expert the multi-row kernels (`EXLPY_MOE_GEMV=0`:
the tile kernels instead); --sweep times them next to the tile kernels whatever the switch.

Random checkpoints of real models' shapes (Mixtral-8x7B, Qwen3-30B-A3B: hidden 2048, 128 experts of 768, 8 per
token, 48 layers), decoder depth cut by --layers (the embedding and head keep their size), in fp16 or EXL2 4.0 bpw
(--formats exl2: every decoder projection 4-bit, experts included, head 6-bit; exl2mix: the converter's option
layouts nearest 4 bpw, mixed widths as converted models hold them), written with safetensors once into
--work (a shard per layer) and reused. Full depth needs the disk: Qwen3-30B-A3B is 61 GB in fp16, 17 GB in EXL2.
Per shape and format:

- decode: for each batch, greedy decode of --gen-len tokens after a random --prompt-len prompt through
  model.forward, once eagerly (config.no_graphs) and once replaying the captured step (the MoE blocks inside
  the graph); tokens/s, ms/step, and at batch 1 the fraction of the active-weights limit (copy rate ÷ bytes one
  token reads: everything but the embedding, each MoE layer's experts counted k / E).
- kernels: ops.moe_experts (counting sort by expert, grouped gate|up with SiLU, grouped down, combine; EXL2:
  ops.moe_experts_exl2 over the packed stacks) over every loaded MoE layer's real weights with a random routing
  of `batch` tokens per layer, timed as CUDA-graph replays (no launch overhead; the layers together far exceed
  L2); bytes = the routed experts' weights (each distinct expert once per layer; EXL2: its packed words, scales
  and row tables), achieved GB/s and its fraction of the copy rate. The gate|up and down launches are also timed
  alone.
- --sweep: the two launches again under other tiles (fp16: exlpy/kernels/moe.py TILES, STAGES for the tile
  height each batch uses; EXL2: moe_exl2.py COLS, WARPS, STAGES, UNROLL_DECODE of the tile kernels,
  moe_exl2_gemv.py GEMV_COLS, GEMV_WARPS, GEMV_WAVES, GEMV_NB of the GEMV kernels at few rows per expert, and
  moe_exl2_rows.py ROWS_COLS, ROWS_WARPS, ROWS_WAVES, ROWS of the multi-row kernels), to choose the defaults from.

Appends one section (command, date, device, tables) to --out and prints the same lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.quant_matmul import graph_time  # noqa: E402
from exlpy.cli.bench import weight_bytes_read  # noqa: E402
from exlpy.kernels import ops  # noqa: E402
from exlpy.runtime import options, use_options  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "mixtral": dict(architectures=["MixtralForCausalLM"], vocab_size=32000, hidden_size=4096,
                    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=1e6,
                    max_position_embeddings=4096, tie_word_embeddings=False),
    "qwen3_moe": dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
                      intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                      num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                      num_experts_per_tok=8, norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1e6,
                      max_position_embeddings=4096, tie_word_embeddings=False),
}
FORMATS = {"fp16": "fp16", "exl2": "EXL2 4.0 bpw (head 6-bit)",
           "exl2mix": "EXL2 ~4 bpw, converter option layouts (mixed widths, head 6-bit)"}
# --tiny: the same architectures at test-model size (CPU)
TINY = {"mixtral": dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                        num_key_value_heads=2, num_local_experts=8),
        "qwen3_moe": dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=16)}


def write(path: str, cfg: dict[str, Any], device: str, fmt: str = "fp16") -> None:
    """A random checkpoint of `cfg` (Mixtral's experts under its own names), one safetensors shard per layer so
    that host memory holds one layer at a time. fmt "exl2": every decoder projection (attention and experts) EXL2
    4-bit in 128-row groups, the head 6-bit, as benchmarks/make_models.py writes dense models (random packed
    words; each expert's gate and up share one act order); router, norms and embedding fp16."""
    from safetensors.torch import save_file

    import benchmarks.make_models as mm  # random EXL2 tensors (drawn on the GPU when there is one)

    os.makedirs(path, exist_ok=True)
    g = torch.Generator(device=device).manual_seed(0)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    d, hq, hk = cfg.get("head_dim", h // cfg["num_attention_heads"]), cfg["num_attention_heads"], \
        cfg["num_key_value_heads"]
    n = cfg.get("num_experts", cfg.get("num_local_experts"))
    inter = cfg.get("moe_intermediate_size", cfg["intermediate_size"])
    mixtral = cfg["architectures"][0] == "MixtralForCausalLM"
    exl2 = fmt in ("exl2", "exl2mix")
    layouts = _converter_layouts(h, hq * d, hk * d, inter) if fmt == "exl2mix" else {}

    def rnd(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, device=device, generator=g) * std).half().cpu()

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.float16)

    def linear(name: str, k: int, n_out: int, bits: int = 4, perm: torch.Tensor | None = None
               ) -> dict[str, torch.Tensor]:
        if exl2:
            groups = layouts.get(name.rsplit(".", 1)[-1].replace("w1", "gate_proj").replace("w3", "up_proj")
                                 .replace("w2", "down_proj"), bits)
            return mm._exl2(name, k, n_out, groups, None if perm is None else perm.clone())
        return {f"{name}.weight": rnd(n_out, k)}

    weight_map: dict[str, str] = {}

    def shard(name: str, t: dict[str, torch.Tensor]) -> None:
        save_file(t, os.path.join(path, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in t})

    shard("outer.safetensors", {"model.embed_tokens.weight": rnd(v, h), "model.norm.weight": ones(h),
                                **linear("lm_head", h, v, bits=6)})
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        t = {f"{p}.input_layernorm.weight": ones(h), f"{p}.post_attention_layernorm.weight": ones(h)}
        qkv_perm = torch.randperm(h).to(torch.int32)
        for proj, n_out in (("q_proj", hq * d), ("k_proj", hk * d), ("v_proj", hk * d)):
            t |= linear(f"{p}.self_attn.{proj}", h, n_out, perm=qkv_perm)
        t |= linear(f"{p}.self_attn.o_proj", hq * d, h)
        if not mixtral:
            t |= {f"{p}.self_attn.q_norm.weight": ones(d), f"{p}.self_attn.k_norm.weight": ones(d)}
        moe = f"{p}.block_sparse_moe" if mixtral else f"{p}.mlp"
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        t[f"{moe}.gate.weight"] = rnd(n, h, std=0.5)  # decisive, spread routing
        for e in range(n):
            gu_perm = torch.randperm(h).to(torch.int32)
            t |= linear(f"{moe}.experts.{e}.{names[0]}", h, inter, perm=gu_perm)
            t |= linear(f"{moe}.experts.{e}.{names[1]}", h, inter, perm=gu_perm)
            t |= linear(f"{moe}.experts.{e}.{names[2]}", inter, h)
        shard(f"layer-{i:03d}.safetensors", t)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    if exl2:
        cfg = {**cfg, "quantization_config": {"quant_method": "exl2", "bits": 4.0, "head_bits": 6}}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    open(os.path.join(path, ".complete"), "w").close()


def _converter_layouts(h: int, q: int, kv: int, inter: int, target: float = 4.0) -> dict[str, list]:
    """Per projection, the (bits, rows) groups of the attention and MLP option (exlpy convert's tables, applied to
    every expert) whose bits per weight come nearest `target`: the mixed widths a converted model holds."""
    from exlpy.convert.qparams import ATTN_OPTIONS, MLP_OPTIONS

    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, inter),
            "up_proj": (h, inter), "down_proj": (inter, h)}

    def bpw(option: dict) -> float:
        return sum(p.total_bits(*dims[k]) for k, p in option.items()) / sum(dims[k][0] * dims[k][1] for k in option)

    out = {}
    for table in (ATTN_OPTIONS, MLP_OPTIONS):
        best = min(table, key=lambda o: abs(bpw(o) - target))
        out |= {k: p.groups(dims[k][0]) for k, p in best.items()}
    return out


def load(path: str, max_seq_len: int, max_batch: int, device: str) -> Any:
    from exlpy import ExLlamaV2, ExLlamaV2Config

    config = ExLlamaV2Config(path)
    config.max_seq_len = max_seq_len
    config.max_batch_size = max_batch
    model = ExLlamaV2(config)
    model.load(device=device)  # everything on one device: the case the bandwidth limit describes
    return model


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def decode_seconds(model: Any, batch: int, prompt_len: int, gen_len: int, device: str, warmup: int = 4) -> float:
    """Seconds of `gen_len` greedy decode steps of `batch` rows after a random prompt (argmax kept on the
    device, tokens read back once at the end, so the host runs ahead of the GPU)."""
    from exlpy import ExLlamaV2Cache

    cache = ExLlamaV2Cache(model, batch_size=batch, max_seq_len=prompt_len + gen_len + warmup)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=g)
    first = model.forward(ids, cache, last_id_only=True)[:, -1].argmax(-1, keepdim=True)
    tok = first
    for _ in range(warmup):  # compiles kernels; captures the step's graph when graphs are on
        tok = model.forward(tok, cache)[:, -1].argmax(-1, keepdim=True)
    cache.current_seq_len = prompt_len
    out = torch.empty(batch, gen_len, dtype=torch.long, device=first.device)
    tok = first
    sync(device)
    t0 = time.perf_counter()
    for i in range(gen_len):
        tok = model.forward(tok, cache)[:, -1].argmax(-1, keepdim=True)
        out[:, i:i + 1] = tok
    out.cpu()
    dt = time.perf_counter() - t0
    del cache
    return dt


def timed(fn: Callable[[], Any], device: str, reps: int = 20) -> float:
    """Median seconds of one fn(): CUDA-graph replays on a GPU (launch overhead excluded), plain calls on CPU."""
    if not device.startswith("cuda"):
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    return graph_time(fn, reps)


def copy_rate(device: str) -> float:
    """Device-to-device copy rate (bytes read + written per second): the practical ceiling."""
    n = (1 << 30) if device.startswith("cuda") else (1 << 26)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    return 2 * n / timed(lambda: b.copy_(a), device)


def kernel_rows(model: Any, tokens: int, device: str, bw: float) -> list[tuple[str, float, float]]:
    """(what, seconds per layer, achieved bytes/s) of the grouped experts over every loaded MoE layer (dense
    stacks, or EXL2 stacks read packed)."""
    from exlpy.model.moe import MoEMLP

    blocks = [m for m in model.modules if isinstance(m, MoEMLP) and (m.w_gate_up is not None or
                                                                       m.packed is not None)]
    packed = blocks[0].packed is not None
    if packed:
        E, H, inter = blocks[0].packed[0].num_experts, blocks[0].packed[0].k, blocks[0].packed[0].n
        dtype = blocks[0].norm_w.dtype
    else:
        E, two_i, H = blocks[0].w_gate_up.shape
        inter, dtype = two_i // 2, blocks[0].w_gate_up.dtype
    k = model.config.num_experts_per_token
    g = torch.Generator().manual_seed(1)
    cases = []
    for blk in blocks:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)]).to(device)
        h = (torch.randn(tokens, H, generator=g) * 0.1).to(device, dtype)
        w = torch.rand(tokens, k, generator=g).to(device, dtype)
        order, counts = ops.moe_sort(ids, E)
        if packed:
            a = ops.moe_gate_up_exl2(h, order, counts, blk.packed[0], blk.packed[1], k, "silu")
        else:
            a = ops.moe_gate_up(h, order, counts, blk.w_gate_up, k, "silu")
        cases.append((blk, ids, h, w, order, counts, a))
    routed = sum(int(c[1].unique().numel()) for c in cases)  # distinct experts read, over all layers
    if packed:  # the stacks' bytes (packed words, scales, row tables) per expert
        gu_bytes = routed * (blocks[0].packed[0].nbytes() + blocks[0].packed[1].nbytes()) // E
        down_bytes = routed * blocks[0].packed[2].nbytes() // E
        runs = {
            "moe_experts_exl2 (sort + gate|up + down + combine)": (
                lambda: [ops.moe_experts_exl2(h, w, ids, *b.packed, "silu") for b, ids, h, w, *_ in cases],
                gu_bytes + down_bytes),
            "EXL2 gate|up + SiLU launch": (
                lambda: [ops.moe_gate_up_exl2(h, o, c, b.packed[0], b.packed[1], k, "silu")
                         for b, _, h, _, o, c, _ in cases], gu_bytes),
            "EXL2 down launch": (lambda: [ops.moe_down_exl2(a, o, c, b.packed[2]) for b, _, _, _, o, c, a in cases],
                                 down_bytes),
        }
    else:
        elem = blocks[0].w_gate_up.element_size()
        gu_bytes, down_bytes = routed * 2 * inter * H * elem, routed * H * inter * elem
        runs = {
            "moe_experts (sort + gate|up + down + combine)": (
                lambda: [ops.moe_experts(h, w, ids, b.w_gate_up, b.w_down, "silu") for b, ids, h, w, *_ in cases],
                gu_bytes + down_bytes),
            "gate|up + SiLU launch": (
                lambda: [ops.moe_gate_up(h, o, c, b.w_gate_up, k, "silu") for b, _, h, _, o, c, _ in cases],
                gu_bytes),
            "down launch": (lambda: [ops.moe_down(a, o, c, b.w_down) for b, _, _, _, o, c, a in cases], down_bytes),
        }
    rows = []
    for what, (fn, nbytes) in runs.items():
        t = timed(fn, device)
        rows.append((what, t / len(cases), nbytes / t))
    return rows


SWEEP = {16: [(32, 128, 4, 3), (16, 128, 4, 3), (32, 64, 4, 3), (64, 64, 4, 3), (32, 128, 4, 4), (16, 256, 4, 3),
              (64, 128, 8, 3), (32, 256, 8, 3)],
         32: [(64, 64, 8, 3), (32, 64, 4, 3), (64, 64, 4, 4), (128, 64, 8, 3)],
         64: [(64, 64, 8, 3), (128, 64, 8, 3), (64, 32, 4, 3), (64, 64, 8, 4)]}


# EXL2 experts (exlpy/kernels/moe_exl2.py): (column tile, warps, stages, 32-row blocks per trip at decode), the
# decode narrowing off
SWEEP_EXL2 = [(64, 4, 2, 4), (32, 4, 2, 4), (16, 4, 2, 4), (16, 4, 2, 1), (16, 4, 2, 2), (32, 4, 2, 1),
              (128, 4, 2, 4), (64, 8, 2, 4), (64, 4, 3, 4), (32, 4, 3, 2), (32, 2, 2, 4)]


# EXL2 GEMV kernels at few rows per expert (moe_exl2_gemv.GEMV_*): (columns per program, warps, waves, factor on the
# blocks per step); the tile kernels above run in their place (GEMV_MAX_ROWS 0: the path every batch took before)
SWEEP_EXL2_GEMV = [(512, 4, 4, 1), (512, 4, 8, 1), (512, 4, 2, 1), (512, 4, 4, 0.5), (512, 4, 4, 2), (256, 2, 4, 1),
                   (1024, 8, 4, 1), (256, 4, 4, 1), (256, 4, 8, 1), (512, 4, 16, 1), (256, 4, 16, 1),
                   (128, 4, 8, 1)]


# EXL2 multi-row kernels at 3-16 rows per expert (exlpy/kernels/moe_exl2_rows.py ROWS_*): (columns per program,
# warps, waves, rows per tile); forced where this batch has fewer or more rows per expert than they take
SWEEP_EXL2_ROWS = [(512, 4, 8, 8), (512, 4, 4, 8), (512, 4, 16, 8), (512, 4, 2, 8), (256, 4, 8, 8), (256, 2, 8, 8),
                   (1024, 8, 8, 8), (512, 4, 8, 4), (512, 4, 8, 6), (512, 4, 8, 12), (512, 4, 8, 16)]


def sweep_rows_exl2(model: Any, tokens: int, device: str, bw: float) -> list[tuple[str, float, float]]:
    """`kernel_rows`' EXL2 gate|up and down launches under each alternative of SWEEP_EXL2 (tile kernels), of
    SWEEP_EXL2_GEMV (the GEMV kernels; forced where this batch has more rows per expert than they take) and of
    SWEEP_EXL2_ROWS (the multi-row kernels, forced likewise). Blocks per step x2 may spill registers (not
    compile-checked); the rows configurations compile unspilled (benchmarks/moe_rows_compile_check.py --sweep)."""
    from exlpy.kernels import moe_exl2, moe_exl2_gemv, moe_exl2_rows

    # each setting on the module whose code reads it: the tile kernels', the GEMV kernels', the multi-row ones'
    tile, gemv_mod, rows_mod = moe_exl2, moe_exl2_gemv, moe_exl2_rows
    names = {tile: ("COLS", "WARPS", "STAGES", "UNROLL_DECODE", "WAVES"),
             gemv_mod: ("GEMV_MAX_ROWS", "GEMV_COLS", "GEMV_WARPS", "GEMV_WAVES", "GEMV_NB"),
             rows_mod: ("ROWS", "ROWS_MIN_MEAN", "ROWS_MAX_MEAN", "ROWS_COLS", "ROWS_WARPS", "ROWS_WAVES")}
    saved = {(m, n): getattr(m, n) for m, ns in names.items() for n in ns}
    k = model.config.num_experts_per_token
    gemv_on = dataclasses.replace(options(), moe_gemv=True, moe_rows=True)  # whatever EXLPY_MOE_GEMV/_ROWS say
    gemv = gemv_mod.gemv_rows(tokens * k, model.config.num_experts)  # as this run takes them
    with use_options(gemv_on):
        multi = rows_mod.takes(tokens * k, model.config.num_experts)
    rows = []
    try:
        gemv_mod.GEMV_MAX_ROWS = 0  # the tile kernels at every batch
        rows_mod.ROWS_MAX_MEAN = 0
        tile.WAVES = 0
        for cols, warps, stages, unroll in SWEEP_EXL2:
            tile.COLS, tile.WARPS, tile.STAGES, tile.UNROLL_DECODE = cols, warps, stages, unroll
            for what, t, rate in kernel_rows(model, tokens, device, bw)[1:]:
                rows.append((f"{what}, tile kernels, {cols} columns w{warps} s{stages} u{unroll}", t, rate))
        # forced at larger batches
        gemv_mod.GEMV_MAX_ROWS = 1 << 20 if not gemv else saved[gemv_mod, "GEMV_MAX_ROWS"]
        for cols, warps, waves, nb_times in SWEEP_EXL2_GEMV:
            gemv_mod.GEMV_COLS, gemv_mod.GEMV_WARPS, gemv_mod.GEMV_WAVES = cols, warps, waves
            gemv_mod.GEMV_NB = {m: {b: max(1, int(nb * nb_times)) for b, nb in t.items()}
                                for m, t in saved[gemv_mod, "GEMV_NB"].items()}
            with use_options(gemv_on):
                timed = kernel_rows(model, tokens, device, bw)[1:]
            for what, t, rate in timed:
                rows.append((f"{what}, GEMV{'' if gemv else ' forced'}, {cols} columns w{warps} waves {waves} "
                             f"blocks x{nb_times}", t, rate))
        for (m, n), v in saved.items():
            setattr(m, n, v)
        gemv_mod.GEMV_MAX_ROWS = 0  # the multi-row kernels at every batch
        rows_mod.ROWS_MIN_MEAN, rows_mod.ROWS_MAX_MEAN = 0, 1 << 20
        for cols, warps, waves, r in SWEEP_EXL2_ROWS:
            rows_mod.ROWS_COLS, rows_mod.ROWS_WARPS, rows_mod.ROWS_WAVES, rows_mod.ROWS = cols, warps, waves, r
            with use_options(gemv_on):
                timed = kernel_rows(model, tokens, device, bw)[1:]
            for what, t, rate in timed:
                rows.append((f"{what}, rows{'' if multi else ' forced'} R{r}, {cols} columns w{warps} waves {waves}",
                             t, rate))
    finally:
        for (m, n), v in saved.items():
            setattr(m, n, v)
    return rows


def sweep_rows(model: Any, tokens: int, device: str, bw: float) -> list[tuple[str, float, float]]:
    """`kernel_rows`' gate|up and down launches under each alternative tile of this batch's tile height."""
    from exlpy.kernels import moe

    E = model.config.num_experts
    bm = moe.plan(tokens * model.config.num_experts_per_token, E)[0]
    saved, saved_stages, saved_waves = dict(moe.TILES), moe.STAGES, moe.WAVES
    rows = []
    try:
        moe.WAVES = 0  # the tiles exactly as listed
        for bn, bk, warps, stages in SWEEP[bm]:
            moe.TILES[bm], moe.STAGES = (bn, bk, warps), stages
            for what, t, rate in kernel_rows(model, tokens, device, bw)[1:]:
                rows.append((f"{what}, tile {bm}x{bn}x{bk} w{warps} s{stages}", t, rate))
    finally:
        moe.TILES.clear()
        moe.TILES.update(saved)
        moe.STAGES, moe.WAVES = saved_stages, saved_waves
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (checks the script end to end)")
    ap.add_argument("--work", default="/tmp/exlpy_moe")
    ap.add_argument("--shapes", default="mixtral")
    ap.add_argument("--formats", default="fp16", help="comma list of fp16, exl2 (EXL2 4.0 bpw, head 6-bit), "
                                                      "exl2mix (the converter's option layouts nearest 4 bpw)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--sweep", action="store_true", help="time the grouped launches under other tiles too")
    ap.add_argument("--out", default=None, help="markdown file to append to (default: benchmarks/results/moe.md "
                                                "on a GPU, nothing with --tiny)")
    a = ap.parse_args()
    device = "cpu" if a.tiny else "cuda:0"
    if not a.tiny and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --tiny for the CPU check")
    if a.tiny:
        a.prompt_len, a.gen_len = min(a.prompt_len, 16), min(a.gen_len, 8)
    out = a.out or (None if a.tiny else os.path.join(ROOT, "benchmarks", "results", "moe.md"))
    batches = [int(b) for b in a.batches.split(",")]
    name = "CPU (--tiny)" if a.tiny else torch.cuda.get_device_name()
    bw = copy_rate(device)
    lines = [f"## Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on {name}", "",
             f"Command: `python benchmarks/{os.path.basename(__file__)} {' '.join(sys.argv[1:])}`  ",
             f"torch {torch.__version__}; copy rate {bw / 1e9:,.0f} GB/s; {a.layers} decoder layers; prompt "
             f"{a.prompt_len} tokens, {a.gen_len} decoded per batch.", ""]
    print("\n".join(lines))
    for shape, fmt in [(s, f) for s in a.shapes.split(",") for f in a.formats.split(",")]:
        cfg = {**SHAPES[shape], "num_hidden_layers": a.layers, **(TINY[shape] if a.tiny else {})}
        path = os.path.join(a.work, f"{shape}_{fmt}_{a.layers}{'_tiny' if a.tiny else ''}")
        if not os.path.exists(os.path.join(path, ".complete")):
            write(path, cfg, "cuda" if device.startswith("cuda") else "cpu", fmt)
        model = load(path, a.prompt_len + a.gen_len + 8, max(batches), device)
        active = weight_bytes_read(model)
        limit = bw / active
        table = [f"### {shape} shape, {FORMATS[fmt]}, {a.layers} layers (active weights {active / 2**20:,.1f} "
                 f"MiB/token, batch-1 limit {limit:,.1f} steps/s)", "",
                 "| batch | mode | tokens/s | ms/step | batch-1 limit fraction |", "|---|---|---|---|---|"]
        print("\n".join(table), flush=True)
        for b in batches:
            for mode in ("eager", "graphs"):
                model.config.no_graphs = mode == "eager" or a.tiny
                if a.tiny and mode == "graphs":
                    continue  # no CUDA graphs on a CPU
                dt = decode_seconds(model, b, a.prompt_len, a.gen_len, device)
                steps = a.gen_len / dt
                frac = f"{steps / limit:.1%}" if b == 1 and not a.tiny else ""
                table.append(f"| {b} | {mode} | {b * steps:,.1f} | {1e3 / steps:.3f} | {frac} |")
                print(table[-1], flush=True)
        table += ["", "| batch tokens | kernel | µs per layer | GB/s | of copy rate |", "|---|---|---|---|---|"]
        if a.tiny:
            table.insert(-3, "\nOn the CPU the kernel rows time the torch references the ops dispatch to.")
        print("\n".join(table[-4:]), flush=True)
        for b in batches:
            sweep = sweep_rows if fmt == "fp16" else sweep_rows_exl2
            for what, t, rate in kernel_rows(model, b, device, bw) + (sweep(model, b, device, bw) if a.sweep else []):
                table.append(f"| {b} | {what} | {1e6 * t:,.1f} | {rate / 1e9:,.0f} | {rate / bw:.0%} |")
                print(table[-1], flush=True)
        lines += table + [""]
        model.unload()
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    if out:
        with open(out, "a") as f:
            f.write("\n".join(lines) + "\n")
        print(f"appended to {out}")


if __name__ == "__main__":
    main()
