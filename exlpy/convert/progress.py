"""Progress bars (one per stage: layer, ETA and, while measuring, the running accuracy) and the final summary."""

from __future__ import annotations

import resource
import sys
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table


class StageProgress:
    """A rich progress display, or nothing at all when quiet."""

    def __init__(self, enabled: bool) -> None:
        self.console = Console(file=sys.stderr)
        self.enabled = enabled
        self._progress: Progress | None = None
        self._task: Any = None

    def start(self, stage: str, total: int, done: int = 0) -> None:
        self.finish()
        if not self.enabled:
            return
        self._progress = Progress(TextColumn("[bold]{task.description:<10}"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.fields[what]}"), TimeElapsedColumn(), TextColumn("ETA"),
                                  TimeRemainingColumn(), console=self.console, transient=False)
        self._progress.start()
        self._task = self._progress.add_task(stage, total=total, completed=done, what="")

    def advance(self, what: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, advance=1, what=what)

    def note(self, what: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, what=what)

    def finish(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def print(self, *args: Any) -> None:
        if self.enabled:
            self.console.print(*args)


def peak_memory() -> dict[str, float]:
    """Peak host RSS and peak GPU allocation of this process, in GiB."""
    host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # KiB on Linux
    gpu = torch.cuda.max_memory_allocated() / 1024**3 if torch.cuda.is_available() else 0.0
    return {"host_gib": round(host, 2), "gpu_gib": round(gpu, 2)}


def summary_table(result: dict[str, Any]) -> Table:
    t = Table(title="exlpy convert: summary")
    t.add_column("what")
    t.add_column("value", justify="right")
    for kind, v in result["bpw"].items():
        t.add_row(f"bpw {kind}", f"{v:.3f}")
    for stage, sec in result["times"].items():
        t.add_row(f"time {stage}", f"{sec:,.1f} s")
    t.add_row("peak GPU memory", f"{result['peak']['gpu_gib']:.2f} GiB")
    t.add_row("peak host memory", f"{result['peak']['host_gib']:.2f} GiB")
    if result.get("head_error") is not None:
        t.add_row("head relative error", f"{result['head_error']:.4f}")
    if result.get("mean_layer_error") is not None:
        t.add_row("mean layer relative error", f"{result['mean_layer_error']:.4f}")
    return t
