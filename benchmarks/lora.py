"""LoRA decode speed on one GPU: adapters against no adapter, measured in the same run (issue 17's targets).

    PYTHONPATH=. python benchmarks/lora.py [--quick] [--models 8b,exl2] [--work /tmp/exlpy_bench]
        [--out benchmarks/results/lora.md] [--profile]

Builds random-weight Llama-3-8B-shape models (benchmarks/make_models.py; reused under --work) and random rank-16
PEFT adapters on all seven projections, checks that a captured adapter step equals the eager one (and that the
adapter changes the logits), then times greedy decode through CUDA graphs:
  batch 1:  no adapter, then one adapter                                  (target: >= 90% of no adapter)
  batch 32: paged decode as the dynamic generator runs it, no adapter, then 32 rows over 4 adapters
            (target: >= 85%), plus all rows on one adapter and half the rows on none, for reference.
--quick: the fp16 model only, shorter runs. Results (device, date, command, figures) go to --out, appended.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from make_models import SHAPES, write_model  # noqa: E402

from exlpy.cli.bench import DecodeResult, load_model, weight_bytes_read  # noqa: E402

DEV = torch.device("cuda")  # tests point this at the CPU to run the timing code on a tiny model
MODELS = {"8b": ("llama3-8b", 0, "Llama-3-8B shape, fp16"), "exl2": ("llama3-8b", 4, "Llama-3-8B shape, EXL2 4.0 bpw")}
PROJ = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
        "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(path: str, shape: dict, rank: int, seed: int) -> str:
    """A PEFT adapter directory with random lora_A / lora_B (fp16) for every projection of every layer."""
    if os.path.exists(os.path.join(path, "adapter_model.safetensors")):
        return path
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    h, d, inter = shape["hidden_size"], shape["head_dim"], shape["intermediate_size"]
    hq, hk = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    dims = {"q_proj": (h, hq), "k_proj": (h, hk), "v_proj": (h, hk), "o_proj": (hq, h), "gate_proj": (h, inter),
            "up_proj": (h, inter), "down_proj": (inter, h)}
    g = torch.Generator().manual_seed(seed)
    t = {}
    for i in range(shape["num_hidden_layers"]):
        for proj, (k, n) in dims.items():
            p = f"base_model.model.model.layers.{i}.{PROJ[proj]}.{proj}"
            t[f"{p}.lora_A.weight"] = (torch.randn(rank, k, generator=g) / k ** 0.5).half()
            t[f"{p}.lora_B.weight"] = (torch.randn(n, rank, generator=g) * 0.02).half()
    save_file(t, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJ),
                   "bias": "none"}, f)
    return path


def _sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def check_graph_step(model: Any, lora: Any) -> tuple[float, float]:
    """(max relative |graph - eager| of adapter decode logits, relative adapter effect) over a few steps."""
    from exlpy import ExLlamaV2Cache

    caches = [ExLlamaV2Cache(model, batch_size=2, max_seq_len=80) for _ in range(3)]
    ids = torch.randint(0, model.config.vocab_size, (2, 64), device=DEV)
    for c, loras in zip(caches, ([lora], [lora], None)):
        model.forward(ids, c, preprocess_only=True, loras=loras)
    tok, worst, effect = ids[:, -1:], 0.0, 0.0
    for _ in range(4):
        model.config.no_graphs = True
        ref = model.forward(tok, caches[0], loras=[lora])
        base = model.forward(tok, caches[2])
        model.config.no_graphs = False
        out = model.forward(tok, caches[1], loras=[lora])
        scale = ref.abs().max().item()
        worst = max(worst, (out - ref).abs().max().item() / scale)
        effect = max(effect, (ref - base).abs().max().item() / scale)
        tok = ref[:, -1].argmax(-1, keepdim=True)
    return worst, effect


def decode_b1(model: Any, loras: list | None, prompt_len: int, gen_len: int, warmup: int = 4) -> DecodeResult:
    """Greedy batch-1 decode via model.forward (the captured step), argmax kept on the GPU."""
    from exlpy import ExLlamaV2Cache

    cache = ExLlamaV2Cache(model, batch_size=1, max_seq_len=prompt_len + gen_len + warmup)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_len), device=DEV,
                        generator=torch.Generator(device=DEV).manual_seed(0))
    first = model.forward(ids, cache, last_id_only=True, loras=loras)[:, -1].argmax(-1, keepdim=True)
    tok = first
    for _ in range(warmup):
        tok = model.forward(tok, cache, loras=loras)[:, -1].argmax(-1, keepdim=True)
    cache.current_seq_len = prompt_len
    out = torch.empty(1, gen_len, dtype=torch.long, device=DEV)
    tok = first
    _sync()
    t0 = time.perf_counter()
    for i in range(gen_len):
        tok = model.forward(tok, cache, loras=loras)[:, -1].argmax(-1, keepdim=True)
        out[:, i:i + 1] = tok
    out.cpu()
    return DecodeResult(1, prompt_len, gen_len, time.perf_counter() - t0, weight_bytes_read(model))


def decode_paged(model: Any, slots: list[int] | None, context: int, gen_len: int, page: int = 256,
                 warmup: int = 3) -> DecodeResult:
    """len(slots) (or 32) sequences over a paged cache, one forward_batch per step as the dynamic generator runs
    it; row r uses adapter slot slots[r] (-1: none)."""
    from exlpy import ExLlamaV2Cache
    from exlpy.model.batch import ForwardBatch

    batch = len(slots) if slots else 32
    per_seq = (context + gen_len + warmup + page - 1) // page
    pool = ExLlamaV2Cache(model, batch_size=batch * per_seq, max_seq_len=page)
    dev = DEV
    bt = torch.randperm(batch * per_seq, device=dev).view(batch, per_seq).int()
    adapters = torch.tensor(slots, device=dev) if slots else None
    lora = int(bool(slots) and max(slots) >= 0)
    tok = torch.randint(0, model.config.vocab_size, (batch, 1), device=dev)

    def step(pos: int, tok: torch.Tensor) -> torch.Tensor:
        positions = torch.full((batch, 1), pos, dtype=torch.long, device=dev)
        slot_rows = bt[:, pos // page].long().view(batch, 1) * page + pos % page
        fb = ForwardBatch(batch, 1, positions, cache=pool, slots=slot_rows, block_table=bt, page_size=page,
                          seqlens=torch.full((batch,), pos + 1, dtype=torch.int32, device=dev), max_seqlen=pos + 1,
                          adapters=adapters, lora=lora)
        return model.forward_batch(tok, fb)[:, -1].argmax(-1, keepdim=True)

    for i in range(warmup):
        tok = step(context + i, tok)
    _sync()
    t0 = time.perf_counter()
    for i in range(gen_len):
        tok = step(context + i, tok)
    tok.cpu()
    c = model.config
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2
    return DecodeResult(batch, context, gen_len, time.perf_counter() - t0,
                        weight_bytes_read(model) + batch * (context + gen_len / 2) * kv)


def profile(model: Any, loras: list | None, label: str) -> str:
    """Top GPU kernels of 5 captured batch-1 steps (where an adapter's time goes)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    from exlpy import ExLlamaV2Cache

    cache = ExLlamaV2Cache(model, batch_size=1, max_seq_len=600)
    tok = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    for _ in range(3):
        cache.current_seq_len = 512
        model.forward(tok, cache, loras=loras)
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            cache.current_seq_len = 512
            model.forward(tok, cache, loras=loras)
        torch.cuda.synchronize()
    return f"--- {label}\n" + p.key_averages().table(sort_by="cuda_time_total", row_limit=16, max_name_column_width=60)


def bench(key: str, args: argparse.Namespace, lines: list[str], extra: list[str]) -> None:
    from exlpy import ExLlamaV2Lora
    from exlpy.lora import registry_of

    shape_name, bits, label = MODELS[key]
    d = write_model(os.path.join(args.work, f"{shape_name}-{bits or 16}"), shape_name, exl2_bits=bits)
    shape = SHAPES[shape_name]
    model = load_model(d, max(args.prompt_len + args.gen_len + 64, 1024), 32)
    try:
        t0 = time.perf_counter()
        loras = [ExLlamaV2Lora.from_directory(model, write_adapter(os.path.join(args.work, f"lora-r{args.rank}-{i}"),
                                                                   shape, args.rank, i)) for i in range(4)]
        extra.append(f"- {label}: 4 rank-{args.rank} adapters read and written to their slots in "
                     f"{time.perf_counter() - t0:.1f} s")
        err, effect = check_graph_step(model, loras[0])
        extra.append(f"- {label}: captured adapter step vs eager, max |Δlogits| / max |logits| = {err:.2e} "
                     f"(adapter effect {effect:.2e})")

        def row(what: str, r: DecodeResult, base: DecodeResult | None, target: float | None) -> None:
            rel = "" if base is None else f"{r.tokens_per_s / base.tokens_per_s:.1%}"
            verdict = "" if target is None or base is None else \
                ("meets" if r.tokens_per_s >= target * base.tokens_per_s else "MISSES") + f" {target:.0%}"
            lines.append(f"| {label} | {what} | {r.tokens_per_s:,.1f} | {1e3 * r.seconds / r.gen_len:.3f} | {rel} | "
                         f"{verdict} |")
            print(lines[-1], flush=True)

        b0 = decode_b1(model, None, args.prompt_len, args.gen_len)
        row("decode b1, no adapter", b0, None, None)
        row(f"decode b1, rank-{args.rank} adapter", decode_b1(model, [loras[0]], args.prompt_len, args.gen_len), b0,
            0.90)
        reg = registry_of(model)
        slots = [reg.acquire([lr]) for lr in loras]
        try:
            p0 = decode_paged(model, None, args.prompt_len, args.paged_len)
            row("paged b32, no adapter", p0, None, None)
            row("paged b32 over 4 adapters", decode_paged(model, [slots[r % 4] for r in range(32)], args.prompt_len,
                                                           args.paged_len), p0, 0.85)
            row("paged b32, one adapter", decode_paged(model, [slots[0]] * 32, args.prompt_len, args.paged_len), p0,
                None)
            row("paged b32, half on 2 adapters, half none",
                decode_paged(model, [slots[r % 2] if r < 16 else -1 for r in range(32)], args.prompt_len,
                             args.paged_len), p0, None)
        finally:
            for s in slots:
                reg.release(s)
        if args.profile:
            extra.append("```\n" + profile(model, None, f"{label} b1 no adapter") + "\n"
                         + profile(model, [loras[0]], f"{label} b1 adapter") + "\n```")
    finally:
        model.unload()
        gc.collect()
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fp16 model only, shorter runs")
    ap.add_argument("--models", default="8b,exl2")
    ap.add_argument("--work", default="/tmp/exlpy_bench")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "lora.md"))
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=256)
    ap.add_argument("--paged-len", type=int, default=64)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/lora.py needs a CUDA device")
    if args.quick:
        args.models, args.gen_len, args.paged_len, args.prompt_len = "8b", 96, 32, 256
    lines = [f"## Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on "
             f"{torch.cuda.get_device_name()}", "",
             f"Command: `python benchmarks/lora.py {' '.join(sys.argv[1:])}`  ",
             f"torch {torch.__version__}; prompt {args.prompt_len} tokens, {args.gen_len} decoded at batch 1, "
             f"{args.paged_len} steps at batch 32; adapters rank {args.rank} on q/k/v/o/gate/up/down.", "",
             "| model | what | tokens/s | ms/step | vs no adapter | target |", "|---|---|---|---|---|---|"]
    extra: list[str] = []
    for key in [k for k in args.models.split(",") if k]:
        try:
            bench(key, args, lines, extra)
        except Exception as e:  # report and go on with the next model
            lines.append(f"| {MODELS[key][2]} | – | – | – | – | failed: {type(e).__name__}: {str(e)[:200]} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines + [""] + extra) + "\n\n"
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "a") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
