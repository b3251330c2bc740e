"""HF transformers decode speed on the same model directory; run as a subprocess so a slow compile can be capped.

python benchmarks/hf_bench.py --model DIR --mode eager|compile --prompt-len 512 --gen-len 256
prints one JSON line: {"mode", "tokens_per_s", "prefill_s", "compile_s", ...}.
Decode rate = (N - 1) new tokens ÷ (time of generate(N) - time of generate(1)), greedy, EOS suppressed.
The compile mode uses a static cache, with which `generate` compiles its decode step (reduce-overhead).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--mode", choices=["eager", "compile"], default="eager")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=256)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float16, device_map="cuda:0").eval()
    ids = torch.randint(0, model.config.vocab_size, (1, args.prompt_len), device="cuda:0")
    kw: dict = dict(do_sample=False, pad_token_id=0)
    compile_s = 0.0
    if args.mode == "compile":
        # A static cache makes generate() compile its decode forward itself (CompileConfig: reduce-overhead,
        # i.e. CUDA graphs); wrapping model.forward by hand also compiles the prefill and trips over cudagraphs.
        model.generation_config.cache_implementation = "static"
        t0 = time.perf_counter()
        for _ in range(2):  # compiles and records the graphs at the very cache size the timed run uses
            model.generate(ids, max_new_tokens=args.gen_len, min_new_tokens=args.gen_len, **kw)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0

    def timed(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        torch.cuda.synchronize()
        assert out.shape[1] == args.prompt_len + n
        return time.perf_counter() - t0

    # generate(N) first: a static cache of another length would recompile the decode step. generate(1) runs
    # the prefill only, so it never calls the compiled decode step.
    if args.mode == "eager":
        timed(2)  # cuBLAS and allocator warm-up
    tn = timed(args.gen_len)
    t1 = min(timed(1) for _ in range(2))
    print(json.dumps({"mode": args.mode, "tokens_per_s": (args.gen_len - 1) / (tn - t1), "prefill_s": t1,
                      "compile_s": compile_s, "gen_len": args.gen_len, "prompt_len": args.prompt_len}))


if __name__ == "__main__":
    main()
