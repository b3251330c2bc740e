"""exl2_speed part `e2e`: the four 8B models (EXL2 mixed and 4.0 bpw, fp16, GPTQ 4-bit; random weights written
once), decode tok/s per batch size and prefill."""

from __future__ import annotations

import argparse
import gc
import os
import time
from dataclasses import replace

import torch

from benchmarks.exl2_speed_parts.common import guarded, log

VARIANTS = ("exl2-mixed", "exl2-4.0", "fp16", "gptq-4")


TARGETS = {1: 500, 8: 2500, 32: 5000, 64: 7000}  # tok/s, issue 27 (H100)


PREFILL_TARGET = 37000


def model_dir(args: argparse.Namespace, variant: str) -> str:
    from benchmarks.make_models import write_model

    path = os.path.join(args.models_dir, f"llama3-8b-{variant}")
    t0 = time.time()
    kw = {"exl2-mixed": {"exl2_mix": "converter"}, "exl2-4.0": {"exl2_bits": 4}, "fp16": {},
          "gptq-4": {"gptq": True}}[variant]
    write_model(path, "llama3-8b", **kw)
    if time.time() - t0 > 1:
        log(f"  wrote {path} in {time.time() - t0:.0f} s")
    return path


def _e2e_variant(args: argparse.Namespace, res: dict, variant: str) -> None:
    from exlpy.cli.bench import load_model, time_decode, time_prefill
    from exlpy.runtime import options, use_options

    log(f"e2e {variant}")
    path = guarded("write model", model_dir, args, variant)
    if path is None:
        return
    seq = max(args.prompt_len + args.gen_len + 16, args.prefill)
    # loaded under EXLPY_QMM_KERNEL=tc when any run wants it: the groups then make exl2_tc's plans too (the option
    # in force at each decode picks the kernel)
    kern = "tc" if "tc" in (args.qmm_kernels or []) else options().qmm_kernel
    with use_options(replace(options(), qmm_kernel=kern)):
        model = guarded("load", load_model, path, seq, max(args.batches))
    if model is None:
        return
    out = res.setdefault("e2e", {}).setdefault(variant, {})
    out["weights_gb"] = sum(m.weight_bytes() for m in model.modules[1:]) / 1e9
    for kern in args.qmm_kernels or [None]:
        opts = options() if kern is None else replace(options(), qmm_kernel=kern)
        tag = "" if kern is None else f" [{kern}]"
        slot = out if kern is None else out.setdefault(kern, {})
        with use_options(opts):
            for b in args.batches:
                r = guarded(f"decode batch {b}{tag}", time_decode, model, b, args.prompt_len, args.gen_len)
                if r is not None:
                    slot[f"b{b}"] = r.tokens_per_s
                    log(f"  batch {b:3d}{tag}: {r.tokens_per_s:9.1f} tok/s  ({1e3 * r.seconds / r.gen_len:.2f} "
                        f"ms/step, {r.bandwidth() / 1e12:.2f} TB/s)")
    if args.prefill:
        t = guarded("prefill", time_prefill, model, args.prefill)
        if t is not None:
            out["prefill"] = t
            log(f"  prefill {args.prefill}: {t:,.0f} tok/s")
    guarded("unload", model.unload)


def e2e(args: argparse.Namespace, res: dict) -> None:
    for variant in [v for v in args.variants if v in VARIANTS]:
        _e2e_variant(args, res, variant)
        gc.collect()
        torch.cuda.empty_cache()
