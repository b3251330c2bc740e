"""Tensor parallelism: every layer split over the GPUs, one lock-step lane per GPU.

`load_tp` plans the split (TPContext, spec §7.2), loads each module once on a staging device, cuts it into
per-GPU copies (exlpy/model/sharding.py) and drops the full module. The strategy is one stage whose lanes
are the GPUs' own Transformers (the ordinary block code; their closing projections meet in all-reduces),
so eager forwards and CUDA-graph capture treat it like any other strategy. A decode step is captured as one
graph per GPU with the collectives inside when the backend can be captured (NCCL, the peer or host-memory
all-reduce).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from functools import partial
from typing import Any

import torch

from exlpy.engine.lockstep import LockstepGroup
from exlpy.engine.single import cuda_graphs_possible
from exlpy.engine.strategy import Lane, Stage, Strategy
from exlpy.errors import TensorParallelError
from exlpy.model.attention import Attention
from exlpy.model.embedding import Embedding
from exlpy.model.head import Head, RMSNorm
from exlpy.model.linear import linear_format
from exlpy.model.mlp import MLP
from exlpy.model.module import Module
from exlpy.model.parallel_linear import RowParallel
from exlpy.model.sharding import Share, row_split_possible, shard_attention, shard_embedding, shard_head, shard_mlp
from exlpy.model.transformer import Transformer
from exlpy.parallel.tp_comm import HostMemComm, NcclComm, PeerComm
from exlpy.parallel.tp_context import TPContext
from exlpy.parallel.tp_split import BROADCAST_ID, BROADCAST_KV, BROADCAST_Q, BROADCAST_RS, BROADCAST_VC
from exlpy.runtime import RuntimeOptions
from exlpy.weights.checks import module_checks


def check_supported(config: Any, modules: list[Module]) -> None:
    """Raise TensorParallelError naming the first feature this model has that TP does not support."""
    s = config.spec
    if s.moe is not None:  # exllamav2 has no TP split of MoE layers either (spec §1)
        raise TensorParallelError(f"Tensor-parallel is not implemented for mixture-of-experts models "
                                  f"({s.architecture}): load it on one GPU or split its layers (load_autosplit / "
                                  "gpu_split)")
    if not s.arch.supports_tp:
        raise TensorParallelError(f"Tensor-parallel is not supported for {s.architecture}")
    if s.intermediate_size % 128:
        raise TensorParallelError(
            f"Model intermediate size must be divisible by 128 (intermediate_size = {s.intermediate_size})")
    if s.num_attention_heads % s.num_key_value_heads:
        raise TensorParallelError("Tensor-parallel needs num_attention_heads to be a multiple of "
                                  f"num_key_value_heads ({s.num_attention_heads} / {s.num_key_value_heads})")
    names = {Attention: ("q_proj", "k_proj", "v_proj", "o_proj"), MLP: ("gate_proj", "up_proj", "down_proj")}
    formats = {linear_format(config.index, f"{m.key}.{p}") for m in modules for t, ps in names.items()
               if isinstance(m, t) for p in ps}
    if "gptq" in formats:
        raise TensorParallelError(
            "Tensor split not implemented for GPTQ matrices: load this model with load() or load_autosplit()")
    if "exl2" in formats and s.head_dim % 32:
        raise TensorParallelError(f"Tensor-parallel EXL2 needs head_dim divisible by 32 (EXL2 columns split in "
                                  f"units of 32), head_dim = {s.head_dim}")


def shares(ctx: TPContext, row_layout: Callable[[Module], bool]) -> dict[int, Callable[[Module], Share]]:
    """Per slot, the Share of a module (the layout of its closing projection depends on its format)."""
    first = ctx.all_devices()[0]
    out = {}
    for slot in ctx.all_devices():
        kv = ctx.slot_range(BROADCAST_KV, slot)
        q = ctx.slot_range(BROADCAST_Q, slot)
        if kv is None or q is None:
            raise TensorParallelError(f"device slot {slot} holds no KV head: every TP device needs one")

        def make(m: Module, slot: int = slot, kv: tuple[int, int] = kv, q: tuple[int, int] = q) -> Share:
            return Share(ctx.all_devs[slot], slot == first, q, kv, ctx.slot_range(BROADCAST_ID, slot),
                         ctx.slot_range(BROADCAST_RS, slot), ctx.slot_range(BROADCAST_VC, slot), row_layout(m))
        out[slot] = make
    return out


def load_tp_gen(model: Any, gpu_split: list[float] | None, callback: Callable[[int, int], None] | None,
                callback_gen: Callable[[int, int], Any] | None, progress: bool, expect_cache_tokens: int = 0,
                expect_cache_base: type | None = None, devices: list[torch.device | str] | None = None,
                options: RuntimeOptions | None = None) -> Generator[Any, None, tuple[TPContext, Strategy]]:
    """Shard every module over the TP slots (`devices`: explicit slot devices, for tests). Returns the
    context and the strategy; on failure nothing stays loaded."""
    opts = options or model.options
    check_supported(model.config, model.modules)
    ctx = TPContext(model, gpu_split, expect_cache_tokens, expect_cache_base, devices=devices,
                    comm_name=opts.tp_comm, prefill_comm_name=opts.tp_prefill_comm)
    slots = ctx.all_devices()
    ctx.finalize([model.rotary.get(ctx.all_devs[s], model.config.compute_dtype(ctx.all_devs[s])) for s in slots])
    group = LockstepGroup(ctx.comm, ctx.prefill_comm, opts.tp_overlap_chunks)
    staging = ctx.all_devs[ctx.device]

    def row_layout(m: Module) -> bool:
        closer = m.o_proj if isinstance(m, Attention) else getattr(m, "down_proj", None)
        return opts.tp_layout != "column" and row_split_possible(closer)

    share = shares(ctx, row_layout)
    per_slot: dict[int, list[Module]] = {s: [] for s in slots}
    mods = model.modules
    n = len(mods)
    try:
        for i, m in enumerate(mods):
            if callback is not None:
                callback(i, n)
            if callback_gen is not None:
                yield from callback_gen(i, n)
            if isinstance(m, RMSNorm):
                continue  # sharded together with the head
            with module_checks():
                m.load(staging)
                if isinstance(m, Head):
                    norm = mods[i - 1]
                    assert isinstance(norm, RMSNorm)
                    norm.load(staging)
            for s in slots:
                if isinstance(m, Embedding):
                    per_slot[s].append(shard_embedding(m, share[s](m), group))
                elif isinstance(m, Attention):
                    per_slot[s].append(shard_attention(m, share[s](m), group))
                elif isinstance(m, MLP):
                    per_slot[s].append(shard_mlp(m, share[s](m), group))
                else:
                    assert isinstance(m, Head)
                    per_slot[s] += list(shard_head(mods[i - 1], m, share[s](m), group))  # type: ignore[arg-type]
            m.unload()
            if isinstance(m, Head):
                mods[i - 1].unload()
    except BaseException:
        ctx.unload()
        for m in mods:
            m.unload()
        raise
    if callback is not None:
        callback(n, n)
    if callback_gen is not None:
        yield from callback_gen(n, n)
    if progress:
        print(f"Loading (TP): {n}/{n} modules", flush=True)
    if opts.tp_fuse_norm and group.fuses_norm():
        for mods_of_slot in per_slot.values():
            link_next_norms(mods_of_slot, model.config.spec)
    if ctx.prefill_comm is not None:  # its sums end in one pass with the next norm (exlpy/parallel/tp_copy.py)
        for mods_of_slot in per_slot.values():
            link_next_norms(mods_of_slot, model.config.spec, "prefill_norm")
    return ctx, tp_strategy(ctx, group, per_slot, opts)


def link_next_norms(mods: list[Module], spec: Any, attr: str = "next_norm") -> None:
    """Give each row-parallel closing projection the RMSNorm weight of the block after it, so that batched
    decode steps (RowParallel.next_norm) or prefill-sized messages of the copy collective (`attr`
    "prefill_norm") sum and norm in one collective. Only where the next block would apply exactly that norm to
    the sum: RMSNorm architectures without parallel blocks, a half-precision residual stream, no post-norm
    before the residual add, no norm bias."""
    arch = spec.arch
    if arch.norm != "rms" or arch.parallel_blocks or arch.residual_fp32:
        return
    for m, nxt in zip(mods, mods[1:]):
        closer = m.o_proj if isinstance(m, Attention) else m.down_proj if isinstance(m, MLP) else None
        if not isinstance(closer, RowParallel) or getattr(m, "post_norm", None) is not None:
            continue
        if isinstance(nxt, (Attention, MLP)):
            weight, bias = nxt.norm_w, nxt.norm_b
        elif isinstance(nxt, RMSNorm):
            weight, bias = nxt.weight, nxt.bias
        else:
            continue
        if weight is not None and bias is None and weight.dim() == 1:
            setattr(closer, attr, (weight, spec.norm_eps))


def tp_strategy(ctx: TPContext, group: LockstepGroup, per_slot: dict[int, list[Module]], opts: RuntimeOptions
                ) -> Strategy:
    lanes = []
    for slot, mods in per_slot.items():
        core = Transformer(mods)
        lanes.append(Lane(ctx.all_devs[slot], partial(core.forward),
                          cache_part=lambda c, slot=slot: None if c is None else tp_part(c, slot), modules=mods))
    devs = [lane.device for lane in lanes]
    capturable = isinstance(ctx.comm, (NcclComm, PeerComm, HostMemComm)) and len({str(d) for d in devs}) == len(devs)
    graph_safe = opts.tp_graphs and capturable and cuda_graphs_possible(devs)
    return Strategy("tensor_parallel", [Stage(lanes, group)], graph_safe=graph_safe,
                    overlap_prefill=opts.tp_pipeline)


def tp_part(cache: Any, slot: int) -> Any:
    from exlpy.cache.tp import ExLlamaV2Cache_TP

    if not isinstance(cache, ExLlamaV2Cache_TP):
        raise TensorParallelError(
            f"a model loaded with load_tp() needs an ExLlamaV2Cache_TP, got {type(cache).__name__}")
    return cache.slot_cache(slot)
