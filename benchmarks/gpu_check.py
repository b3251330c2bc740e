"""GPU correctness check: fp16 GPU logits against the fp32 CPU reference path and the shared references.

Runs on the GPU machine: `python benchmarks/gpu_check.py --models DIR [DIR ...] --out FILE`. Each DIR is a model
directory; when it holds `reference.safetensors` (the EXL2 test models) the GPU logits are compared with it,
otherwise with exlpy's own fp32 CPU forward (itself equal to HF transformers, see tests/test_model_logits.py).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config  # noqa: E402


def load(path: str, device: str, max_seq_len: int = 512) -> tuple[ExLlamaV2, ExLlamaV2Cache]:
    config = ExLlamaV2Config(path)
    config.max_seq_len = max_seq_len
    if device == "cpu":
        config.dtype = torch.float32
    model = ExLlamaV2(config)
    cache = ExLlamaV2Cache(model, lazy=True)
    if device == "cpu":
        model.load(device="cpu")
    else:
        model.load_autosplit(cache)
    return model, cache


def greedy(model: ExLlamaV2, cache: ExLlamaV2Cache, ids: torch.Tensor, n: int) -> torch.Tensor:
    cache.current_seq_len = 0
    logits = model.forward(ids, cache, last_id_only=True)
    out = []
    for _ in range(n):
        tok = logits[:, -1].argmax(-1, keepdim=True)
        out.append(tok.cpu())
        logits = model.forward(tok, cache)
    return torch.cat(out, dim=1)[0]


def check(path: str) -> list[str]:
    from safetensors.torch import load_file

    rows = []
    ref_file = os.path.join(path, "reference.safetensors")
    gpu, gcache = load(path, "cuda")
    name = os.path.basename(path.rstrip("/"))
    if os.path.exists(ref_file):
        ref = load_file(ref_file)
        ids = ref["input_ids"]
        t0 = time.perf_counter()
        out = gpu.forward(ids).cpu()[0]
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if "logits" in ref:
            err = (out - ref["logits"]).abs().max().item()
            scale = ref["logits"].abs().max().item()
        else:
            err = (out[-8:] - ref["logits_last8"]).abs().max().item()
            scale = ref["logits_last8"].abs().max().item()
            lse = torch.logsumexp(out, -1)
            lse_err = (lse - ref["logits_lse"]).abs().max()
            rows.append(f"| {name} | logsumexp all positions | max abs err {lse_err:.4f} |")
        rows.append(f"| {name} | logits vs reference.safetensors | max abs err {err:.4f} "
                    f"(max |logit| {scale:.1f}, "
                    f"rel {err / scale:.2e}); forward {dt * 1000:.1f} ms |")
        g = greedy(gpu, gcache, ids, 32)
        same = int((g == ref["greedy_32"]).sum())
        first_diff = next((i for i in range(32) if g[i] != ref["greedy_32"][i]), None)
        rows.append(f"| {name} | greedy_32 | {same}/32 tokens equal (first difference at {first_diff}) |")
    else:
        cpu, _ = load(path, "cpu")
        ids = torch.randint(0, gpu.config.vocab_size, (2, 96), generator=torch.Generator().manual_seed(0))
        a = gpu.forward(ids).cpu()
        b = cpu.forward(ids)
        err = (a - b).abs().max().item()
        rows.append(f"| {name} | fp16 GPU vs fp32 CPU logits | max abs err {err:.4f} (max |logit| "
                    f"{b.abs().max():.2f}, rel {err / b.abs().max():.2e}) |")
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", required=True)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    lines = [f"GPU check on {torch.cuda.get_device_name(0)}, {datetime.date.today()}, torch {torch.__version__}",
             "", "| model | check | result |", "|---|---|---|"]
    for path in args.models:
        try:
            lines += check(path)
        except Exception as e:  # keep going: one failing model must not hide the others' results
            lines.append(f"| {os.path.basename(path)} | ERROR | {type(e).__name__}: {e} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
