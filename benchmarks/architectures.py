"""Batch-1 decode speed and logits of the new architectures on one GPU, each against a Llama that reads the same
weight bytes per token (its twin: same hidden, intermediate, heads, head_dim, layers and vocabulary).

python benchmarks/architectures.py [--work /tmp/exlpy_arch] [--layers 8] [--variants gemma2,phi3]
    [--prompt-len 512] [--gen-len 128] [--out benchmarks/results/architectures.md]

Models are random (transformers' own init on the GPU, saved by `save_pretrained` in fp16): speed depends on
shapes only. `--layers` cuts the decoder depth so that the whole run fits in five minutes on an H100 (the
embedding and head keep their real size). For each variant: transformers' fp32 logits (TF32 off) on a random
prompt against exlpy's fp16 ones (relative error, argmax agreement, and transformers' own fp16 error as the
yardstick), then exlpy's batch-1 decode tokens/s (CUDA graphs) and the same for the Llama twin. A variant that
fails is reported as failed and the others still run.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import shutil
import sys
import time
import traceback
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from exlpy.cli.bench import load_model, time_decode  # noqa: E402

# transformers model_type and config of the real models' shapes (layers cut by --layers).
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma2": ("gemma2", dict(vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                              num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                              query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
                              final_logit_softcapping=30.0, max_position_embeddings=8192)),
    "phi3": ("phi3", dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                          pad_token_id=0)),
}
LABELS = {"gemma2": "Gemma-2-9B shape", "phi3": "Phi-3-mini shape"}


def twin(model_type: str, kw: dict[str, Any]) -> dict[str, Any]:
    """The Llama config with the same bytes per decoded token."""
    head_dim = kw.get("head_dim", kw["hidden_size"] // kw["num_attention_heads"])
    return dict(vocab_size=kw["vocab_size"], hidden_size=kw["hidden_size"], intermediate_size=kw["intermediate_size"],
                num_hidden_layers=kw["num_hidden_layers"], num_attention_heads=kw["num_attention_heads"],
                num_key_value_heads=kw["num_key_value_heads"], head_dim=head_dim,
                max_position_embeddings=kw["max_position_embeddings"], tie_word_embeddings=model_type == "gemma2",
                pad_token_id=0)


def build(path: str, model_type: str, kw: dict[str, Any], seed: int) -> Any:
    """A random transformers model on the GPU, saved in fp16 to `path`; returned (fp16, on the GPU)."""
    import transformers as tf

    torch.manual_seed(seed)
    config = tf.AutoConfig.for_model(model_type, **kw)
    with torch.device("cuda"):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float16).eval()
    shutil.rmtree(path, ignore_errors=True)
    model.save_pretrained(path, safe_serialization=True)
    return model


def hf_logits(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp16 logits, fp32 logits with TF32 off) of the transformers model; leaves it in fp32."""
    with torch.no_grad():
        half = model(ids).logits.float()
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            full = model.float()(ids).logits.float()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
    return half, full


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return ((a - b).abs().max() / b.abs().max()).item()


def run_variant(name: str, args: argparse.Namespace, lines: list[str]) -> None:
    model_type, kw = SHAPES[name]
    kw = {**kw, "num_hidden_layers": min(args.layers, kw["num_hidden_layers"])}
    ids = torch.randint(3, kw["vocab_size"], (1, args.check_len), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(1))
    rows = []
    for label, mt, cfg in ((LABELS[name], model_type, kw), ("Llama twin", "llama", twin(model_type, kw))):
        path = os.path.join(args.work, f"{name}-{mt}")
        hf = build(path, mt, cfg, seed=0)
        half, full = hf_logits(hf, ids)
        del hf
        gc.collect()
        torch.cuda.empty_cache()
        model = load_model(path, args.prompt_len + args.gen_len + 64)
        try:
            out = model.forward(ids.cpu())
            err, hf_err = rel(out, full), rel(half, full)
            agree = (out.argmax(-1).cpu() == full.argmax(-1).cpu()).float().mean().item()
            r = time_decode(model, 1, args.prompt_len, args.gen_len)
            rows.append((label, r.tokens_per_s))
            lines.append(f"| {LABELS[name]} | {label} | {kw['num_hidden_layers']} | {r.tokens_per_s:,.1f} | "
                         f"{r.seconds / args.gen_len * 1e3:.2f} | {err:.2e} | {hf_err:.2e} | {agree:.3f} |")
            print(lines[-1], flush=True)
        finally:
            model.unload()
            del model
            gc.collect()
            torch.cuda.empty_cache()
    if len(rows) == 2:
        lines.append(f"| {LABELS[name]} | **ratio to twin** | | **{rows[0][1] / rows[1][1]:.3f}** | | | | |")
        print(lines[-1], flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/exlpy_arch")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "architectures.md"))
    ap.add_argument("--variants", default="gemma2,phi3")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers of every model (the real depth: 0)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--check-len", type=int, default=64, help="prompt length of the logits check")
    args = ap.parse_args()
    if args.layers <= 0:
        args.layers = 10**6
    os.makedirs(args.work, exist_ok=True)
    t0 = time.perf_counter()
    lines = [f"## Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on "
             f"{torch.cuda.get_device_name()}", "",
             f"Command: `python benchmarks/architectures.py {' '.join(sys.argv[1:])}`  ",
             f"torch {torch.__version__}; batch 1, prompt {args.prompt_len}, {args.gen_len} decoded tokens (CUDA "
             f"graphs); logits on a {args.check_len}-token prompt against transformers fp32 (TF32 off).", "",
             "| shape | model | layers | decode tok/s | ms/token | logits rel. err. (fp16) | transformers fp16 "
             "rel. err. | argmax agreement |", "|---|---|---|---|---|---|---|---|"]
    failed = []
    for name in [v for v in args.variants.split(",") if v]:
        try:
            run_variant(name, args, lines)
        except Exception as e:  # one variant failing must not lose the others' results
            failed.append(f"- {name}: FAILED: {type(e).__name__}: {e}")
            traceback.print_exc()
            gc.collect()
            torch.cuda.empty_cache()
    lines += [""] + failed + ["", f"Total time {time.perf_counter() - t0:.0f} s.", ""]
    text = "\n".join(lines)
    print(text)
    with open(args.out, "a", encoding="utf-8") as f:
        f.write(text + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
