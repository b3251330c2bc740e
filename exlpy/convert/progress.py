"""Progress bars (one per stage: layer, ETA and, while measuring, the running accuracy) and the final summary."""

from __future__ import annotations

import json
import resource
import sys
import time
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

# exllamav2's stage names in its status lines (convert.py -so), by exlpy's stage.
STATUS_STAGES = {"tokenize (measure)": "Tokenizing (1)", "measure": "Measuring", "optimize": "Optimizing",
                 "tokenize (quantize)": "Tokenizing (2)", "quantize": "Quantizing", "compile": "Compiling"}
PLAIN_INTERVAL_S = 5.0  # a progress line at most this often when the output is not a terminal


class StageProgress:
    """How a conversion reports progress.

    - On a terminal: a rich progress bar per stage (nothing when quiet).
    - Otherwise (a file, a pipe, a job log): plain lines, one when a stage starts and ends and a percentage
      every few seconds in between, so a long job never looks hung.
    - With `status_output` (-so): also exllamav2's machine-readable lines on stdout, which front ends parse:
      `[STATUS]{"stage": "Quantizing", "completion": 0.25}[/STATUS]`.
    """

    def __init__(self, enabled: bool, status_output: bool = False, stream: Any = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.console = Console(file=self.stream)
        self.enabled = enabled
        self.status_output = status_output
        self.plain = enabled and not self.console.is_terminal
        self._progress: Progress | None = None
        self._task: Any = None
        self._stage = ""
        self._total = self._done = 0
        self._t0 = self._last = 0.0

    def start(self, stage: str, total: int, done: int = 0) -> None:
        self.finish()
        self._stage, self._total, self._done = stage, max(1, total), done
        self._t0 = self._last = time.monotonic()
        self._status()
        if not self.enabled:
            return
        if self.plain:
            self._line(f"{stage}: started ({self._total} steps{f', {done} done before' if done else ''})")
            return
        self._progress = Progress(TextColumn("[bold]{task.description:<10}"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.fields[what]}"), TimeElapsedColumn(), TextColumn("ETA"),
                                  TimeRemainingColumn(), console=self.console, transient=False)
        self._progress.start()
        self._task = self._progress.add_task(stage, total=total, completed=done, what="")

    def advance(self, what: str) -> None:
        self._done += 1
        self._status()
        if self._progress is not None:
            self._progress.update(self._task, advance=1, what=what)
        elif self.plain and time.monotonic() - self._last >= PLAIN_INTERVAL_S and self._done < self._total:
            self._last = time.monotonic()
            self._line(f"{self._stage}: {100 * self._done / self._total:.0f}% ({self._done}/{self._total})  {what}")

    def note(self, what: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, what=what)

    def finish(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        elif self.plain and self._stage:
            self._line(f"{self._stage}: done in {time.monotonic() - self._t0:.1f} s")
        self._stage = ""

    def step(self, stage: str) -> None:
        """A stage without steps of its own (tokenizing, optimizing): one line, and its status at 100%."""
        self.start(stage, 1)
        self.advance("")
        self.finish()

    def print(self, *args: Any) -> None:
        if self.enabled:
            self.console.print(*args)

    def _line(self, text: str) -> None:
        print(f"exlpy convert: {text}", file=self.stream, flush=True)

    def _status(self) -> None:
        if self.status_output:
            status = {"stage": STATUS_STAGES.get(self._stage, self._stage),
                      "completion": round(self._done / self._total, 4)}
            print("[STATUS]" + json.dumps(status) + "[/STATUS]", flush=True)


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
