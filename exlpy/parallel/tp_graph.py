"""CUDA graphs for tensor-parallel decode (one new token per row, contiguous TP cache).

One process drives every GPU, so Python launch overhead grows with the device count; graphs remove it. Two
granularities:

- "step" (default with the peer and NCCL backends): the whole decode step, all-reduces included, is captured
  as one graph per slot. Every slot's stream captures at the same time; the peer all-reduce is one kernel per
  GPU, and NCCL's single-process group call records its kernels into each slot's graph (the scheme of
  nccl-tests' multi-GPU-per-thread graph mode), so a step costs one graph launch per GPU and the host never
  issues a collective.
- "stage": each stage (see tp_layers) is one graph per slot and the host issues the all-reduce between stages.
  Used for the peer-copy and host-staging backends, whose cross-device copies cannot live inside one device's
  graph, and when step capture fails. `EXLPY_TP_GRAPH=stage` forces it (benchmarks compare both).

Inputs live in static per-slot buffers: the residual and one int64 `past` per slot, from which the first
stage's graph derives positions, cache slots and lengths (one host launch per slot and step instead of three).
Attention reads lengths from device memory over the whole cache (`max_seqlen` = cache length only sizes the
split-K kernel), so one graph set serves every step of a (batch size, cache) pair. Nothing is allocated per
step apart from the logits. A step never waits on the host: no `.item()`/`int()` of device values.
"""

from __future__ import annotations

import os
import time
import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from exlpy.model.batch import ForwardBatch

if TYPE_CHECKING:
    from exlpy.parallel.tp_context import TPContext

_MAX_SETS = 4


def graphs_wanted(ctx: TPContext) -> bool:
    devs = [ctx.all_devs[s] for s in ctx.all_devices()]
    if os.environ.get("EXLLAMA_NO_GRAPHS") or os.environ.get("EXLPY_TP_NO_GRAPHS"):
        return False
    return all(d.type == "cuda" for d in devs) and len({str(d) for d in devs}) == len(devs)


