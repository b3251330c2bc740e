"""Programmatic dependent launch (Hopper and newer): the next kernel in the stream starts while this one ends.

Inside a captured decode step every launch still costs a few microseconds of ramp-up (grid launch, the first
loads of a cold program). With PDL a kernel is launched early, runs the part that reads only static data (its
task table, weight addresses), and waits in `gdc_wait` until the previous kernel has finished and its writes
are visible; the previous kernel lets it in once its main loop is done (`gdc_launch_dependents`). A kernel
launched this way must call `gdc_wait` before it touches anything an earlier kernel wrote, so only kernels
compiled with their PDL flag on are launched with it.

`EXLPY_PDL=0` (RuntimeOptions.pdl) turns it off (then every launch waits for the previous kernel to end, as usual).
"""

from __future__ import annotations

import functools

import torch

from exlpy.runtime import RuntimeOptions, options


def enabled(device: torch.device) -> bool:
    return _enabled(device, options())


@functools.lru_cache(maxsize=16)
def _enabled(device: torch.device, opts: RuntimeOptions) -> bool:
    if device.type != "cuda" or not opts.pdl or opts.triton_interpret:
        return False
    try:
        import triton.language.extra.cuda as tlc

        if not hasattr(tlc, "gdc_wait"):
            return False
    except ImportError:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)[0] >= 9


def launch_options(device: torch.device) -> dict[str, bool]:
    """Extra launch options for a kernel compiled with PDL=enabled(device)."""
    return {"launch_pdl": True} if enabled(device) else {}
