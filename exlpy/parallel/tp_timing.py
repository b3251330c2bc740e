"""Per-stage timing of the tensor-parallel forward (benchmarks and diagnosis; off unless `ctx.timer` is set).

`StageTimer` records three marks per (stage, slot) on that slot's stream: before the stage's kernels, after
them (= before the collective) and after the collective, plus phase marks on the first slot's stream
(embedding, per-slot copies of the hidden state, stage loop, logits gather) and the host time spent issuing
each stage. On CUDA the marks are events (read after a synchronize, so timing does not serialize anything);
on CPU "devices" they are host clocks, which keeps the bookkeeping testable without a GPU.

How to read `summary()` per slot:
- `compute_ms`: the slot's own kernels.
- `collective_ms`: collective end minus compute end. It includes waiting for the slowest slot: if the slots ran
  one after another instead of concurrently, each slot's wait here approaches the other slots' compute.
- `gap_ms`: collective end of one stage to kernel start of the next: the GPU waiting for the host.
- `stage_loop_ms`: first stage start to last stage end.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class _Mark:
    """A CUDA event on the device's current stream, or a host clock for CPU devices."""

    __slots__ = ("event", "host")

    def __init__(self, device: torch.device) -> None:
        if device.type == "cuda":
            self.event: Any = torch.cuda.Event(enable_timing=True)
            self.event.record(torch.cuda.current_stream(device))
            self.host = 0.0
        else:
            self.event = None
            self.host = time.perf_counter()

    def ms_until(self, later: _Mark) -> float:
        if self.event is not None:
            return float(self.event.elapsed_time(later.event))
        return (later.host - self.host) * 1e3


class StageTimer:
    """Marks for one forward pass (call `reset()` before reusing it for another)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.marks: dict[tuple[int, int, int], _Mark] = {}  # (stage, slot index, 0|1|2)
        self.phases: list[tuple[str, _Mark]] = []
        self.host_s: dict[int, float] = {}
        self.labels: list[str] = []
        self.slots = 0

    def mark(self, stage: int, k: int, which: int, device: torch.device) -> None:
        self.marks[(stage, k, which)] = _Mark(device)
        self.slots = max(self.slots, k + 1)

    def phase(self, name: str, device: torch.device) -> None:
        self.phases.append((name, _Mark(device)))

    def host(self, stage: int, seconds: float) -> None:
        self.host_s[stage] = self.host_s.get(stage, 0.0) + seconds

    def summary(self) -> dict[str, Any]:
        """Milliseconds per slot and per stage kind (call after synchronizing every device)."""
        stages = sorted({s for s, _, _ in self.marks})
        per_slot = []
        for k in range(self.slots):
            comp = coll = gap = 0.0
            kinds: dict[str, float] = {}
            prev_end: _Mark | None = None
            first: _Mark | None = None
            last: _Mark | None = None
            for s in stages:
                m0, m1, m2 = (self.marks.get((s, k, w)) for w in (0, 1, 2))
                if m0 is None or m1 is None:
                    continue
                first = first or m0
                c = m0.ms_until(m1)
                comp += c
                label = self.labels[s] if s < len(self.labels) else "stage"
                kinds[label] = kinds.get(label, 0.0) + c
                if prev_end is not None:
                    gap += prev_end.ms_until(m0)
                end = m1
                if m2 is not None:
                    coll += m1.ms_until(m2)
                    end = m2
                prev_end = last = end
            per_slot.append({
                "compute_ms": round(comp, 3), "collective_ms": round(coll, 3), "gap_ms": round(gap, 3),
                "stage_loop_ms": round(first.ms_until(last), 3) if first and last else 0.0,
                "compute_by_kind_ms": {a: round(b, 3) for a, b in kinds.items()},
            })
        phases = {}
        for (a, ma), (b, mb) in zip(self.phases, self.phases[1:]):
            phases[f"{a}->{b}"] = round(ma.ms_until(mb), 3)
        return {"slots": per_slot, "phases_ms": phases,
                "host_issue_ms": round(sum(self.host_s.values()) * 1e3, 3),
                "stages": len(stages)}


def average(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Field-wise mean of several `summary()` results of the same forward shape (e.g. decode steps)."""

    def mean(values: list[Any]) -> Any:
        if isinstance(values[0], dict):
            return {key: mean([v[key] for v in values]) for key in values[0]}
        if isinstance(values[0], list):
            return [mean([v[i] for v in values]) for i in range(len(values[0]))]
        if isinstance(values[0], (int, float)):
            return round(sum(values) / len(values), 3)
        return values[0]

    return mean(summaries)