class _GraphSet:
    def __init__(self, ctx: TPContext, cache: Any, batch_size: int, fast: bool = False) -> None:
        from exlpy.parallel.tp_layers import SlotState
        from exlpy.parallel.tp_load import _stage_list

        self.fast = fast
        self.ctx = ctx
        self.comm = ctx.comm
        self.cache_ref = weakref.ref(cache)
        self.B = B = batch_size
        cfg = ctx.model.config
        S = cache.max_seq_len
        self.stages, _ = _stage_list(ctx)
        self.states: list[SlotState] = []
        self.inputs: list[dict[str, torch.Tensor]] = []
        for slot in ctx.all_devices():
            dev = ctx.all_devs[slot]
            rows = torch.arange(B, device=dev)
            inp = {
                "x": torch.zeros(B, 1, cfg.hidden_size, dtype=cfg.compute_dtype(dev), device=dev),
                "past": torch.zeros(1, dtype=torch.long, device=dev),
                "pos": torch.zeros(B, 1, dtype=torch.long, device=dev),
                "slots": (rows * S).view(B, 1).clone(),
                "row_base": (rows * S).view(B, 1),
                "seqlens": torch.ones(B, dtype=torch.int32, device=dev),
                # fast step: token ids and past length as float32 (exact below 2^24), broadcast in the graph
                "tok": torch.zeros(B + 1, dtype=torch.float32, device=dev),
            }
            batch = ForwardBatch(
                B,
                1,
                inp["pos"],
                cache=cache,
                slots=inp["slots"],
                block_table=rows.int().view(B, 1),
                page_size=S,
                seqlens=inp["seqlens"],
                max_seqlen=S,
                past_len=None,
            )
            self.inputs.append(inp)
            self.states.append(SlotState(slot, dev, inp["x"], batch, cache.slot_cache(slot), static_attn=True))
        self.graphs: list[list[torch.cuda.CUDAGraph]] = []  # [stage][slot] ("step": one row, the whole step)
        self.outs: list[list[torch.Tensor]] = []
        self.mode = "stage"

    def _set_inputs(self, x: torch.Tensor, past: int, derive: bool) -> None:
        for inp in self.inputs:
            inp["x"].copy_(x)
            inp["past"].fill_(past)
            if derive:  # eager warm-up; captured graphs derive them themselves
                self._derive(inp)

    @staticmethod
    def _derive(inp: dict[str, torch.Tensor]) -> None:
        """Positions, cache slots and key counts of this step from the device-side `past`."""
        past = inp["past"]
        inp["pos"].copy_(past.view(1, 1).expand_as(inp["pos"]))
        torch.add(inp["row_base"], past, out=inp["slots"])
        inp["seqlens"].copy_((past + 1).expand_as(inp["seqlens"]))

    def _reset_states(self) -> None:
        for st, inp in zip(self.states, self.inputs):
            st.x, st.red, st.pending, st.inp = inp["x"], None, "", None

    def capture(self, x: torch.Tensor, past: int) -> None:
        from exlpy.parallel.tp_comm import NcclComm, PeerComm
        from exlpy.parallel.tp_load import run_stages

        for _ in range(2):  # warm-up: Triton compiles, cuBLAS workspaces, NCCL communicators
            self._set_inputs(x, past, derive=True)
            self._reset_states()
            if self.fast:  # its collectives (float32 ids among them) must not compile inside the capture
                self._embed_in_graph()
                for inp in self.inputs:
                    self._derive(inp)
            outs = run_stages(self.ctx, self.stages, self.states)
            if self.fast:
                self._gather_in_graph(outs)
        self.ctx.wait_streams()
        pools = {}
        streams = {}
        for st in self.states:
            with torch.cuda.device(st.device):
                pools[st.slot] = torch.cuda.graph_pool_handle()
                streams[st.slot] = torch.cuda.Stream(st.device)
        self.mode = "stage"
        # Phase timing needs the host between stages, so a timed context gets per-stage graphs.
        step = os.environ.get("EXLPY_TP_GRAPH", "step") != "stage" and self.ctx.timer is None
        if step and isinstance(self.ctx.comm, (NcclComm, PeerComm)):
            try:
                self._capture_step(x, past, pools, streams)
                self.mode = "step"
            except RuntimeError as e:  # a driver or NCCL that refuses multi-stream capture: per-stage graphs
                warnings.warn(f"TP decode: whole-step graph capture failed ({e}); using per-stage graphs",
                              stacklevel=2)
                self.graphs, self.outs = [], []
                for st in self.states:
                    with torch.cuda.device(st.device):
                        pools[st.slot] = torch.cuda.graph_pool_handle()
                        streams[st.slot] = torch.cuda.Stream(st.device)
        if self.mode == "stage" and not self.fast:  # a failed fast step is dropped by the caller
            self._capture_stages(x, past, pools, streams)
        self.ctx.wait_streams()

    def _capture_step(self, x: torch.Tensor, past: int, pools: dict[int, Any], streams: dict[int, Any]) -> None:
        """One graph per slot holding the whole step. All slots' captures are open at once: the eager stage
        runner then issues each slot's kernels and the NCCL group calls onto the capturing streams."""
        from exlpy.parallel.tp_load import run_stages

        self._set_inputs(x, past, derive=True)
        self._reset_states()
        self.ctx.wait_streams()
        graphs = [torch.cuda.CUDAGraph() for _ in self.states]
        prev = {st.slot: torch.cuda.current_stream(st.device) for st in self.states}
        begun: list[int] = []
        failed = True
        try:
            for k, st in enumerate(self.states):
                with torch.cuda.device(st.device):
                    torch.cuda.set_stream(streams[st.slot])
                    # relaxed: under "global" or "thread_local" the second capture_begin is refused while the
                    # first slot's capture is open (benchmarks/capture_probe.py; H200, torch 2.11, CUDA 13)
                    graphs[k].capture_begin(pool=pools[st.slot], capture_error_mode="relaxed")
                    begun.append(k)
            if self.fast:
                self._embed_in_graph()
            for st, inp in zip(self.states, self.inputs):
                with torch.cuda.device(st.device):
                    self._derive(inp)
            outs = run_stages(self.ctx, self.stages, self.states)
            if self.fast:
                outs = [self._gather_in_graph(outs)]
            failed = False
        finally:
            end_error: RuntimeError | None = None
            for k in begun:  # every open capture is closed, whatever happened
                with torch.cuda.device(self.states[k].device):
                    try:
                        graphs[k].capture_end()
                    except RuntimeError as e:  # after a failure above, the invalidated captures say so again
                        end_error = end_error or e
            for st in self.states:
                with torch.cuda.device(st.device):  # set_stream also makes the stream's device current
                    torch.cuda.set_stream(prev[st.slot])
            if end_error is not None and not failed:
                raise end_error
        self.graphs = [graphs]
        self.outs = [outs]

    def _embed_in_graph(self) -> None:
        """Captured: the host wrote [ids..., past] into the first slot's `tok`; one all-reduce (the other
        slots contribute zeros) hands it to every slot, the first slot embeds, a second one broadcasts x."""
        toks = [inp["tok"] for inp in self.inputs]
        for st, t in zip(self.states[1:], toks[1:]):
            with torch.cuda.device(st.device):
                t.zero_()
        self.ctx.all_reduce(toks)
        B = self.B
        emb = self.ctx.model.modules[0]
        for k, (st, inp) in enumerate(zip(self.states, self.inputs)):
            with torch.cuda.device(st.device):
                inp["past"].copy_(inp["tok"][B:].long())
                if k == 0:
                    inp["x"].copy_(emb.forward(inp["tok"][:B].long().view(B, 1), None).view_as(inp["x"]))
                else:
                    inp["x"].zero_()
        self.ctx.all_reduce([inp["x"] for inp in self.inputs])

    def _gather_in_graph(self, outs: list[torch.Tensor]) -> torch.Tensor:
        """Captured: every slot places its vocabulary slice in a zeroed full-width row, an all-reduce joins
        them; the first slot's float32 copy is the graph's output."""
        vocab = sum(o.shape[-1] for o in outs)
        full, a = [], 0
        for st, o in zip(self.states, outs):
            with torch.cuda.device(st.device):
                f = torch.zeros(*o.shape[:-1], vocab, dtype=o.dtype, device=o.device)
                f[..., a:a + o.shape[-1]] = o
                full.append(f)
                a += o.shape[-1]
        self.ctx.all_reduce(full)
        with torch.cuda.device(self.states[0].device):
            return full[0].float()

    def decode(self, ids: torch.Tensor, past: int) -> torch.Tensor:
        """Logits [B, 1, vocab] (float32, first slot's device) for token ids [B, 1] at `past` (fast step)."""
        B = self.B
        host = torch.empty(B + 1, dtype=torch.float32)
        host[:B] = ids.reshape(B)
        host[B] = past
        # A pageable copy waits for the stream, so the previous replay has read `tok` before it is rewritten.
        self.inputs[0]["tok"].copy_(host)
        for st, g in zip(self.states, self.graphs[0]):
            with torch.cuda.device(st.device):
                g.replay()
        with torch.cuda.device(self.states[0].device):
            return self.outs[0][0].clone()

    def _capture_stages(self, x: torch.Tensor, past: int, pools: dict[int, Any], streams: dict[int, Any]) -> None:
        self._set_inputs(x, past, derive=True)
        self._reset_states()
        for i, stage in enumerate(self.stages):
            row_g, row_o = [], []
            for st, inp in zip(self.states, self.inputs):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.device(st.device), torch.cuda.graph(g, pool=pools[st.slot], stream=streams[st.slot]):
                    if i == 0:
                        self._derive(inp)
                    st.enter()
                    out = stage.fn(st)
                row_g.append(g)
                row_o.append(out)
            for st, out in zip(self.states, row_o):
                st.red, st.pending = out, stage.then
            self.graphs.append(row_g)
            self.outs.append(row_o)

    def replay(self, x: torch.Tensor, past: int) -> torch.Tensor:
        from exlpy.parallel.tp_load import gather_logits

        timer = self.ctx.timer
        if timer is not None:
            from exlpy.parallel.tp_load import stage_labels

            timer.labels = stage_labels(self.ctx)
        self._set_inputs(x, past, derive=False)
        if self.mode == "step":
            for st, g in zip(self.states, self.graphs[0]):
                with torch.cuda.device(st.device):
                    g.replay()
            return gather_logits(self.ctx, self.outs[0])
        for i, (stage, row_g, row_o) in enumerate(zip(self.stages, self.graphs, self.outs)):
            t0 = time.perf_counter()
            for k, (st, g) in enumerate(zip(self.states, row_g)):
                with torch.cuda.device(st.device):
                    if timer is not None:
                        timer.mark(i, k, 0, st.device)
                    g.replay()
                    if timer is not None:
                        timer.mark(i, k, 1, st.device)
            if stage.then != "out":
                self.ctx.all_reduce(row_o)
                if timer is not None:
                    for k, st in enumerate(self.states):
                        timer.mark(i, k, 2, st.device)
            if timer is not None:
                timer.host(i, time.perf_counter() - t0)
        return gather_logits(self.ctx, self.outs[-1])


