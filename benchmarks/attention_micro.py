"""Attention alone on one GPU: the flash kernel over the cache vs torch SDPA, and decode over quantized caches.

python benchmarks/attention_micro.py [--quick] [--out FILE]
- prefill, one sequence, Llama-3-8B attention shapes (and GQA 8:1, head_dim 64): the whole causal block in one
  call over a contiguous cache, and the last 2,048-token chunk of the sequence over a paged cache (256-token
  pages in random order: the dynamic generator's chunked prefill), each in TFLOP/s of the causal FLOP count
  (4 * Hq * D * visible (query, key) pairs); next to torch SDPA on the same tensors (flash backend, and torch's
  own backend choice, which may be cuDNN), measured in the same run;
- decode and verify steps at 32k context: fp16 decode kernel, the flash kernel, and the flash kernel over
  Q4/Q6/Q8/FP8 caches: microseconds per call inside a CUDA graph and GB/s of K/V read.
Writes a markdown table (device, date, command) to --out.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.gemv_shapes import graph_time  # noqa: E402
from exlpy.kernels.flash_attention import flash_attention_launch, plain_operand, quant_operand  # noqa: E402
from exlpy.kernels.paged_attention import paged_decode_attention  # noqa: E402

DEV = "cuda"
PAGE = 256
SHAPES = [(32, 8, 128), (32, 4, 128), (32, 8, 64)]  # (Hq, Hkv, D): 8B, GQA 8:1, head_dim 64
FORMATS = {"Q4": (4, 4, False), "Q6": (8, 4, False), "Q8": (8, 8, False), "FP8": (8, 8, True)}


def causal_flops(hq: int, d: int, past: int, n: int) -> float:
    """4 * Hq * D * (visible pairs) for n queries after `past` cached keys."""
    return 4.0 * hq * d * (n * past + n * (n + 1) / 2)


def bench(fn: Callable[[], object]) -> float:
    """Median milliseconds of fn (triton.testing.do_bench: warm-up, L2 flush between calls)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=200))


