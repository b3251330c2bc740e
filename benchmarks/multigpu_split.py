"""2-GPU layer split check on a Llama-3-8B-shaped model with random fp16 weights (std 0.02).

Builds the model directory on local disk (reused when present), then loads it three ways:
  single    model.load()                      everything on cuda:0
  split     model.load(gpu_split=[G0, 999])   explicit budgets that force a split over 2 GPUs
  auto      model.load_autosplit(lazy cache)  the balanced planner over every visible GPU
and for each: predicted bytes per device (the same plan `exlpy plan` prints) vs torch.cuda.memory_allocated
right after loading (target within 5%), logits of a 64-token prompt vs the single-GPU run (fp16 tolerance), and
batch-1 decode tokens/s (warmup, then --steps steps with the cache). Prints a markdown table, writes it to --out.

    PYTHONPATH=. python benchmarks/multigpu_split.py --out results/multigpu_split.md
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

SHAPE = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
         "intermediate_size": 14336, "vocab_size": 128256}


def write_model(path: Path, shape: dict[str, int], seed: int = 0, layers_per_shard: int = 4) -> None:
    """Random fp16 Llama directory (config.json + sharded safetensors + index); skipped when already there."""
    from safetensors.torch import save_file

    cfg = {**shape, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
           "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192,
           "tie_word_embeddings": False, "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2,
           "head_dim": shape["hidden_size"] // shape["num_attention_heads"]}
    marker = path / "config.json"
    if marker.exists() and json.loads(marker.read_text()) == cfg and (path / "model.safetensors.index.json").exists():
        return
    path.mkdir(parents=True, exist_ok=True)
    dev = "cuda:0" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(seed)
    h, i, v, d = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"], cfg["head_dim"]
    hq, hkv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d

    def rnd(*s: int) -> torch.Tensor:
        return (torch.randn(*s, generator=gen, device=dev, dtype=torch.float32) * 0.02).half().cpu()

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.float16)

    groups: list[dict[str, torch.Tensor]] = [{"model.embed_tokens.weight": rnd(v, h)}]
    n = shape["num_hidden_layers"]
    for start in range(0, n, layers_per_shard):
        g: dict[str, torch.Tensor] = {}
        for li in range(start, min(n, start + layers_per_shard)):
            p = f"model.layers.{li}"
            g |= {f"{p}.input_layernorm.weight": ones(h), f"{p}.post_attention_layernorm.weight": ones(h),
                  f"{p}.self_attn.q_proj.weight": rnd(hq, h), f"{p}.self_attn.k_proj.weight": rnd(hkv, h),
                  f"{p}.self_attn.v_proj.weight": rnd(hkv, h), f"{p}.self_attn.o_proj.weight": rnd(h, hq),
                  f"{p}.mlp.gate_proj.weight": rnd(i, h), f"{p}.mlp.up_proj.weight": rnd(i, h),
                  f"{p}.mlp.down_proj.weight": rnd(h, i)}
        groups.append(g)
    groups.append({"model.norm.weight": ones(h), "lm_head.weight": rnd(v, h)})
    weight_map = {}
    for k, g in enumerate(groups):
        name = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        save_file(g, str(path / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(g, name)
    total = sum(t.nbytes for g in groups for t in g.values())
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    marker.write_text(json.dumps(cfg))  # last: a half-written directory is rebuilt next time


def make_model(path: Path, seq: int) -> object:
    from exlpy import ExLlamaV2, ExLlamaV2Config

    cfg = ExLlamaV2Config(str(path))
    cfg.max_seq_len = seq
    cfg.max_input_len = 256
    cfg.max_attention_size = 256 * seq
    return ExLlamaV2(cfg)


def allocated() -> list[int]:
    return [torch.cuda.memory_allocated(d) for d in range(torch.cuda.device_count())]


def run_case(name: str, path: Path, seq: int, ids: torch.Tensor, steps: int, split_gb: float) -> dict:
    from exlpy import ExLlamaV2Cache
    from exlpy.engine.placement import plan_for_model
    from exlpy.parallel.costs import cache_spec_of
    from exlpy.parallel.plan import DeviceBudget

    model = make_model(path, seq)
    cache = ExLlamaV2Cache(model, max_seq_len=seq, lazy=True)
    before = allocated()
    t0 = time.perf_counter()
    if name == "single":
        model.load()
        # Loading with gpu_split=None makes no plan; make the same one exlpy plan would for one device.
        plan = plan_for_model(model, [DeviceBudget(1 << 50)], torch.device("cuda:0"), max_seq_len=seq,
                              batch_size=1, cache=cache_spec_of(cache), layer_cache=None, policy="greedy")
    elif name == "split":
        model.load(gpu_split=[split_gb, 999])
        plan = model.placement_plan
    else:
        model.load_autosplit(cache)
        plan = model.placement_plan
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    after = allocated()
    used = [a - b for a, b in zip(after, before)]
    pred = [plan.predicted_allocated(i) if i < len(plan.usage) else 0 for i in range(len(used))]
    layers = [len(plan.layers_on(i)) if i < len(plan.usage) else 0 for i in range(len(used))]

    logits = model.forward(ids, cache).float()
    tok = logits[:, -1:].argmax(-1)
    for _ in range(8):  # warmup: allocator, Triton compilation, P2P
        tok = model.forward(tok, cache)[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = model.forward(tok, cache)[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    tps = steps / (time.perf_counter() - t0)
    out = {"name": name, "layers": layers, "pred": pred, "used": used, "tps": tps, "load_s": load_s,
           "logits": logits.cpu(), "devices": sorted({str(m.device) for m in model.modules})}
    model.unload()
    del model, cache, logits
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="markdown file to write the table to")
    ap.add_argument("--dir", default=".gpu/llama3-8b-random", help="where to build the random model (reused)")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--seq", type=int, default=1024, help="cache max_seq_len")
    ap.add_argument("--split-gb", type=float, default=7.0, help="gpu_split budget of cuda:0 for the split case")
    ap.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"], help="fewer layers: quicker run")
    ap.add_argument("--exl2", type=int, default=0, metavar="BITS",
                    help="an EXL2 model of uniform BITS (benchmarks/make_models.py, full 8B shape) instead of fp16")
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        print(f"needs 2 CUDA devices, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    path = Path(args.dir)
    t0 = time.perf_counter()
    if args.exl2:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from make_models import write_model as write_exl2

        write_exl2(str(path), "llama3-8b", exl2_bits=args.exl2)
    else:
        write_model(path, {**SHAPE, "num_hidden_layers": args.layers})
    print(f"model at {path} ready in {time.perf_counter() - t0:.1f} s", flush=True)

    from exlpy.cli import plan as plan_cli

    print("exlpy plan --gpu-split", flush=True)
    plan_cli.run(argparse.Namespace(model=str(path), gpu_split=f"{args.split_gb},999", reserve=None,
                                    max_seq_len=args.seq, fit_context=False, batch=1, max_input_len=256,
                                    cache_type="fp16", devices=None, policy=None))
    ids = torch.randint(0, SHAPE["vocab_size"], (1, 64), generator=torch.Generator().manual_seed(0))
    results = []
    for name in ("single", "split", "auto"):
        r = run_case(name, path, args.seq, ids, args.steps, args.split_gb)
        print(f"{name}: loaded in {r['load_s']:.1f} s on {r['devices']}, {r['tps']:.1f} tok/s", flush=True)
        results.append(r)

    ref = results[0]["logits"]
    ok = True
    lines = ["| case | layers per GPU | predicted MiB per GPU (weights+cache) | allocated MiB per GPU | worst diff "
             "| max abs Δlogits vs single | decode tok/s (batch 1) |", "|---|---|---|---|---|---|---|"]
    for r in results:
        diffs = [abs(p - u) / max(u, 1) for p, u in zip(r["pred"], r["used"]) if u > 64 * 2**20 or p > 64 * 2**20]
        worst = max(diffs, default=0.0)
        dl = (r["logits"] - ref).abs().max().item()
        ok &= worst <= 0.05 and dl <= 5e-2 and torch.isfinite(r["logits"]).all().item()
        mib = lambda xs: " / ".join(f"{x / 2**20:,.0f}" for x in xs)  # noqa: E731
        lines.append(f"| {r['name']} | {' / '.join(map(str, r['layers']))} | {mib(r['pred'])} | {mib(r['used'])} "
                     f"| {worst:.1%} | {dl:.2e} | {r['tps']:.1f} |")
    lines.append("")
    lines.append(f"GPUs: {' + '.join(torch.cuda.get_device_name(d) for d in range(torch.cuda.device_count()))}; "
                 f"torch {torch.__version__}; Llama-3-8B shape with {args.layers} layers, random "
                 f"{f'EXL2 {args.exl2}-bit' if args.exl2 else 'fp16'}; cache "
                 f"{args.seq} tokens fp16; checks (memory within 5%, logits within 5e-2): {'PASS' if ok else 'FAIL'}")
    table = "\n".join(lines)
    print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(table + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("EXLPY_NO_CPU_WARNING", "1")
    sys.exit(main())