class TPGraphs:
    """Decode graph sets keyed by (batch size, cache), built on first use."""

    def __init__(self, ctx: TPContext) -> None:
        self.ctx = ctx
        self.sets: dict[tuple[Any, ...], _GraphSet] = {}
        self.fast_failed = False

    def decode(self, ids: torch.Tensor, cache: Any, past: int) -> torch.Tensor | None:
        """The fast decode step (`model.forward` with one token per row over a TP cache): the whole step,
        embedding and logits gather included, is one graph per GPU, so the host issues one small copy and
        one launch per GPU. None where it does not apply (the caller takes the general path)."""
        from exlpy.parallel.tp_comm import NcclComm, PeerComm

        ctx = self.ctx
        B = ids.shape[0]
        emb = ctx.model.modules[0]
        if (self.fast_failed or not isinstance(ctx.comm, (NcclComm, PeerComm)) or ctx.timer is not None
                or os.environ.get("EXLPY_TP_GRAPH", "step") == "stage" or ids.shape[1] != 1
                or B > getattr(cache, "batch_size", 0) or emb.device != ctx.all_devs[ctx.all_devices()[0]]):
            return None
        def build() -> _GraphSet | None:
            gs = _GraphSet(ctx, cache, B, fast=True)
            x = emb.forward(ids.to(emb.device, torch.long).view(B, 1), None)
            gs.inputs[0]["tok"].copy_(torch.cat([ids.reshape(B).float().cpu(), torch.tensor([float(past)])]))
            gs.capture(x, past)
            if gs.mode != "step":  # step capture failed: the general path serves this model from now on
                self.fast_failed = True
                return None
            return gs

        gs = self._get(("fast", B, id(cache)), cache, build)
        return None if gs is None else gs.decode(ids, past)

    def _get(self, key: tuple[Any, ...], cache: Any, build: Callable[[], _GraphSet | None]) -> _GraphSet | None:
        """The graph set under `key`, rebuilt when its cache or collective backend changed (a step graph holds
        its NCCL or peer calls), the oldest set evicted past `_MAX_SETS`."""
        gs = self.sets.get(key)
        if gs is not None and (gs.cache_ref() is not cache or gs.comm is not self.ctx.comm):
            del self.sets[key]
            gs = None
        if gs is None:
            if len(self.sets) >= _MAX_SETS:
                self.sets.pop(next(iter(self.sets)))
            gs = build()
            if gs is not None:
                self.sets[key] = gs
        return gs

    def clear(self) -> None:
        self.sets.clear()

    def try_run(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor | None:
        """Logits for a graph-eligible decode step, else None (the caller runs the eager path)."""
        cache = batch.cache
        if (
            cache is None
            or batch.q_len != 1
            or batch.past_len is None
            or batch.key_mask is not None
            or batch.page_size != getattr(cache, "max_seq_len", -1)
        ):
            return None
        if batch.block_table is None or batch.block_table.shape[1] != 1:
            return None
        # A batch with `past_len` set addresses cache rows 0..B-1 (the eager fast path slices k_cache[:B] on the
        # same promise), so the rows need no check here: reading them back would stall the step on the GPU.
        past = batch.past_len

        def build() -> _GraphSet:
            gs = _GraphSet(self.ctx, cache, batch.batch_size)
            gs.capture(x, past)
            return gs

        gs = self._get((batch.batch_size, id(cache)), cache, build)
        assert gs is not None
        return gs.replay(x, past)
