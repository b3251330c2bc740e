"""`load_tp`: build the TPContext, shard every module over its slots, and run the tensor-parallel forward.

The model's forward stays the entry point: `ExLlamaV2._run` hands over to `tp_run` while `model.tp_context` is
set (`model.unload()` clears it), so `model.forward` / `forward_batch` chunking, cache checks and
positions are shared with the single-device path; only the module loop differs.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

import torch

from exlpy.errors import TensorParallelError
from exlpy.model.batch import ForwardBatch
from exlpy.model.layers import MLP, Attention, Embedding, Head, RMSNorm
from exlpy.model.linear import linear_format
from exlpy.parallel.tp_context import TPContext
from exlpy.parallel.tp_graph import TPGraphs, graphs_wanted
from exlpy.parallel.tp_layers import TPMLP, SlotState, Stage, TPAttention, TPHead
from exlpy.parallel.tp_timing import StageTimer

if TYPE_CHECKING:
    from exlpy.model.model import ExLlamaV2


def check_supported(model: ExLlamaV2) -> None:
    """Raise TensorParallelError naming the first feature this model has that TP does not support."""
    s = model.config.spec
    assert s is not None and model.config.index is not None
    if not s.arch.supports_tp:
        raise TensorParallelError(f"Tensor-parallel is not supported for {s.architecture}")
    if s.intermediate_size % 128:
        raise TensorParallelError(
            f"Model intermediate size must be divisible by 128 (intermediate_size = {s.intermediate_size})"
        )
    if s.num_attention_heads % s.num_key_value_heads:
        raise TensorParallelError(
            "Tensor-parallel needs num_attention_heads to be a multiple of "
            f"num_key_value_heads ({s.num_attention_heads} / {s.num_key_value_heads})"
        )
    formats = {
        linear_format(model.config.index, f"{m.key}.{p}")
        for m in model.modules
        if isinstance(m, (Attention, MLP))
        for p in (
            ("q_proj", "k_proj", "v_proj", "o_proj")
            if isinstance(m, Attention)
            else ("gate_proj", "up_proj", "down_proj")
        )
    }
    if "gptq" in formats:
        raise TensorParallelError(
            "Tensor split not implemented for GPTQ matrices: load this model with load() or load_autosplit()"
        )
    if "exl2" in formats and s.head_dim % 32:
        raise TensorParallelError(
            f"Tensor-parallel EXL2 needs head_dim divisible by 32 (EXL2 columns split in "
            f"units of 32), head_dim = {s.head_dim}"
        )


def load_tp_gen(
    model: ExLlamaV2,
    gpu_split: list[float] | None,
    callback: Callable[[int, int], None] | None,
    callback_gen: Callable[[int, int], Any] | None,
    progress: bool,
    expect_cache_tokens: int = 0,
    expect_cache_base: type | None = None,
    devices: list[torch.device | str] | None = None,
) -> Generator[Any, None, None]:
    """Load every module sharded over the TP slots (`devices`: explicit slot devices, for tests)."""
    check_supported(model)
    ctx = TPContext(model, gpu_split, expect_cache_tokens, expect_cache_base, devices=devices)
    model.tp_context = ctx
    # The single-device CUDA-graph machinery stays out; the TP runner captures its own graphs. The user's
    # setting comes back when the TP model is unloaded (or fails to load).
    ctx.saved_no_graphs = model.config.no_graphs
    model.config.no_graphs = True
    ctx.finalize()
    staging = ctx.all_devs[ctx.device]
    mods = model.modules
    n = len(mods)
    tp_modules: list[Any] = []
    bar = _progress(n) if progress else None
    try:
        for i, m in enumerate(mods):
            if callback is not None:
                callback(i, n)
            if callback_gen is not None:
                yield from callback_gen(i, n)
            if bar is not None:
                bar(i)
            if isinstance(m, Embedding):
                # exllamav2 keeps the table in host RAM; a CPU lookup plus fp32->fp16 and pageable copies cost
                # ~60 ms of a 2048-token prefill (benchmarks/results/tp.md), so it goes on the first slot unless
                # EXLPY_TP_EMBED_CPU=1 asks to save that VRAM.
                on_cpu = staging.type == "cuda" and os.environ.get("EXLPY_TP_EMBED_CPU", "") not in ("", "0")
                m.load(torch.device("cpu") if on_cpu else staging)
            elif isinstance(m, (Attention, MLP)):
                m.load(staging)
                tp_modules.append(TPAttention(ctx, m) if isinstance(m, Attention) else TPMLP(ctx, m))
                m.unload()
            elif isinstance(m, Head):
                norm = mods[i - 1]
                assert isinstance(norm, RMSNorm)
                norm.load(staging)
                m.load(staging)
                tp_modules.append(TPHead(ctx, norm, m))
                norm.unload()
                m.unload()
    except BaseException:
        ctx.unload()
        for m in mods:
            m.unload()
        model.tp_context = None
        model.config.no_graphs = ctx.saved_no_graphs
        raise
    ctx.modules = tp_modules
    if graphs_wanted(ctx):
        ctx.graphs = TPGraphs(ctx)
    model.loaded = True
    if callback is not None:
        callback(n, n)
    if callback_gen is not None:
        yield from callback_gen(n, n)
    if bar is not None:
        bar(n)


def load_tp(
    model: ExLlamaV2,
    gpu_split: list[float] | None = None,
    devices: list[torch.device | str] | None = None,
    expect_cache_tokens: int = 0,
    expect_cache_base: type | None = None,
) -> None:
    """`model.load_tp` with explicit slot devices (several may be the same CPU device: tests)."""
    if model.loaded:
        from exlpy.errors import ModelStateError

        raise ModelStateError("model is already loaded; call model.unload() before loading again")
    for _ in load_tp_gen(model, gpu_split, None, None, False, expect_cache_tokens, expect_cache_base, devices):
        pass


def _progress(n: int) -> Callable[[int], None]:
    def show(i: int) -> None:
        print(f"\rLoading (TP): {i}/{n} modules", end="\n" if i >= n else "", flush=True)

    return show


def _stage_list(ctx: TPContext) -> tuple[list[Stage], int]:
    """All stages in order, and how many of them a preprocess-only pass runs (through the last attention)."""
    stages: list[Stage] = []
    cut = 0
    for m in ctx.modules:
        stages += m.stages()
        if isinstance(m, TPAttention):
            cut = len(stages)
    return stages, cut


def make_states(ctx: TPContext, x: torch.Tensor, batch: ForwardBatch, last_only: bool) -> list[SlotState]:
    from exlpy.cache.tp import ExLlamaV2Cache_TP

    cache = batch.cache
    if cache is not None and not isinstance(cache, ExLlamaV2Cache_TP):
        raise TensorParallelError(
            f"a model loaded with load_tp() needs an ExLlamaV2Cache_TP, got {type(cache).__name__}"
        )
    states = []
    for i, slot in enumerate(ctx.all_devices()):
        dev = ctx.all_devs[slot]
        dt = ctx.model.config.compute_dtype(dev)
        # Each slot owns its residual (updated in place); the embedding output is this pass's own tensor, so
        # the first slot on its device takes it as it is (one [rows, hidden] copy fewer).
        own = i == 0 and x.device == dev and x.dtype == dt and x.is_contiguous()
        xs = x if own else x.to(device=dev, dtype=dt, copy=True)
        states.append(
            SlotState(
                slot, dev, xs, batch.on(dev), None if cache is None else cache.slot_cache(slot), last_only=last_only
            )
        )
    return states


def run_stages(ctx: TPContext, stages: list[Stage], states: list[SlotState], timer: StageTimer | None = None
               ) -> list[torch.Tensor]:
    """Run stages eagerly on every slot; returns the last stage's per-slot outputs.

    Every slot's kernels of a stage are issued before the collective and nothing here waits on a device, so
    the slots compute concurrently: the host is only ever ahead of the GPUs.
    """
    outs: list[torch.Tensor] = []
    for i, stage in enumerate(stages):
        t0 = time.perf_counter()
        outs = []
        for k, st in enumerate(states):
            # Triton launches on the *current* device whatever the tensors' device: make it the slot's.
            with torch.cuda.device(st.device) if st.device.type == "cuda" else contextlib.nullcontext():
                if timer is not None:
                    timer.mark(i, k, 0, st.device)
                st.enter()
                outs.append(stage.fn(st))
                if timer is not None:
                    timer.mark(i, k, 1, st.device)
        if stage.then == "out":
            if timer is not None:
                timer.host(i, time.perf_counter() - t0)
            break
        ctx.all_reduce(outs)
        for st, r in zip(states, outs):
            st.red, st.pending = r, stage.then
        if timer is not None:
            for k, st in enumerate(states):
                timer.mark(i, k, 2, st.device)
            timer.host(i, time.perf_counter() - t0)
    return outs


def stage_labels(ctx: TPContext) -> list[str]:
    """"attn" / "mlp" / "head" per stage of `_stage_list` (timing reports)."""
    names = {TPAttention: "attn", TPMLP: "mlp", TPHead: "head"}
    return [names[type(m)] for m in ctx.modules for _ in m.stages()]


def gather_logits(ctx: TPContext, outs: list[torch.Tensor]) -> torch.Tensor:
    """The vocabulary slices (slot order = vocabulary order) joined as float32 on the first slot's device: one
    copy-with-cast per slot into a fresh tensor (the caller may keep it past the next step)."""
    dev = ctx.all_devs[ctx.device]
    parts = [o for o in outs if o.shape[-1] > 0]
    out = torch.empty(*parts[0].shape[:-1], sum(o.shape[-1] for o in parts), dtype=torch.float32, device=dev)
    a = 0
    for o in parts:
        out[..., a:a + o.shape[-1]].copy_(o)
        a += o.shape[-1]
    return out


def tp_run(
    model: ExLlamaV2,
    ids: torch.Tensor,
    batch: ForwardBatch,
    preprocess_only: bool,
    last_id_only: bool,
    return_last_state: bool,
    cpu_logits: bool,
) -> Any:
    """The tensor-parallel replacement of `ExLlamaV2._run` (same arguments, same results)."""
    ctx: TPContext = model.tp_context
    timer: StageTimer | None = ctx.timer
    first = ctx.all_devs[ctx.device]
    emb = model.modules[0]
    assert emb.device is not None
    if timer is not None:
        timer.reset()
        timer.labels = stage_labels(ctx)
        timer.phase("start", first)
    x = emb.forward(ids.to(emb.device), batch)
    if timer is not None:
        timer.phase("embedded", first)
    graphs = getattr(ctx, "graphs", None)
    if graphs is not None and not preprocess_only and not return_last_state:
        logits = graphs.try_run(x, batch)
        if logits is not None:
            if timer is not None:
                timer.phase("logits", first)
            return logits.cpu() if cpu_logits else logits
    stages, cut = _stage_list(ctx)
    states = make_states(ctx, x, batch, last_id_only)
    if timer is not None:
        timer.phase("states", first)
    if preprocess_only:
        run_stages(ctx, stages[:cut], states, timer)
        return None
    outs = run_stages(ctx, stages, states, timer)
    if timer is not None:
        timer.phase("stages", first)
    logits = gather_logits(ctx, outs)
    if timer is not None:
        timer.phase("logits", first)
    if cpu_logits:
        logits = logits.cpu()
    if return_last_state:
        return logits, states[0].last_state
    return logits
