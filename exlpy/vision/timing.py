"""Phase marks on the image path, for profiling (benchmarks/vision.py): where an image's time to first token goes.

`mark(name)` closes the phase that ran since the previous mark and names it. It does nothing unless a
`PhaseTimer` is active (a `with PhaseTimer(device):` block in the calling thread), so the library pays one
attribute read per mark otherwise. On a CUDA device each mark records an event on the current stream (no sync),
so a phase's device time is what the GPU timeline spent between two marks, host stalls included; on the CPU the
host clock is used. Phases met several times (a tower's blocks) are summed.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

_state = threading.local()


def mark(name: str) -> None:
    """End the current phase and call it `name` (no-op without an active PhaseTimer in this thread)."""
    timer = getattr(_state, "timer", None)
    if timer is not None:
        timer.mark(name)


class PhaseTimer:
    """Collects marks on `device` while active; `phases()` gives {name: (device ms, host ms)} in first-seen
    order (device ms equal host ms on the CPU)."""

    def __init__(self, device: Any) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.marks: list[tuple[str, float, Any]] = []

    def mark(self, name: str) -> None:
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
        self.marks.append((name, time.perf_counter(), event))

    def __enter__(self) -> PhaseTimer:
        self.marks = []
        self.mark("<start>")
        _state.timer = self
        return self

    def __exit__(self, *exc: Any) -> None:
        _state.timer = None

    def phases(self) -> dict[str, tuple[float, float]]:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        out: dict[str, tuple[float, float]] = {}
        for (_, t0, e0), (name, t1, e1) in zip(self.marks, self.marks[1:]):
            dev = e0.elapsed_time(e1) if self.cuda else (t1 - t0) * 1e3
            d, h = out.get(name, (0.0, 0.0))
            out[name] = (d + dev, h + (t1 - t0) * 1e3)
        return out
