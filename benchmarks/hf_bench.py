"""HF transformers decode speed on the same model directory; run as a subprocess so a slow compile can be capped.

python benchmarks/hf_bench.py --model DIR --mode eager|compile --prompt-len 512 --gen-len 256
prints one JSON line: {"mode", "tokens_per_s", "prefill_s", "compile_s", ...}.
eager: decode rate = (N - 1) new tokens ÷ (time of generate(N) - time of generate(1)), greedy, EOS suppressed.
compile: the recipe of HF's "optimizing inference" guide, written out: a StaticCache, an eager prefill, and
a decode step compiled with mode="reduce-overhead" (CUDA graphs) and fullgraph=True, called in a greedy loop
with `cudagraph_mark_step_begin()` before each step; decode rate = N steps ÷ their time, after a warm-up
that compiles and records the graphs.
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
    if args.mode == "compile":
        print(json.dumps(compiled_decode(model, ids, args.gen_len)))
        return
    kw: dict = dict(do_sample=False, pad_token_id=0)

    def timed(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        torch.cuda.synchronize()
        assert out.shape[1] == args.prompt_len + n
        return time.perf_counter() - t0

    timed(2)  # cuBLAS and allocator warm-up
    tn = timed(args.gen_len)
    t1 = min(timed(1) for _ in range(2))
    print(json.dumps({"mode": args.mode, "tokens_per_s": (args.gen_len - 1) / (tn - t1), "prefill_s": t1,
                      "compile_s": 0.0, "gen_len": args.gen_len, "prompt_len": args.prompt_len}))


@torch.no_grad()
def compiled_decode(model: torch.nn.Module, ids: torch.Tensor, gen_len: int) -> dict:
    from transformers import StaticCache

    P = ids.shape[1]
    dev = ids.device
    cache = StaticCache(config=model.config, max_cache_len=P + gen_len + 16)

    @torch.compile(mode="reduce-overhead", fullgraph=True)
    def step(tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return model(tok, position_ids=pos.unsqueeze(0), cache_position=pos, past_key_values=cache,
                     use_cache=True).logits

    def prefill() -> torch.Tensor:
        cache.reset()
        out = model(ids, cache_position=torch.arange(P, device=dev), past_key_values=cache, use_cache=True)
        return out.logits[:, -1:].argmax(-1)

    def run(n: int) -> tuple[float, torch.Tensor]:
        tok = prefill()
        toks = []
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(n):
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's output has been consumed
            logits = step(tok, torch.tensor([P + i], device=dev))
            tok = logits[:, -1:].argmax(-1)
            toks.append(tok)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, torch.cat(toks, 1)

    t0 = time.perf_counter()
    run(8)  # compiles, then records the CUDA graphs
    run(8)
    compile_s = time.perf_counter() - t0
    dt, toks = run(gen_len)
    return {"mode": "compile", "tokens_per_s": gen_len / dt, "compile_s": compile_s, "gen_len": gen_len,
            "prompt_len": P, "first_tokens": toks[0, :8].tolist()}


if __name__ == "__main__":
    main()
