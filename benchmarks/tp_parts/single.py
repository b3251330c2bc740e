"""The tensor-parallel benchmark's one-GPU run: the reference logits, decode (read back and device-fed, b1 and
batched) and prefill 2048 times, and with diagnostics on, prefill per module kind and its top kernels."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from benchmarks.tp_diag import single_phases, top_kernels
from benchmarks.tp_parts.timing import decode_fed_ms, decode_ms, prefill_ms, profile_steps
from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config


def single_run(args: argparse.Namespace, res: dict, cfg: ExLlamaV2Config, prompt: torch.Tensor,
               long_ids: torch.Tensor, save: Callable[[], None]) -> torch.Tensor:
    """Fills res's single_* figures; returns the one-GPU logits of the prompt's first 64 tokens (fp32), the
    reference of the TP runs. The model is unloaded on return."""
    res["phase"] = "single"
    single = ExLlamaV2(cfg)
    single.load([200])
    ref = single.forward(prompt[:, :64]).float()
    cache = ExLlamaV2Cache(single, max_seq_len=4096)
    res["single_decode_ms"] = round(decode_ms(single, cache, prompt, args.steps, 1), 3)
    res["single_prefill2048_ms"] = round(prefill_ms(single, cache, long_ids, 1), 2)
    res["single_decode_fed_ms"] = round(decode_fed_ms(single, cache, prompt, args.steps, 1), 3)
    if args.profile:
        res["single_b1_kernels"] = profile_steps(single, cache, prompt, 1)
    if args.batch:
        cb = ExLlamaV2Cache(single, batch_size=args.batch, max_seq_len=512)
        res[f"single_decode_b{args.batch}_ms"] = round(decode_ms(single, cb, prompt.repeat(args.batch, 1),
                                                                 args.steps // 2, 1), 3)
        res[f"single_decode_fed_b{args.batch}_ms"] = round(decode_fed_ms(single, cb, prompt.repeat(args.batch, 1),
                                                                         args.steps // 2, 1), 3)
        if args.profile:
            res[f"single_b{args.batch}_kernels"] = profile_steps(single, cb, prompt.repeat(args.batch, 1), 1)
        del cb
    if not args.no_diag:
        res["single_prefill_phases"] = single_phases(single, cache, long_ids)
        res["single_prefill_top_kernels"] = top_kernels(
            lambda c=cache: single.forward(long_ids, c, last_id_only=True), 1)
        cache.current_seq_len = 0
    print(json.dumps(res), flush=True)
    save()
    del cache
    single.unload()
    torch.cuda.empty_cache()
    return ref
