"""Loading the module list onto devices: explicit budgets (`load(gpu_split)`) or automatic (`load_autosplit`).

Both first make a plan by arithmetic (exlpy/parallel/plan.py) from safetensors headers and the free memory of
each device, then load module by module following it. The plan can be wrong (other processes allocate, the
allocator fragments), so loading also survives a real out-of-memory: the module and its cache layer are freed,
the allocator cache is emptied, and the module is retried on the next device. Modules only ever move forward
through the device list, like exllamav2's autosplit. Unlike exllamav2 the embedding stays on the first GPU,
so a decode step runs on GPUs only (and can be captured in a CUDA graph); the plan counts it.
"""

from __future__ import annotations

import gc
import math
import warnings
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from exlpy.env import is_oom, limit_cpu_threads_for_gpu
from exlpy.errors import GpuSplitError, InsufficientVRAMError, ModelStateError
from exlpy.parallel.costs import (
    CUDA_CONTEXT_BYTES,
    CacheSpec,
    GiB,
    MiB,
    ModelShape,
    RunShape,
    cache_spec_of,
    fmt_mib,
    module_costs,
)
from exlpy.parallel.memory import DeviceMemory, has_context, query_devices
from exlpy.parallel.p2p import peer_copy_ok
from exlpy.parallel.plan import DeviceBudget, Plan, make_plan

if TYPE_CHECKING:
    from exlpy.cache.base import ExLlamaV2CacheBase
    from exlpy.engine.facade import ExLlamaV2

Callback = Callable[[int, int], None] | None
CallbackGen = Callable[[int, int], Any] | None

DEFAULT_RESERVE_FIRST = 192 * MiB  # spec §6.3: the first device also hosts the embedding and logits copies
DEFAULT_RESERVE_OTHER = 64 * MiB


def default_device() -> torch.device:
    return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")


