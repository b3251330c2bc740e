"""What every execution strategy is: a list of stages, run by one function.

A *stage* is a set of lanes that run at the same time, one per device, meeting at their collectives
(tensor parallelism has one stage of N lanes). Stages run one after another, the hidden state hopping to
the next stage's device in between (a layer split has one single-lane stage per device segment). One GPU
is one stage of one lane. The eager forward (`execute`) and the CUDA-graph runner (graphs.py) both walk
these stages, so a feature added to the blocks reaches every strategy at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import torch

from exlpy.engine.lockstep import LockstepGroup, run_lanes
from exlpy.model.batch import ForwardBatch
from exlpy.parallel.p2p import safe_move_tensor


@dataclass
class Lane:
    device: torch.device
    run: Callable[[torch.Tensor, ForwardBatch], Coroutine[Any, Any, Any]]  # input -> output (a coroutine)
    cache_part: Callable[[Any], Any] = lambda cache: cache  # this lane's view of the cache (TP: its slot)
    modules: list[Any] = field(default_factory=list)  # the modules this lane runs (adapters attach to them)


@dataclass
class Stage:
    lanes: list[Lane]
    group: LockstepGroup | None = None  # the lanes' collectives (tensor parallelism)


@dataclass
class Strategy:
    """How a loaded model runs: its stages, and whether a decode step of them may be captured."""

    name: str
    stages: list[Stage]
    graph_safe: bool = False  # every lane on a CUDA device, kernels that never read device values on the host
    graph_cache: dict[str, Any] = field(default_factory=dict)  # the graph runner, kept with the strategy
    # Tensor parallelism: long prefill chunks run as two micro-batches whose all-reduces overlap each other's
    # compute (exlpy/engine/pipeline.py; EXLPY_TP_PIPELINE=1)
    overlap_prefill: bool = False

    @property
    def first_device(self) -> torch.device:
        return self.stages[0].lanes[0].device

    @property
    def devices(self) -> list[torch.device]:
        out: list[torch.device] = []
        for st in self.stages:
            for lane in st.lanes:
                if lane.device not in out:
                    out.append(lane.device)
        return out


def lane_batch(lane: Lane, batch: ForwardBatch) -> ForwardBatch:
    return batch.on(lane.device).with_cache(lane.cache_part(batch.cache))


def execute(strategy: Strategy, ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor | None:
    """One eager forward of any shape: every stage in order. Returns what the last stage's first lane
    returned (float32 logits, or None for a prefill that wants none)."""
    x: torch.Tensor | None = ids
    last_batch = batch
    with contextlib.ExitStack() as scopes:
        seen: set[int] = set()
        for st in strategy.stages:  # caches that track what a pass touches (quantized ones) see it begin/end
            for lane in st.lanes:
                part = lane.cache_part(batch.cache) if batch.cache is not None else None
                if part is not None and id(part) not in seen:
                    seen.add(id(part))
                    scopes.enter_context(part.forward_scope(lane_batch(lane, batch)))
        for st in strategy.stages:
            assert x is not None
            lanes = []
            for lane in st.lanes:
                b = lane_batch(lane, batch)
                lanes.append((lane.device, lane.run(safe_move_tensor(x, lane.device), b)))
                if lane is st.lanes[0]:
                    last_batch = b
            x = run_lanes(lanes, st.group)[0]
            if x is None:
                return None
    if batch.keep_last_state:
        batch.last_state = last_batch.last_state
    return x
