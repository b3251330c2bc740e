"""The streaming generator's overlapped steps: one sequence, a contiguous cache, tokens sampled on the device.

`launch()` runs one decode step and samples it on the device; the token stays there and can feed the next
`launch()` directly, while a non-blocking copy brings it (and its probability) to the host behind an event.
The streaming generator launches step n+1 before it reads step n, so its host work overlaps the GPU's.

A launched step that turns out to be one too many (the token before it ended the stream) is discarded: the
cache length goes back and the random number it drew is given back to its generator, so the stream draws
exactly the numbers it would draw without the overlap.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from exlpy.generator.dynamic.decode import read_back, upload_floats
from exlpy.generator.sampling.batched import RowSample, device_capable, is_greedy, sample_rows
from exlpy.generator.sampling.graphed import GraphRow, GraphSampler, graph_capable


@dataclass
class Pending:
    """A launched step whose token the host has not read yet."""

    token: torch.Tensor  # [1] long on the device
    host: torch.Tensor  # [3] float64 on the host: token, probability, usable (filled by the copy)
    event: Any
    rng_state: Any  # the generator's state before this step's draw (None: greedy, no draw)
    rng_after: Any  # ...and after it: a state changed since (the user reseeded) is left alone
    fed_at: int  # cache position of the token this step fed

    def read(self) -> tuple[int, float]:
        if self.event is not None:
            self.event.synchronize()
        if not bool(self.host[2]):
            from exlpy.errors import SamplerError
            from exlpy.generator.dynamic.decode import BAD_ROW

            raise SamplerError(BAD_ROW)
        return int(self.host[0]), float(self.host[1])


def launch(model: Any, cache: Any, ids: torch.Tensor, plan: RowSample, rng: torch.Generator | None,
           tokenizer: Any, loras: Any = None,
           graph: Callable[[torch.Tensor], tuple[GraphSampler, int] | None] | None = None) -> Pending:
    """Feed `ids` [1, 1] (host or device) at `cache.current_seq_len` and sample the next token on the device
    (`loras`: the stream's LoRA adapters). `graph(logits)` gives the captured sampler to sample with and the slot
    of the stream's penalty counts, when the stream uses one (exlpy/generator/sampling/graphed.py); the random
    point is drawn from `rng` either way."""
    fed_at = cache.current_seq_len
    logits = model.forward(ids, cache, loras=loras or None)[:, -1].float()
    state = after = None
    point = 0.0
    if not is_greedy(plan.settings):
        state = _get_state(rng)
        point = float(torch.rand(1, 1, generator=rng)[0, 0])
        after = _get_state(rng)
    use = graph(logits) if graph is not None and graph_capable(plan.settings, logits.shape[-1]) else None
    if use is not None:
        sampler, slot = use
        try:
            t, p, k = sampler.sample(logits, [GraphRow(plan.settings, slot=slot, point=point,
                                                       blocked=plan.blocked)])
        except Exception as e:
            if not device_capable(plan.settings):
                raise
            warnings.warn(f"captured sampler failed ({type(e).__name__}: {e}); sampling without it from now on",
                          stacklevel=2)
            use = None
        else:
            token, prob, ok = t.clone(), p.clone(), k.clone()
    if use is None:
        token, prob, ok = sample_rows(logits, [plan], upload_floats([point], logits.device).view(1, 1), tokenizer)
    host, event = read_back(torch.stack([token.double(), prob.double(), ok.double()]).view(3))
    return Pending(token, host, event, state, after, fed_at)


def _get_state(rng: torch.Generator | None) -> torch.Tensor:
    return rng.get_state() if rng is not None else torch.get_rng_state()


def discard(p: Pending, cache: Any, rng: torch.Generator | None) -> None:
    """Undo a step that was one too many: its K/V is not valid and its random number is drawn again."""
    cache.current_seq_len = p.fed_at
    if p.rng_state is not None and torch.equal(_get_state(rng), p.rng_after):
        if rng is not None:
            rng.set_state(p.rng_state)
        else:
            torch.set_rng_state(p.rng_state)
