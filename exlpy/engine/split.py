"""Layer split: runs of consecutive modules on one device each (segments); the hidden state hops between.

Each segment is a stage of one lane. Between stages `execute` moves the hidden state to the next device,
the one place it crosses devices; the CUDA-graph runner captures one graph per segment and copies the hidden
state between replays, so a step costs one launch per GPU.
"""

from __future__ import annotations

from functools import partial

import torch

from exlpy.engine.single import cuda_graphs_possible
from exlpy.engine.strategy import Lane, Stage, Strategy
from exlpy.model.transformer import Transformer


def segments(devices: list[torch.device], cuts: tuple[int, ...] = ()) -> list[tuple[torch.device, int, int]]:
    """(device, start, stop) runs of equal devices; `cuts` add boundaries (tests exercise hops on one CPU)."""
    out = []
    start = 0
    for i in range(1, len(devices) + 1):
        if i == len(devices) or devices[i] != devices[start] or i in cuts:
            out.append((devices[start], start, i))
            start = i
    return out


def layer_split(core: Transformer, cuts: tuple[int, ...] = ()) -> Strategy:
    devices = [m.device for m in core.modules]
    assert all(d is not None for d in devices), "every module must be loaded"
    segs = segments(devices, cuts)  # type: ignore[arg-type]
    stages = [Stage([Lane(dev, partial(core.forward, start=a, stop=b), modules=core.modules[a:b])])
              for dev, a, b in segs]
    return Strategy("single" if len(stages) == 1 else "split", stages,
                    graph_safe=cuda_graphs_possible([d for d, _, _ in segs]))
