"""One device runs the whole module list: one stage, one lane."""

from __future__ import annotations

from functools import partial

import torch

from exlpy.engine.strategy import Lane, Stage, Strategy
from exlpy.kernels import ops
from exlpy.model.transformer import Transformer


def cuda_graphs_possible(devices: list[torch.device]) -> bool:
    """Graphs need every lane on a CUDA device and the Triton kernels (their sync-free paths)."""
    return all(d.type == "cuda" for d in devices) and torch.cuda.is_available() and ops.has_cuda_kernels()


def single_device(core: Transformer, device: torch.device) -> Strategy:
    return Strategy("single", [Stage([Lane(device, partial(core.forward), modules=core.modules)])],
                    graph_safe=cuda_graphs_possible([device]))
