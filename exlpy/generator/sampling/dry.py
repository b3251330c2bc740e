"""DRY ("don't repeat yourself") penalty (spec §8.3, bottom), vectorised in torch.

Semantics: let L be the longest suffix of the context (at most max_ngram - 1 tokens, containing no sequence
breaker) that also occurred earlier and was followed there by a non-breaker token (n-grams never span
breakers, as in exllamav2's trie of n-grams of at most max_ngram tokens). If L >= allowed_length, each
token t that followed an earlier occurrence of that suffix gets
    -multiplier · base^(L - allowed_length) · count(t)
added, count(t) being how many of those occurrences t followed.

Instead of a trie, for every earlier end position j we compute the match length m_j of the context ending
at j against the suffix: eq[k, j] = (c[j-k] == c[n-1-k]) & c[n-1-k] not a breaker, m_j = sum_k cumprod_k eq.
That is O(B · n · K) time and memory with K = max_ngram - 1 (K = 19 by default: ~600k bools for a 32k
context), fully on device, no host sync; `dry_range` bounds n.
"""

from __future__ import annotations

import torch


def dry_penalty(sequence_ids: torch.Tensor, vocab: int, breakers: torch.Tensor, multiplier: float,
                base: float, allowed_length: int, max_ngram: int) -> torch.Tensor:
    """sequence_ids [B, n], breakers bool [vocab] -> additive penalty [B, vocab] (float32, <= 0)."""
    batch, n = sequence_ids.shape
    device = breakers.device
    out = torch.zeros(batch, vocab, device=device)
    k_max = min(max_ngram - 1, n - 1)
    if n < 2 or k_max < allowed_length:
        return out
    seq = sequence_ids.to(device, non_blocking=True).long()
    in_vocab = (seq >= 0) & (seq < vocab)
    is_breaker = breakers[seq.clamp(0, vocab - 1)] | ~in_vocab  # unknown ids (embeddings) break n-grams too
    ends = torch.arange(n - 1, device=device)  # earlier end positions j, continuation at j + 1
    ks = torch.arange(k_max, device=device)
    src = ends[None, :] - ks[:, None]  # [K, n-1] position compared with suffix position n-1-k
    earlier = seq[:, src.clamp(min=0)]  # [B, K, n-1]
    suffix = seq[:, n - 1 - ks]  # [B, K]
    eq = (earlier == suffix[:, :, None]) & (src >= 0)[None] & ~is_breaker[:, n - 1 - ks][:, :, None]
    match = eq.long().cumprod(dim=1).sum(dim=1)  # [B, n-1]
    cont = seq[:, 1:]
    match = torch.where(is_breaker[:, 1:], torch.zeros_like(match), match)
    longest = match.amax(dim=1, keepdim=True)  # [B, 1]
    hit = (match == longest) & (longest >= allowed_length)
    scale = -multiplier * torch.pow(torch.full_like(longest, base, dtype=torch.float32),
                                    (longest - allowed_length).float())
    out.scatter_add_(1, cont.clamp(0, vocab - 1), hit.float() * scale)
    return out
