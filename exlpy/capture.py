"""Guarding CUDA graph captures against Python's garbage collector.

A CUDA graph that is destroyed while another stream is capturing frees its memory pool and its executable graph:
CUDA refuses both during a capture ("operation not permitted when stream is capturing") and invalidates the capture
in progress, so the step being captured fails although nothing in it was wrong. Python's cyclic collector can run at
any allocation and finish off an earlier generator's or test's graphs (they sit in reference cycles with their
owners) in the middle of a capture. `torch.cuda.graph` collects before it begins a capture but leaves the collector
on while it runs; every capture in exlpy (a decode step's stages, the captured sampler, speculative verification,
the all-reduce timing) runs inside `gc_paused()`, which collects first and keeps the collector off until the
capture has ended. Seen on an H100 (2026-11-26): a job's first step failing to capture after an earlier test's
generator went out of scope, the job ending empty.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused(collect: bool = True) -> Iterator[None]:
    """Collect now (unless `collect` is False: `torch.cuda.graph` collects on entering), then keep the cyclic
    garbage collector off until the block ends (restored as it was)."""
    was_enabled = gc.isenabled()
    if collect:
        gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
