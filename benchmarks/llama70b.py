"""A full Llama-3-70B-shaped model (random weights) loaded with load_autosplit across several GPUs.

Checks that it decodes correctly and records tokens/s. Correctness reference: the same prompt run module by
module on GPU 0 alone (each module loaded, applied and unloaded in turn), compared with the autosplit model's
logits; then incremental decoding with the cache spread over the GPUs is compared with a no-cache forward of the
whole sequence.

Usage (GPU machine): CUDA_VISIBLE_DEVICES=0,1,2,3 python benchmarks/llama70b.py --format fp16 --out FILE
                     CUDA_VISIBLE_DEVICES=0,1 python benchmarks/llama70b.py --format exl2 --out FILE
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import make_models  # noqa: E402
from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config  # noqa: E402
from exlpy.model import run_module  # noqa: E402
from exlpy.model.batch import contiguous_batch  # noqa: E402

make_models.SHAPES["llama3-70b"] = dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                                        num_key_value_heads=8, head_dim=128, intermediate_size=28672,
                                        vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0)


@torch.inference_mode()
def streamed_reference(path: str, ids: torch.Tensor) -> torch.Tensor:
    """Logits of `ids` computed one module at a time on cuda:0 (no cache): an independent placement."""
    config = ExLlamaV2Config(path)
    config.max_seq_len = 1024
    model = ExLlamaV2(config)
    dev = torch.device("cuda:0")
    x = ids.to(dev)
    batch = contiguous_batch(ids.shape[0], ids.shape[1], 0, None, 0, dev)
    for m in model.modules:
        m.load(dev)
        x = run_module(m, x, batch)
        m.unload()
        torch.cuda.empty_cache()
    return x.float().cpu()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--format", choices=["fp16", "exl2"], default="fp16")
    p.add_argument("--dir", default="/tmp/llama70b")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    n_gpu = torch.cuda.device_count()
    path = f"{args.dir}-{args.format}"
    t0 = time.perf_counter()
    make_models.write_model(path, "llama3-70b", exl2_bits=4 if args.format == "exl2" else 0)
    t_write = time.perf_counter() - t0
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    ids = torch.randint(0, 128256, (1, 16), generator=torch.Generator().manual_seed(0))

    t0 = time.perf_counter()
    ref = streamed_reference(path, ids)
    t_ref = time.perf_counter() - t0

    config = ExLlamaV2Config(path)
    config.max_seq_len = 4096
    config.max_input_len = 512
    model = ExLlamaV2(config)
    cache = ExLlamaV2Cache(model, lazy=True)
    t0 = time.perf_counter()
    model.load_autosplit(cache)
    torch.cuda.synchronize()
    t_load = time.perf_counter() - t0
    layers_per_dev = {str(d): sum(1 for m in model.modules if m.device == d) for d in model.devices()}
    mem = [torch.cuda.memory_allocated(i) / 2**30 for i in range(n_gpu)]

    logits = model.forward(ids, cache)
    err_ref = ((logits.cpu() - ref).abs().max() / ref.abs().max()).item()
    # Greedy decode with the cache spread over the GPUs, then the whole sequence without a cache.
    tok = logits[:, -1:].argmax(-1)
    seq = [tok.cpu()]
    step_logits = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        out = model.forward(tok, cache)
        step_logits.append(out.cpu())
        tok = out[:, -1:].argmax(-1)
        seq.append(tok.cpu())
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    full_ids = torch.cat([ids] + seq[:-1], dim=1)
    full = model.forward(full_ids).cpu()
    inc = torch.cat([logits.cpu()] + step_logits, dim=1)
    err_inc = ((inc - full).abs().max() / full.abs().max()).item()
    agree = (inc.argmax(-1) == full.argmax(-1)).float().mean().item()

    lines = [
        f"## Llama-3-70B shape, {args.format}, load_autosplit over {n_gpu} GPUs",
        "",
        f"- device: {n_gpu}x {torch.cuda.get_device_name(0)}; date {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC; "
        f"torch {torch.__version__}",
        f"- command: `CUDA_VISIBLE_DEVICES=... python benchmarks/llama70b.py --format {args.format}`",
        f"- weights on disk: {size / 1e9:.1f} GB (written in {t_write:.0f} s); load_autosplit {t_load:.0f} s; "
        f"streamed one-GPU reference {t_ref:.0f} s",
        f"- modules per device: {layers_per_dev}; allocated GiB per GPU: {[round(m, 1) for m in mem]}",
        f"- prompt logits vs streamed one-GPU reference: max rel err {err_ref:.2e}",
        f"- incremental decode ({args.steps} steps, cache across GPUs) vs no-cache forward of the same sequence: "
        f"max rel err {err_inc:.2e}, argmax agreement {agree * 100:.1f}%",
        f"- batch-1 greedy decode: {args.steps / dt:.1f} tokens/s ({dt / args.steps * 1000:.1f} ms/token; weights "
        f"{size / 1e9:.1f} GB -> {size / 1e9 / (dt / args.steps) / 1000:.2f} TB/s aggregate)",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")
    ok = err_ref < 2e-2 and err_inc < 2e-2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
