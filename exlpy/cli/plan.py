"""`exlpy plan`: where each layer of a model would go and what fits, from safetensors headers alone.

No tensor data is read and no GPU is needed: `--devices 24000,24000` simulates the free MiB of a machine the
user does not have. Prints the placement (layers per device; bytes of weights / cache / scratch / context per
device) and the largest context, and batch, that fit.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from exlpy.errors import DeviceError, GpuSplitError, InsufficientVRAMError
from exlpy.parallel.costs import (
    CACHE_TYPES,
    CUDA_CONTEXT_BYTES,
    MiB,
    ModelShape,
    RunShape,
    kv_bytes_per_token,
    module_costs,
)
from exlpy.parallel.plan import DeviceBudget, Plan, fit_batch, fit_context, make_plan


def add_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="plan how a model splits over GPUs and the largest context that fits")
    p.add_argument("--model", "-m", required=True, help="model directory (config.json + *.safetensors)")
    p.add_argument(
        "--gpu-split", help="explicit budgets in GB per device, e.g. 20,24 (as model.load(gpu_split))"
    )
    p.add_argument(
        "--reserve",
        type=float,
        help="MiB to keep free on every device (default 192 on the first, 64 on the others)",
    )
    length = p.add_mutually_exclusive_group()
    length.add_argument("--max-seq-len", type=int, help="cache length to plan for (default: the model's)")
    length.add_argument("--fit-context", action="store_true", help="plan at the largest context that fits")
    p.add_argument("--batch", type=int, default=1, help="cache batch size (default 1)")
    p.add_argument("--max-input-len", type=int, default=2048, help="forward chunk length (default 2048)")
    p.add_argument("--cache-type", choices=sorted(CACHE_TYPES), default="fp16", help="KV cache type")
    p.add_argument("--devices", help="simulated free MiB per device, e.g. 24000,24000 (no GPU needed)")
    p.add_argument(
        "--policy",
        choices=("balanced", "greedy"),
        default=None,
        help="balanced (autosplit default) or greedy (gpu_split default)",
    )
    p.set_defaults(_run=run)


def _floats(text: str, what: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise GpuSplitError(f"{what} must be comma-separated numbers, got {text!r}") from None
    if not vals or any(v < 0 or v != v for v in vals):
        raise GpuSplitError(f"{what} needs non-negative numbers, got {text!r}")
    return vals


def _budgets(args: argparse.Namespace) -> tuple[list[DeviceBudget], str]:
    """Device budgets and a one-line description of where they came from."""
    from exlpy.engine.placement import parse_gpu_split, parse_reserve

    if args.devices:
        free = [int(v * MiB) for v in _floats(args.devices, "--devices")]
        overheads = [CUDA_CONTEXT_BYTES] * len(free)
        source = "simulated"
    elif args.gpu_split is None:
        from exlpy.parallel.memory import has_context, query_devices

        try:
            mem = query_devices()
        except DeviceError as e:  # no GPU here: say how to plan for one anyway
            raise DeviceError(f"{e}. To plan for a machine with GPUs from this one, give their free memory: "
                              "--devices 24000,24000 (MiB per GPU), or budgets with --gpu-split") from None
        free = [m.free for m in mem]
        overheads = [0 if has_context(m.ordinal) else CUDA_CONTEXT_BYTES for m in mem]
        source = f"queried ({mem[0].source})"
    else:
        free, overheads, source = [], [], ""
    if args.gpu_split is not None:
        split = _floats(args.gpu_split, "--gpu-split")
        budgets = parse_gpu_split(split, len(free) if free else len(split))
        return [DeviceBudget(b) for b in budgets], "gpu_split budgets (weights + cache + scratch)"
    reserve = parse_reserve(None if args.reserve is None else int(args.reserve * MiB), len(free))
    for i, (f, r) in enumerate(zip(free, reserve)):
        if r > f:
            raise GpuSplitError(f"--reserve {r / MiB:.0f} MiB is larger than device {i}'s {f / MiB:.0f} MiB")
    return [DeviceBudget(f, r, o) for f, r, o in zip(free, reserve, overheads)], f"{source} free memory"


def run(args: argparse.Namespace) -> int:
    from exlpy.config.config import ExLlamaV2Config
    from exlpy.engine import ExLlamaV2

    config = ExLlamaV2Config(args.model)  # reads config.json and safetensors headers only
    model = ExLlamaV2(config)
    shape = ModelShape.from_spec(config.spec)
    costs = module_costs(model.modules, 2)  # fp16 on GPUs
    cache = CACHE_TYPES[args.cache_type]
    budgets, source = _budgets(args)
    policy = args.policy or ("greedy" if args.gpu_split is not None else "balanced")
    seq = args.max_seq_len or config.max_seq_len
    run_ = RunShape(seq, args.batch, args.max_input_len)
    best_ctx = fit_context(costs, shape, run_, cache, budgets, policy, limit=max(seq, config.max_seq_len))
    if args.fit_context:
        if best_ctx is None:
            raise InsufficientVRAMError(
                f"Insufficient VRAM for model and cache: not even 256 tokens of "
                f"{cache.name} cache at batch {args.batch} fit next to the weights"
            )
        run_ = run_.with_(max_seq_len=best_ctx)
    console = Console(file=sys.stdout, width=None if sys.stdout.isatty() else 150)
    w = sum(c.weight_bytes for c in costs)
    console.print(
        f"[bold]{args.model}[/]: {config.architecture}, {shape.num_layers} layers, hidden "
        f"{shape.hidden_size}; weights {w / MiB:,.0f} MiB as loaded (fp16 compute)"
    )
    console.print(
        f"Devices: {len(budgets)} ({source}); policy {policy}; {cache.name} cache "
        f"{kv_bytes_per_token(shape, cache) / 1024:,.1f} KiB/token; context overhead "
        f"{CUDA_CONTEXT_BYTES / MiB:.0f} MiB per device"
    )
    plan = make_plan(costs, shape, run_, cache, budgets, policy)  # raises with the numbers when it cannot fit
    console.print(plan_table(plan))
    limit = max(seq, config.max_seq_len)
    ctx_text = f"{best_ctx:,} tokens" if best_ctx is not None else "none (not even 256 tokens)"
    if best_ctx is not None and best_ctx + 256 > limit:
        ctx_text += " (the search limit: the model's max_seq_len)"
    console.print(f"Largest context that fits at batch {args.batch}: {ctx_text}")
    best_b = fit_batch(costs, shape, run_, cache, budgets, policy)
    console.print(f"Largest batch at max_seq_len {run_.max_seq_len:,}: {best_b if best_b else 'none'}")
    return 0


def _mib(n: int) -> str:
    return f"{n / MiB:,.1f} MiB" if abs(n) < 10 * MiB else f"{n / MiB:,.0f} MiB"


def _ranges(ids: list[int]) -> str:
    if not ids:
        return "-"
    return f"{ids[0]}" if ids[0] == ids[-1] else f"{ids[0]}-{ids[-1]}"


def plan_table(plan: Plan) -> Table:
    """The plan as a rich table: one row per device."""
    t = Table(
        title=f"Placement at max_seq_len {plan.run.max_seq_len:,}, batch {plan.run.batch_size} "
        f"({plan.cache.name} cache)"
    )
    for col in (
        "device",
        "layers",
        "also",
        "free",
        "reserve",
        "context",
        "weights",
        "cache",
        "scratch",
        "total",
        "headroom",
    ):
        t.add_column(col, justify="left" if col in ("device", "layers", "also") else "right")
    for u in plan.usage:
        extra = [
            m.kind
            for m, d in zip(plan.modules, plan.devices)
            if d == u.index and m.layer_idx is None and m.kind not in ("mlp",)
        ]
        cells = [u.free, u.reserve, u.overhead, u.weights, u.cache, u.scratch, u.total, u.headroom]
        t.add_row(
            f"{u.index}", _ranges(plan.layers_on(u.index)), ", ".join(extra) or "-", *[_mib(c) for c in cells]
        )
    return t
