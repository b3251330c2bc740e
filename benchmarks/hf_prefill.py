"""HF transformers prefill speed (SDPA attention): one forward of N tokens into an empty cache.

python benchmarks/hf_prefill.py --model DIR --lengths 2048,8192,32768,65536 [--reps 2]
prints one JSON line per length: {"tokens", "seconds", "tokens_per_s", "peak_gb"} (or {"tokens", "error"}).
The forward keeps only the last position's logits (`logits_to_keep=1`), as a generate() prefill does and as
exlpy's prefill benchmark does; run as a subprocess so that its memory is gone before the next measurement.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--lengths", default="2048,8192,32768")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float16, device_map="cuda:0",
                                                 attn_implementation="sdpa").eval()
    for n in (int(x) for x in args.lengths.split(",")):
        ids = torch.randint(0, model.config.vocab_size, (1, n), device="cuda:0")
        try:
            best = float("inf")
            torch.cuda.reset_peak_memory_stats()
            for _ in range(args.reps + 1):  # the first call warms up cuBLAS / SDPA for this shape
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with torch.inference_mode():
                    model(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True,
                          logits_to_keep=1)
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t0)
            print(json.dumps({"tokens": n, "seconds": best, "tokens_per_s": n / best,
                              "peak_gb": torch.cuda.max_memory_allocated() / 2**30}), flush=True)
        except torch.cuda.OutOfMemoryError:
            print(json.dumps({"tokens": n, "error": "out of memory"}), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
