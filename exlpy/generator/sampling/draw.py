"""Random numbers and the final inverse-CDF draw (spec §8.3 step 4, last item).

exllamav2 walks the candidates adding probabilities until the sum reaches `r · 0.9998`, the 0.9998 guarding
against probabilities that sum to slightly less than 1 after float32 softmax (which otherwise lets r fall past
the end). That shrinks r and slightly biases every draw toward likely tokens. Instead we compare r with the
*actual* running total: target = r · total (total = the row's sum), the drawn index is the first whose
cumulative sum exceeds the target, and a target that rounds to the total is clamped to the last candidate
with non-zero probability. So no token with p = 0 is ever drawn, and the draw is exact for any r in [0, 1).
"""

from __future__ import annotations

import torch

from exlpy.errors import SamplerError

_GOLDEN = 0.6180339887498949  # additive-recurrence step: row i of a batch uses frac(r + i·φ⁻¹)


def uniforms(batch: int, device: torch.device, random: float | None,
             generator: torch.Generator | None) -> torch.Tensor:
    """[B, 1] points in [0, 1). A generator (per job, seeded) wins; else the exllamav2-style float `random`
    (row 0 uses it as is, later rows a well-spread sequence derived from it); else torch's global RNG."""
    if generator is not None:
        r = torch.rand(batch, 1, generator=generator, device=generator.device)
        return r.to(device, non_blocking=True)
    if random is not None:
        if isinstance(random, bool) or not isinstance(random, (int, float)) or not 0.0 <= random < 1.0:
            raise SamplerError(f"sample(): random must be a float in [0, 1), got {random!r}")
        r = torch.tensor([float(random) + i * _GOLDEN for i in range(batch)], dtype=torch.float64)
        return torch.frac(r).float().reshape(batch, 1).to(device, non_blocking=True)
    return torch.rand(batch, 1, device=device)


def draw(probs: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [B, C] (need not be normalised), r [B, 1] -> (index [B, 1] into C, normalised prob [B, 1])."""
    cum = probs.cumsum(-1)
    total = cum[:, -1:]
    idx = torch.searchsorted(cum, r * total, right=True)
    c = probs.shape[-1]
    last_nonzero = (c - 1) - (probs > 0).flip(-1).int().argmax(-1, keepdim=True)
    idx = torch.minimum(idx, last_nonzero)
    return idx, probs.gather(-1, idx) / total
