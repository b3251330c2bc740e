"""Speculative verification: which drafted tokens the target accepts, and the token it adds.

A row holds k drafted tokens d_1..d_k and the target's logits at k+1 positions (after the last known token
and after each draft). Drafts are deterministic (a draft model's argmax, an n-gram lookup), so the draft
distribution q is a point mass and the standard rejection rule becomes: at position i accept d_{i+1} with
probability p_i(d_{i+1}), where p_i is the distribution the target's sampler would draw from (temperature,
top-k/top-p/min-p ... applied); at the first rejection draw from p_i with d_{i+1} removed (the normalised
max(0, p - q)); if all k are accepted draw a bonus token from p_k. Every emitted token is then distributed
exactly as the target's sampler would produce it. For greedy settings p_i is a point mass on the argmax: the
drafts are accepted while they equal the argmax and the first mismatch is replaced by it.

Everything runs on the logits' device without host syncs; each row's random numbers come from its job's
generator (the caller draws them), so seeded runs repeat.
"""

from __future__ import annotations

from typing import Any

import torch

from exlpy.generator.sampling import chain
from exlpy.generator.sampling.batched import RowSample, _plain, _row_parts, group_key
from exlpy.generator.sampling.draw import draw
from exlpy.model.batch import upload_ids


def speculation_capable(s: Any) -> bool:
    """Settings whose sampling distribution `final_distribution` describes exactly (skew bends the draw)."""
    from exlpy.generator.sampling.batched import device_capable

    return device_capable(s) and s.skew == 0.0


def verify_group(probs: torch.Tensor, ids: torch.Tensor, drafts: torch.Tensor, u: torch.Tensor,
                 r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """probs/ids [G, T, C] (candidates per position), drafts [G, k] (k = T - 1), u [G, k] acceptance points,
    r [G, T] draw points. Returns (accepted count m [G], the token the target adds [G])."""
    G, T, C = probs.shape
    k = T - 1
    total = probs.sum(-1)  # [G, T]
    if k:
        hit = ids[:, :k] == drafts[:, :, None]  # [G, k, C]
        p_draft = (probs[:, :k] * hit).sum(-1) / total[:, :k]
        accepted = (u < p_draft).long()
        m = accepted.cumprod(-1).sum(-1)  # leading accepted drafts
    else:
        m = torch.zeros(G, dtype=torch.long, device=probs.device)
    at = m.view(G, 1, 1).expand(G, 1, C)
    pm = probs.gather(1, at).squeeze(1)  # [G, C]: the distribution at the first rejection (or the bonus)
    im = ids.gather(1, at).squeeze(1)
    if k:
        rejected = drafts.gather(1, m.clamp(max=k - 1).view(G, 1))  # [G, 1]
        residual = torch.where((m < k).view(G, 1) & (im == rejected), torch.zeros_like(pm), pm)
        # A draft rejected only by float rounding (p == 1) leaves nothing: keep the distribution (it is the draft).
        pm = torch.where(residual.sum(-1, keepdim=True) > 0, residual, pm)
    idx, _ = draw(pm, r.gather(1, m.view(G, 1)))
    return m, im.gather(-1, idx).view(G)


def verify_rows(logits: torch.Tensor, drafts: torch.Tensor, rows: list[RowSample], u: torch.Tensor,
                r: torch.Tensor, tokenizer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, T, V] of B rows, drafts [B, T-1], rows[i] the sampling of row i, u [B, T-1], r [B, T]
    (on the logits' device). Returns (accepted counts [B], added tokens [B]), on the device."""
    from exlpy.generator.sampler import final_distribution

    B, T, V = logits.shape
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(group_key(row.settings), []).append(i)
    m_out = torch.empty(B, dtype=torch.long, device=logits.device)
    t_out = torch.empty(B, dtype=torch.long, device=logits.device)
    for key, members in groups.items():
        idx = None if len(members) == B else upload_ids(torch.tensor(members, dtype=torch.long), logits.device)

        def sel(t: torch.Tensor, idx: torch.Tensor | None = idx) -> torch.Tensor:
            return t if idx is None else t.index_select(0, idx)

        x = sel(logits).reshape(len(members) * T, V).float()
        x = _row_parts(x, [rows[i] for i in members for _ in range(T)])
        settings = _plain(rows[members[0]].settings, key)
        probs, ids, _, _ = final_distribution(x, settings, chain.LogitContext(None, tokenizer), tokenizer)
        C = probs.shape[-1]
        m, tok = verify_group(probs.view(len(members), T, C), ids.view(len(members), T, C), sel(drafts), sel(u),
                              sel(r))
        if idx is None:
            return m, tok
        m_out.index_copy_(0, idx, m)
        t_out.index_copy_(0, idx, tok)
    return m_out, t_out