def cuda_devices() -> list[torch.device]:
    return [torch.device("cuda", i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or math.isinf(value):
        raise GpuSplitError(f"{what} must be a finite number, got {value!r}")
    if value < 0:
        raise GpuSplitError(f"{what} must not be negative, got {value!r}")
    return float(value)


def parse_gpu_split(gpu_split: Sequence[Any], num_devices: int) -> list[int]:
    """GB per device (exllamav2: 1 GB = 1024³ bytes) → bytes; validated against the visible device count."""
    if isinstance(gpu_split, (str, bytes)) or not isinstance(gpu_split, Sequence):
        raise GpuSplitError(f"gpu_split must be a list of GB per device, got {gpu_split!r}")
    if len(gpu_split) > num_devices:
        raise GpuSplitError(
            f"Too many entries in gpu_split: {len(gpu_split)} entries for {num_devices} visible "
            "CUDA device(s); give at most one budget (GB) per device"
        )
    return [int(_number(v, f"gpu_split[{i}]") * GiB) for i, v in enumerate(gpu_split)]


def parse_reserve(reserve_vram: Any, num_devices: int) -> list[int]:
    """reserve_vram → bytes per device: None → [192 MiB] + [64 MiB]·(n−1); a number → that for every
    device."""
    if reserve_vram is None:
        return [DEFAULT_RESERVE_FIRST] + [DEFAULT_RESERVE_OTHER] * (num_devices - 1)
    if isinstance(reserve_vram, (int, float)) and not isinstance(reserve_vram, bool):
        return [int(_number(reserve_vram, "reserve_vram"))] * num_devices
    if isinstance(reserve_vram, (str, bytes)) or not isinstance(reserve_vram, Sequence):
        raise GpuSplitError(f"reserve_vram must be bytes (int) or a list of bytes per device, got {reserve_vram!r}")
    if len(reserve_vram) > num_devices:
        raise GpuSplitError(
            f"Too many entries in reserve_vram: {len(reserve_vram)} entries for {num_devices} visible CUDA device(s)"
        )
    out = [int(_number(v, f"reserve_vram[{i}]")) for i, v in enumerate(reserve_vram)]
    return out + parse_reserve(None, num_devices)[len(out) :]


def _layer_cache_bytes(model: ExLlamaV2, caches: Sequence[ExLlamaV2CacheBase], device: torch.device) -> int:
    """Bytes per attention layer that place_module will allocate for these caches (fixed-device ones
    aside)."""
    width = model.config.compute_dtype(device).itemsize
    total = 0.0
    for c in caches:
        if c.fixed_device is None:
            spec = cache_spec_of(c, width)
            total += c.batch_size * c.max_seq_len * c.num_key_value_heads * c.head_dim * (spec.bytes_k + spec.bytes_v)
    return math.ceil(total)


def _width(model: ExLlamaV2, device: torch.device) -> int:
    return model.config.compute_dtype(device).itemsize


def _attached(model: ExLlamaV2) -> list[ExLlamaV2CacheBase]:
    return model.layer_devices.subscribers()


def _budgets(memory: Sequence[DeviceMemory], reserve: list[int], overheads: Sequence[int] | None) -> list[DeviceBudget]:
    out = []
    for i, mem in enumerate(memory):
        if reserve[i] > mem.total:
            raise GpuSplitError(
                f"reserve_vram[{i}] = {fmt_mib(reserve[i])} is larger than device {i}'s total "
                f"memory {fmt_mib(mem.total)}"
            )
        ov = overheads[i] if overheads is not None else (0 if has_context(mem.ordinal) else CUDA_CONTEXT_BYTES)
        out.append(DeviceBudget(mem.free, reserve[i], ov))
    return out


def plan_for_model(
    model: ExLlamaV2,
    budgets: Sequence[DeviceBudget],
    device: torch.device,
    *,
    max_seq_len: int,
    batch_size: int,
    cache: CacheSpec,
    layer_cache: int | None,
    last_id_only: bool = False,
    policy: str = "balanced",
) -> Plan:
    """A plan for a real model: weights from safetensors headers, activations in `device`'s compute dtype."""
    width = model.config.compute_dtype(device).itemsize
    run = RunShape.from_config(model.config, max_seq_len, batch_size, last_id_only, width)
    shape = ModelShape.from_spec(model.config.spec)
    return make_plan(module_costs(model.modules, width), shape, run, cache, budgets, policy, layer_cache=layer_cache)


def _report(i: int, n: int, callback: Callback, callback_gen: CallbackGen, bar: Any) -> Generator[Any, None, None]:
    if bar is not None:
        bar[0].update(bar[1], completed=i)
    if callback is not None:
        callback(i, n)
    if callback_gen is not None:
        yield from callback_gen(i, n)


def load_on_devices(
    model: ExLlamaV2,
    planned: Sequence[int],
    devices: Sequence[torch.device],
    callback: Callback,
    callback_gen: CallbackGen,
    progress: bool,
    plan: Plan | None = None,
) -> Generator[Any, None, None]:
    """Place module i on devices[planned[i]] (or a later device after an out-of-memory), in order."""
    n = len(model.modules)
    bar = None
    if progress:
        from rich.progress import Progress

        p = Progress(transient=True)
        p.start()
        bar = (p, p.add_task("Loading model", total=n))
    attempted = 0
    try:
        cur = 0
        for i in range(n):
            attempted = i + 1
            yield from _report(i, n, callback, callback_gen, bar)
            d = max(planned[i], cur)
            while True:
                failure = _try_place(model, i, devices[d])
                if failure is None:
                    break
                # Free outside the except block: the exception's frames hold the half-built tensors.
                model.unplace_module(i)
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                d += 1
                if d >= len(devices):
                    raise InsufficientVRAMError(_oom_message(model, i, devices, plan, failure))
            cur = d
        yield from _report(n, n, callback, callback_gen, bar)
    except BaseException:
        for i in range(attempted):  # leave nothing half-loaded behind
            model.unplace_module(i)
        raise
    finally:
        if bar is not None:
            bar[0].stop()
    model.finish_load(plan)
    used = model.devices()
    if any(d.type == "cuda" for d in used):
        limit_cpu_threads_for_gpu()
        for a, b in zip(used, used[1:]):
            peer_copy_ok(a, b)  # test each hop now, not inside the first (possibly graph-captured) forward


def _try_place(model: ExLlamaV2, i: int, device: torch.device) -> str | None:
    """Place module i; on out-of-memory return the error text instead of raising."""
    try:
        model.place_module(i, device)
    except Exception as e:
        if not is_oom(e):
            raise
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    return None


def _oom_message(model: ExLlamaV2, i: int, devices: Sequence[torch.device], plan: Plan | None, err: str) -> str:
    m = model.modules[i]
    msg = f"Insufficient VRAM for model and cache: {m.key} did not fit on any of {len(devices)} device(s)"
    if plan is not None:
        per = ", ".join(
            f"dev {u.index}: planned {fmt_mib(u.total)} of {fmt_mib(u.free)} free, reserve {fmt_mib(u.reserve)}"
            for u in plan.usage
        )
        msg += f" ({per})"
    return msg + f"; last error: {err}. Reduce max_seq_len, use a quantized cache (q4/q6/q8), or add GPUs"


def _cpu_fallback(
    model: ExLlamaV2, callback: Callback, callback_gen: CallbackGen, progress: bool
) -> Generator[Any, None, None]:
    from exlpy.env import warn_if_cpu_only_torch
    from exlpy.errors import NoGpuWarning
    from exlpy.runtime import options

    warn_if_cpu_only_torch()  # the likelier cause on a machine with a GPU: a torch built without CUDA
    if options().cpu_warning:  # EXLPY_NO_CPU_WARNING=1: a CPU deployment that knows
        warnings.warn("exlpy: no CUDA device is visible; loading the whole model on the CPU (slow)", NoGpuWarning,
                      stacklevel=5)
    yield from load_on_devices(model, [0] * len(model.modules), [torch.device("cpu")], callback, callback_gen, progress)


# --- load(gpu_split)
# -----------------------------------------------------------------------------------------


def load_split_gen(
    model: ExLlamaV2,
    gpu_split: list[float] | None,
    callback: Callback,
    callback_gen: CallbackGen,
    progress: bool,
    lazy: bool = False,
) -> Generator[Any, None, None]:
    """`model.load`: explicit GB budgets per device (greedy, in order); None puts everything on GPU 0.

    lazy=True only assigns the devices, as exllamav2's does: layer streaming (engine/streaming.py).
    """
    yield from split_gen_on(model, gpu_split, callback, callback_gen, progress, cuda_devices(), lazy)


def split_gen_on(
    model: ExLlamaV2,
    gpu_split: Sequence[Any] | None,
    callback: Callback,
    callback_gen: CallbackGen,
    progress: bool,
    devices: Sequence[torch.device],
    lazy: bool = False,
) -> Generator[Any, None, None]:
    # exllamav2 loads with `gpu_split or [99999]`: an empty list means everything on the first GPU, as None does
    # (TabbyAPI passes its empty default on one GPU).
    budgets = parse_gpu_split(gpu_split, len(devices)) if gpu_split else None
    if lazy and (not devices or budgets is None):  # streaming: everything on GPU 0 (or the CPU)
        _assign(model, [devices[0] if devices else torch.device("cpu")] * len(model.modules))
        return
    if not devices:
        yield from _cpu_fallback(model, callback, callback_gen, progress)
        return
    if budgets is None:
        yield from load_on_devices(model, [0] * len(model.modules), devices[:1], callback, callback_gen, progress)
        return
    caches = _attached(model)
    cfg = model.config
    plan = plan_for_model(
        model,
        [DeviceBudget(b) for b in budgets],
        devices[0],
        max_seq_len=max([c.max_seq_len for c in caches], default=cfg.max_seq_len),
        batch_size=max([c.batch_size for c in caches], default=cfg.max_batch_size),
        cache=cache_spec_of(caches[0], _width(model, devices[0])) if caches else CacheSpec("none", 0.0, 0.0),
        layer_cache=_layer_cache_bytes(model, caches, devices[0]),
        policy="greedy",
    )
    if lazy:  # streaming: the plan's devices, nothing loaded (exllamav2's set_device_map)
        _assign(model, [devices[d] for d in plan.devices])
        model.placement_plan = plan
        return
    yield from load_on_devices(model, plan.devices, devices[: len(budgets)], callback, callback_gen, progress, plan)


def _assign(model: ExLlamaV2, devices: Sequence[torch.device]) -> None:
    from exlpy.engine.streaming import assign_devices

    assign_devices(model, devices)
    model.finish_load(None)


# --- load_autosplit
# ------------------------------------------------------------------------------------------


def load_autosplit_gen(
    model: ExLlamaV2,
    cache: ExLlamaV2CacheBase,
    reserve_vram: Any,
    last_id_only: bool,
    callback: Callback,
    callback_gen: CallbackGen,
    progress: bool,
) -> Generator[Any, None, None]:
    """`model.load_autosplit`: plan over every visible GPU by free memory (balanced policy), then load."""
    devices = cuda_devices()
    _check_cache(model, cache)
    if not devices:
        yield from _cpu_fallback(model, callback, callback_gen, progress)
        return
    memory = query_devices()[: len(devices)]
    yield from autosplit_gen_on(
        model,
        cache,
        reserve_vram,
        last_id_only,
        callback,
        callback_gen,
        progress,
        devices[: len(memory)],
        memory,
    )


def _check_cache(model: ExLlamaV2, cache: ExLlamaV2CacheBase) -> None:
    if not getattr(cache, "lazy", False):
        raise ModelStateError(
            "load_autosplit needs a cache created with lazy=True (its layers are allocated on "
            "each layer's device while loading)"
        )
    if getattr(getattr(cache, "layout", None), "devices", None) is not model.layer_devices:
        raise ModelStateError("load_autosplit: the cache was created for a different model")


def autosplit_gen_on(
    model: ExLlamaV2,
    cache: ExLlamaV2CacheBase,
    reserve_vram: Any,
    last_id_only: bool,
    callback: Callback,
    callback_gen: CallbackGen,
    progress: bool,
    devices: Sequence[torch.device],
    memory: Sequence[DeviceMemory],
    overheads: Sequence[int] | None = None,
    policy: str = "balanced",
) -> Generator[Any, None, None]:
    """Autosplit over explicit devices and their memory (real GPUs, or simulated ones in tests)."""
    _check_cache(model, cache)
    budgets = _budgets(memory, parse_reserve(reserve_vram, len(memory)), overheads)
    plan = plan_for_model(
        model,
        budgets,
        devices[0],
        max_seq_len=cache.max_seq_len,
        batch_size=cache.batch_size,
        cache=cache_spec_of(cache, _width(model, devices[0])),
        layer_cache=_layer_cache_bytes(model, _attached(model), devices[0]),
        last_id_only=last_id_only,
        policy=policy,
    )
    yield from load_on_devices(model, plan.devices, devices, callback, callback_gen, progress, plan)
