"""Where a speculative round's time goes (benchmarks turn it on: `gen.spec.profile = RoundProfile()`).

A round (exlpy/generator/speculative/dynamic.py `Speculation.run`) launches the draft steps, the target's
verification forward of k+1 tokens per row and the verification itself, then waits for one read-back and
does the host's bookkeeping. Per round this records host timestamps at those points and, on a GPU, CUDA events
on the target's stream between the launches (read after the round's own sync: no wait of their own), so the
device time of each phase and the host time around it can be told apart:

- device: draft steps, target forward, verification (+ the read-back copy), each the time between two events:
  it includes any time the device sat idle waiting for the host to launch the next kernel.
- host: before (the generator's work between rounds: scheduling, planning, n-gram lookups), prep (the round's
  inputs before the first draft step), launch (from the first draft step to the read-back's launch), wait (the
  read-back's sync), after (accepting tokens, stop conditions, results).

`summary()` averages the recorded rounds; a round's wall time is before + prep + launch + wait + after. With
the device never idle, wall ~ draft + forward + verify + the host's prep and after (which nothing overlaps).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

PHASES = ("draft", "forward", "verify")


@dataclass
class _Round:
    k: int
    t0: float
    before: float
    host: dict[str, float] = field(default_factory=dict)
    events: list[Any] = field(default_factory=list)


class RoundProfile:
    def __init__(self) -> None:
        self.rounds: list[_Round] = []
        self._last_end: float | None = None
        self._stream: Any = None
        self._marks: list[float] = []

    def reset(self) -> None:
        self.rounds.clear()
        self._last_end = None

    # --- called by Speculation.run ----------------------------------------------------------------------
    def begin(self, k: int, device: torch.device) -> None:
        now = time.perf_counter()
        before = now - self._last_end if self._last_end is not None else 0.0
        self.rounds.append(_Round(k, now, before))
        self._stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self._marks = [now]
        self._event()

    def mark(self) -> None:
        """The round's points in order: drafting starts, drafts launched, forward launched, verification
        launched (each a host timestamp and, on a GPU, an event)."""
        self._marks.append(time.perf_counter())
        self._event()

    def synced(self) -> None:
        self._marks.append(time.perf_counter())

    def end(self) -> None:
        r = self.rounds[-1]
        now = time.perf_counter()
        # begin, drafting starts, drafts launched, forward launched, verification launched, synced
        m = self._marks
        if len(m) == 6:
            r.host = {"prep": m[1] - m[0], "launch": m[4] - m[1], "wait": m[5] - m[4], "after": now - m[5]}
        self._last_end = now

    def _event(self) -> None:
        if self._stream is None:
            return
        e = torch.cuda.Event(enable_timing=True)
        e.record(self._stream)
        self.rounds[-1].events.append(e)

    # --- results ----------------------------------------------------------------------------------------
    def device_ms(self, r: _Round) -> dict[str, float]:
        """Device milliseconds between the round's events: draft, forward, verify (empty without CUDA)."""
        ev = r.events
        if len(ev) < 5 or not ev[-1].query():
            return {}
        # events: begin, drafting started, drafts launched, forward launched, verification launched
        return {"draft": ev[1].elapsed_time(ev[2]), "forward": ev[2].elapsed_time(ev[3]),
                "verify": ev[3].elapsed_time(ev[4])}

    def summary(self, skip: int = 2) -> dict[str, float]:
        """Means over the rounds after the first `skip` (graph captures): 'rounds', 'k', 'wall' and the host
        phases in ms, and the device phases in ms where CUDA events were recorded."""
        rounds = [r for r in self.rounds[skip:] if r.host] or [r for r in self.rounds if r.host]
        if not rounds:
            return {"rounds": 0.0}
        out: dict[str, float] = {"rounds": float(len(rounds)), "k": sum(r.k for r in rounds) / len(rounds)}
        out["before"] = 1000.0 * sum(r.before for r in rounds) / len(rounds)
        for name in ("prep", "launch", "wait", "after"):
            out[name] = 1000.0 * sum(r.host[name] for r in rounds) / len(rounds)
        out["wall"] = out["before"] + out["prep"] + out["launch"] + out["wait"] + out["after"]
        dev = [self.device_ms(r) for r in rounds]
        dev = [d for d in dev if d]
        for name in PHASES:
            if dev:
                out["device " + name] = sum(d[name] for d in dev) / len(dev)
        return out

    def describe(self, plain_step_ms: float | None = None) -> str:
        """One line for a benchmark's output: mean ms per round by phase."""
        s = self.summary()
        if not s.get("rounds"):
            return "no rounds profiled"
        parts = [f"{int(s['rounds'])} rounds, k {s['k']:.2f}, wall {s['wall']:.3f} ms"]
        if "device draft" in s:
            parts.append(f"device: draft {s['device draft']:.3f} + forward {s['device forward']:.3f} + verify "
                         f"{s['device verify']:.3f} ms")
        parts.append(f"host: before {s['before']:.3f}, prep {s['prep']:.3f}, launch {s['launch']:.3f}, wait "
                     f"{s['wait']:.3f}, after {s['after']:.3f} ms")
        if plain_step_ms is not None:
            parts.append(f"plain step {plain_step_ms:.3f} ms")
        return "; ".join(parts)