def prefill_case(hq: int, hk: int, d: int, T: int, seed: int = 0) -> dict:
    """Tensors for one T-token sequence: contiguous cache [1, T, hk, d] and the same keys in shuffled pages."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(1, T, hq, d, device=DEV, dtype=torch.float16, generator=g)
    k = torch.randn(1, T, hk, d, device=DEV, dtype=torch.float16, generator=g)
    v = torch.randn(1, T, hk, d, device=DEV, dtype=torch.float16, generator=g)
    pages = (T + PAGE - 1) // PAGE
    bt = torch.randperm(pages, device=DEV, generator=g).int().view(1, -1)
    t = torch.arange(T, device=DEV)
    rows = bt[0, t // PAGE].long() * PAGE + t % PAGE
    kp = torch.zeros(pages * PAGE, hk, d, device=DEV, dtype=torch.float16)
    vp = torch.zeros_like(kp)
    kp[rows], vp[rows] = k[0], v[0]
    return dict(q=q, k=k, v=v, kp=kp.view(pages, PAGE, hk, d), vp=vp.view(pages, PAGE, hk, d), bt=bt,
                pos=t.view(1, T), lens=torch.tensor([T], dtype=torch.int32, device=DEV),
                bt0=torch.zeros(1, 1, dtype=torch.int32, device=DEV))


def flash_one_shot(c: dict, config: tuple[int, int, int, int] | None = None, tma: bool | None = None
                   ) -> Callable[[], object]:
    T, d = c["q"].shape[1], c["q"].shape[3]
    return lambda: flash_attention_launch(c["q"], plain_operand(c["k"]), plain_operand(c["v"]), c["bt0"], T,
                                          c["lens"], T, c["pos"], d ** -0.5, config=config, tma=tma)


def flash_last_chunk(c: dict, chunk: int, config: tuple[int, int, int, int] | None = None,
                     tma: bool | None = None) -> Callable[[], object]:
    T, d = c["q"].shape[1], c["q"].shape[3]
    q, pos = c["q"][:, T - chunk:], c["pos"][:, T - chunk:]
    return lambda: flash_attention_launch(q, plain_operand(c["kp"]), plain_operand(c["vp"]), c["bt"], PAGE,
                                          c["lens"], T, pos, d ** -0.5, config=config, tma=tma)


def sdpa_one_shot(c: dict, flash_only: bool) -> Callable[[], object]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (c[x].transpose(1, 2) for x in "qkv")
    scale = c["q"].shape[3] ** -0.5

    def run() -> object:
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)

    if not flash_only:
        return run

    def flash() -> object:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return run()

    return flash


def prefill_rows(quick: bool) -> list[str]:
    lines = ["| Hq/Hkv/D | tokens | flash one-shot | flash one-shot, TMA | flash last 2k chunk (paged) | "
             "flash last 2k chunk, TMA | SDPA flash | SDPA default |", "|---|---|---|---|---|---|---|---|"]
    lengths = [2048, 8192] if quick else [2048, 8192, 32768, 65536]
    for hq, hk, d in SHAPES[:1] if quick else SHAPES:
        for T in lengths:
            c = prefill_case(hq, hk, d, T)
            full, chunk = causal_flops(hq, d, 0, T), causal_flops(hq, d, T - min(T, 2048), min(T, 2048))
            cells = []
            n = min(T, 2048)
            for fn, fl in ((flash_one_shot(c, tma=False), full), (flash_one_shot(c, tma=True), full),
                           (flash_last_chunk(c, n, tma=False), chunk), (flash_last_chunk(c, n, tma=True), chunk),
                           (sdpa_one_shot(c, True), full), (sdpa_one_shot(c, False), full)):
                try:
                    ms = bench(fn)
                    cells.append(f"{ms:.3f} ms, {fl / ms / 1e9:.0f} TFLOP/s")
                except Exception as e:  # a backend that does not take this shape
                    cells.append(f"failed: {type(e).__name__}: {str(e)[:60]}")
            lines.append(f"| {hq}/{hk}/{d} | {T:,} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
            del c
            torch.cuda.empty_cache()
    return lines


def _cycle(fns: list[Callable[[], object]]) -> Callable[[], object]:
    """Each call runs the next of several copies (one per simulated layer), so that L2 holds none of them."""
    it = iter(range(10**9))
    return lambda: fns[next(it) % len(fns)]()


def _step_runs(q: torch.Tensor, args: tuple, caches: list, quant: dict, fp16_bytes: float, decode_kernel: bool
               ) -> list[tuple[str, Callable[[], object], float]]:
    runs: list[tuple[str, Callable[[], object], float]] = []
    if decode_kernel:
        runs.append(("fp16, decode kernel", _cycle([
            (lambda kc=kc, vc=vc: paged_decode_attention(q, kc, vc, *args)) for kc, vc in caches]), fp16_bytes))
    runs.append(("fp16, flash kernel", _cycle([
        (lambda kc=kc, vc=vc: flash_attention_launch(q, plain_operand(kc), plain_operand(vc), *args))
        for kc, vc in caches]), fp16_bytes))
    for name, (sets, nbytes) in quant.items():
        runs.append((name, _cycle([(lambda ko=ko, vo=vo: flash_attention_launch(q, ko, vo, *args))
                                   for ko, vo in sets]), nbytes))
    return runs


def decode_rows(context: int, batches: list[int]) -> list[str]:
    """Decode (T=1) and verify (T=4) steps over `context` cached tokens per sequence, 8B shape."""
    hq, hk, d = 32, 8, 128
    E = hk * d
    lines = ["| batch x T | cache | µs / call | K/V GB/s | vs first row |", "|---|---|---|---|---|"]
    for B in batches:
        pages = (context + PAGE - 1) // PAGE
        bt = torch.randperm(B * pages, device=DEV).int().view(B, pages)
        lens = torch.full((B,), context, dtype=torch.int32, device=DEV)
        fp16_bytes = 2 * B * context * E * 2
        copies = max(1, -(-400 * 2**20 // fp16_bytes))  # fp16 K/V sets spanning 400 MB: 8x the H100's L2
        caches = [(torch.randn(B * pages, PAGE, hk, d, device=DEV, dtype=torch.float16),
                   torch.randn(B * pages, PAGE, hk, d, device=DEV, dtype=torch.float16)) for _ in range(copies)]
        quant = {}
        for name, (kb, vb, fp8) in FORMATS.items():
            sets = []
            for _ in range(copies):
                kq = torch.randint(0, 255, (B * pages, PAGE, E * kb // 8), device=DEV, dtype=torch.uint8)
                vq = torch.randint(0, 255, (B * pages, PAGE, E * vb // 8), device=DEV, dtype=torch.uint8)
                if fp8:  # finite FP8 codes: exponent bits never all ones
                    kq &= 0xBB
                    vq &= 0xBB
                ks = None if fp8 else torch.rand(B * pages, PAGE, E // 32, device=DEV).half() * 0.1
                vs = None if fp8 else torch.rand(B * pages, PAGE, E // 32, device=DEV).half() * 0.1
                sets.append((quant_operand(kq, ks, kb), quant_operand(vq, vs, vb)))
            quant[name] = (sets, B * context * (E * (kb + vb) / 8 + (0 if fp8 else 2 * 2 * E / 32)))
        for T in (1, 4):
            q = torch.randn(B, T, hq, d, device=DEV, dtype=torch.float16)
            pos = (context - T + torch.arange(T, device=DEV)).view(1, T).expand(B, T).contiguous()
            args = (bt, PAGE, lens, context, pos, d ** -0.5)
            runs = _step_runs(q, args, caches, quant, fp16_bytes, T == 1)
            base = 0.0
            for name, fn, nbytes in runs:
                us = graph_time(fn) * 1e6
                base = base or us
                lines.append(f"| {B} x {T} | {name} | {us:.1f} | {nbytes / us / 1e3:.0f} | {us / base:.2f}x |")
                print(lines[-1], flush=True)
        del caches, quant
        torch.cuda.empty_cache()
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8B shape only, 2k/8k prefill, 8k decode context")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "attention_micro_run.md"))
    args = ap.parse_args()
    import triton

    lines = [f"## Attention kernels, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on "
             f"{torch.cuda.get_device_name()}", "",
             f"Command: `python benchmarks/attention_micro.py {' '.join(sys.argv[1:])}`  ",
             f"torch {torch.__version__}, triton {triton.__version__}", "", "### Prefill (fp16, one sequence)", ""]
    lines += prefill_rows(args.quick)
    ctx = 8192 if args.quick else 32768
    lines += ["", f"### Decode / verify steps over {ctx:,} cached tokens per sequence (8B: 32/8 heads, D 128)", ""]
    lines += decode_rows(ctx, [1] if args.quick else [1, 8])
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
