"""Where a speculative round's time goes (benchmarks turn it on: `gen.spec.profile = RoundProfile()`).

A round (exlpy/generator/speculative/dynamic.py `Speculation.run`) launches the draft steps, the target's
verification forward of k+1 tokens per row and the verification itself, then waits for one read-back and
does the host's bookkeeping. Per round this records host timestamps at those points and, on a GPU, CUDA events
on the target's stream between the launches (read after the round's own sync: no wait of their own), so the
device time of each phase and the host time around it can be told apart:

- device: draft steps, target forward, verification (+ the read-back copy), each the time between two events:
  it includes any time the device sat idle waiting for the host to launch the next kernel; and the gap from the
  previous round's read-back to this round's first draft step (the host's time between rounds, where nothing
  was launched ahead).
- host: before (the generator's work between rounds: scheduling, planning, n-gram lookups), prep (the round's
  inputs before the first draft step), launch (from the first draft step to the read-back's launch), wait (the
  read-back's sync), after (accepting tokens, stop conditions, results).

A round launched ahead (`Speculation._chain`: inside the previous round's finish, before its bookkeeping) has its
prep and launch there; its `before` then runs from the previous round's end to the moment it begins to wait, and
the previous round's `after` leaves out the time spent launching it, so that the phases of successive rounds add
up to the elapsed time either way. `summary()` averages the recorded rounds (and the share launched ahead); a
round's wall time is before + prep + launch + wait + after.
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
    chained: bool  # launched by the round before, ahead of that round's bookkeeping
    marks: list[float] = field(default_factory=list)  # begin, drafting starts, drafts launched, forward, verify
    waited: float = 0.0  # when the round's finish began to wait for its read-back
    synced_at: float = 0.0
    host: dict[str, float] = field(default_factory=dict)
    events: list[Any] = field(default_factory=list)
    stream: Any = None
    done: Any = None  # an event after the read-back's copy: the round's last device work


class RoundProfile:
    def __init__(self) -> None:
        self.rounds: list[_Round] = []
        self._last_end: float | None = None

    def reset(self) -> None:
        self.rounds.clear()
        self._last_end = None

    # --- called by Speculation (launch, then finish) ----------------------------------------------------
    def begin(self, k: int, device: torch.device, chained: bool = False) -> _Round:
        r = _Round(k, chained, stream=torch.cuda.current_stream(device) if device.type == "cuda" else None)
        self.rounds.append(r)
        self.mark(r)
        return r

    def mark(self, r: _Round) -> None:
        """The round's points in order: begin, drafting starts, drafts launched, forward launched, verification
        launched (each a host timestamp and, on a GPU, an event)."""
        r.marks.append(time.perf_counter())
        if r.stream is not None:
            e = torch.cuda.Event(enable_timing=True)
            e.record(r.stream)
            r.events.append(e)

    def launched(self, r: _Round) -> None:
        """The read-back's copy is queued: the round's device work ends here."""
        if r.stream is not None:
            r.done = torch.cuda.Event(enable_timing=True)
            r.done.record(r.stream)

    def waiting(self, r: _Round) -> None:
        r.waited = time.perf_counter()

    def synced(self, r: _Round) -> None:
        r.synced_at = time.perf_counter()

    def drop(self, r: _Round) -> None:
        """A round launched ahead and then discarded (its job ended in the bookkeeping before it)."""
        if r in self.rounds:
            self.rounds.remove(r)

    def end(self, r: _Round, launching: float = 0.0) -> None:
        """`launching`: seconds of the bookkeeping spent launching the next round (that round's prep and
        launch)."""
        now = time.perf_counter()
        m = r.marks
        if len(m) == 5:
            # An unchained round starts after the previous one ended; a chained one was launched inside the
            # previous round's finish, so what is new in its time starts when it begins to wait: then the
            # phases of successive rounds add up to the elapsed time either way.
            start = r.waited if r.chained else m[0]
            before = max(0.0, start - self._last_end) if self._last_end is not None else 0.0
            wait_from = r.waited if r.chained else m[4]
            r.host = {"before": before, "prep": m[1] - m[0], "launch": m[4] - m[1],
                      "wait": max(0.0, r.synced_at - wait_from), "after": now - r.synced_at - launching}
        self._last_end = now

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
        out["chained"] = sum(r.chained for r in rounds) / len(rounds)
        for name in ("before", "prep", "launch", "wait", "after"):
            out[name] = 1000.0 * sum(r.host[name] for r in rounds) / len(rounds)
        out["wall"] = out["before"] + out["prep"] + out["launch"] + out["wait"] + out["after"]
        dev = [self.device_ms(r) for r in rounds]
        dev = [d for d in dev if d]
        for name in PHASES:
            if dev:
                out["device " + name] = sum(d[name] for d in dev) / len(dev)
        gaps = [g for g in (self.device_gap(r) for r in rounds) if g is not None]
        if gaps:
            out["device gap"] = sum(gaps) / len(gaps)
        return out

    def device_gap(self, r: _Round) -> float | None:
        """Device ms from the previous round's read-back to this round's first draft step (the uploads between
        them, and any time the device sat idle waiting for the host); None without CUDA events."""
        i = self.rounds.index(r)
        prev = self.rounds[i - 1] if i else None
        if prev is None or prev.done is None or len(r.events) < 2 or not r.events[1].query() \
                or not prev.done.query():
            return None
        return prev.done.elapsed_time(r.events[1])

    def describe(self, plain_step_ms: float | None = None) -> str:
        """One line for a benchmark's output: mean ms per round by phase."""
        s = self.summary()
        if not s.get("rounds"):
            return "no rounds profiled"
        parts = [f"{int(s['rounds'])} rounds, k {s['k']:.2f}, wall {s['wall']:.3f} ms, "
                 f"{100 * s['chained']:.0f}% launched ahead"]
        if "device draft" in s:
            parts.append(f"device: draft {s['device draft']:.3f} + forward {s['device forward']:.3f} + verify "
                         f"{s['device verify']:.3f} ms" + (f", gap between rounds {s['device gap']:.3f} ms"
                                                          if "device gap" in s else ""))
        parts.append(f"host: before {s['before']:.3f}, prep {s['prep']:.3f}, launch {s['launch']:.3f}, wait "
                     f"{s['wait']:.3f}, after {s['after']:.3f} ms")
        if plain_step_ms is not None:
            parts.append(f"plain step {plain_step_ms:.3f} ms")
        return "; ".join(parts)
