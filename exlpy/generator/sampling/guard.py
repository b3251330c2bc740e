"""Degenerate distributions: logits with NaN or +inf, rows where every token is -inf, and rows that the
sampler's own masks (filters, token healing, vocab limit) or a NaN-producing setting leave with no token.

Drawing from such a row returns an arbitrary token, so the sampler raises a SamplerError instead. The checks
are device-side flags (one reduction per stage, no host sync); a bad row is replaced by zeros so the later
steps stay well defined, and `raise_if_bad` reads all flags in the sampler's one host sync, at the end.
"""

from __future__ import annotations

import torch

from exlpy.errors import SamplerError

STAGES = ("the logits passed in", "the logit stage (penalties, bias, DRY, filters, healing, vocab limit)",
          "the final distribution")


def usable(x: torch.Tensor) -> torch.Tensor:
    """[B] bool: the row has no NaN and no +inf and at least one finite logit (its max is finite)."""
    return torch.isfinite(x.amax(-1))


def neutralize(x: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """Bad rows as zeros (later steps then see a valid uniform row; the error is raised at the end)."""
    return x.masked_fill(~ok.unsqueeze(-1), 0.0)


def distribution_ok(probs: torch.Tensor) -> torch.Tensor:
    """[B] bool: the candidates' probabilities sum to a finite positive total."""
    total = probs.sum(-1)
    return torch.isfinite(total) & (total > 0)


def raise_if_bad(flags: list[torch.Tensor]) -> None:
    """flags: one [B] bool per stage (STAGES order). One host read; SamplerError naming stage and row."""
    ok = torch.stack([f.reshape(-1) for f in flags])
    if bool(ok.all()):
        return
    table = ok.cpu().tolist()
    for stage, row_flags in zip(STAGES, table):
        if not all(row_flags):
            row = row_flags.index(False)
            if stage == STAGES[0]:
                what = "hold NaN or +inf, or are all -inf"
            else:
                what = "leave no token with a finite, positive probability"
            raise SamplerError(f"sample(): {stage} {what} (row {row}); the model output is broken or every "
                               "token was excluded")
