"""Speculative decoding in the streaming generator (one sequence, contiguous caches).

A round drafts k tokens (the draft model's greedy tokens, each step fed from the device; or n-grams of the
sequence and `ngram_preload`), drops drafts from the first one the draft model itself gave less than
`speculative_prob_threshold` (exllamav2's rule), runs the target once over the last token plus the drafts,
and keeps what verification accepts (exlpy/generator/speculative/verify.py) plus the target's own token. The
caches are then cut back to the accepted tokens: `cache.current_seq_len == len(sequence) - 1` as between
ordinary steps, and the draft cache holds the positions its drafts got right.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from exlpy.generator.dynamic.decode import read_back, upload_floats
from exlpy.generator.sampling.batched import RowSample, is_greedy
from exlpy.generator.sampling.graphed import verify_capable
from exlpy.generator.speculative.draft import weight_bytes
from exlpy.generator.speculative.length import DraftLength
from exlpy.generator.speculative.ngram import NgramIndex
from exlpy.generator.speculative.verify import verify_rows
from exlpy.model.batch import upload_ids


class StreamSpeculation:
    def __init__(self, model: Any, cache: Any, draft_model: Any, draft_cache: Any, num_tokens: int | None,
                 max_k: int, vocab: int) -> None:
        self.model, self.model_cache, self.vocab = model, cache, vocab
        self.draft_model, self.draft_cache = draft_model, draft_cache
        cost = 0.0
        if draft_model is not None:
            cost = min(1.0, weight_bytes(draft_model) / max(weight_bytes(model), 1) + 0.03)
        self.length = DraftLength(num_tokens, max_k, cost)
        self.draft_kv = 0  # positions of the current sequence the draft cache holds
        self.index: NgramIndex | None = None

    def reset_sequence(self, reused: int) -> None:
        """A new stream whose first `reused` positions are unchanged in the caches."""
        self.draft_kv = min(self.draft_kv, reused)
        self.index = None

    def ngram_drafts(self, seq: list[int], k: int, max_ngram: int, min_ngram: int, threshold: int,
                     preload: NgramIndex | None) -> list[int]:
        if self.index is None or self.index.tokens != seq[:len(self.index.tokens)]:
            self.index = NgramIndex(max_ngram, min_ngram, threshold, base=preload)
        self.index.extend(seq[len(self.index.tokens):])
        return self.index.propose(k)

    def model_drafts(self, seq: torch.Tensor, k: int, threshold: float) -> list[int]:
        """k greedy draft tokens after `seq` [1, L], cut where the draft's own probability falls below
        `threshold` (at least one is kept)."""
        L = seq.shape[1]
        dc = self.draft_cache
        self.draft_kv = min(self.draft_kv, L - 1)
        dc.current_seq_len = self.draft_kv
        logits = self.draft_model.forward(seq[:, self.draft_kv:], dc)[:, -1, :self.vocab].float()
        toks, probs = [], []
        for step in range(k):
            p = torch.softmax(logits, -1).max(-1)
            toks.append(p.indices.view(1))
            probs.append(p.values.view(1))
            if step + 1 < k:
                logits = self.draft_model.forward(p.indices.view(1, 1), dc)[:, -1, :self.vocab].float()
        packed = torch.cat([torch.cat(toks).double(), torch.cat(probs).double()])
        host, event = read_back(packed)
        if event is not None:
            event.synchronize()
        vals = host.tolist()
        drafts, pr = [int(t) for t in vals[:k]], vals[k:]
        keep = next((j for j in range(1, k) if pr[j] < threshold), k)
        self.draft_kv = L + k - 1  # provisional: `accepted()` keeps what verification confirmed
        return drafts[:keep]

    def verify(self, seq: torch.Tensor, drafts: list[int], plan: RowSample, rng: torch.Generator | None,
               tokenizer: Any, loras: Any = None, graph: Any = None) -> tuple[int, list[int]]:
        """Target step over the last token and the drafts (with the stream's LoRA adapters; the draft model
        has none); returns (accepted drafts m, emitted tokens). `graph(logits)`: the stream's captured sampler
        (exlpy/generator/sampling/graphed.py) that verifies in one graph replay, or None."""
        cache = self.model_cache
        L = seq.shape[1]
        k = len(drafts)
        cache.current_seq_len = L - 1
        ids = torch.tensor([[int(seq[0, -1])] + drafts], dtype=torch.long)
        logits = self.model.forward(ids, cache, loras=loras or None).float()  # [1, k+1, V]
        dev = logits.device
        pts = [0.5] * (2 * k + 1) if is_greedy(plan.settings) else torch.rand(2 * k + 1, generator=rng).tolist()
        u = upload_floats(pts[:k], dev).view(1, k)
        r = upload_floats(pts[k:], dev).view(1, k + 1)
        sampler = graph(logits) if graph is not None else None
        d_dev = upload_ids(torch.tensor([drafts]), dev)
        if sampler is not None and verify_capable(plan.settings, logits.shape[-1]) and not plan.blocked:
            m, tok = sampler.verify(logits, d_dev, [plan.settings], [pts[:k]], [pts[k:]])
        else:
            m, tok = verify_rows(logits, d_dev, [plan], u, r, tokenizer)
        host, event = read_back(torch.cat([m, tok]))
        if event is not None:
            event.synchronize()
        m_h, tok_h = (int(x) for x in host.tolist())
        cache.current_seq_len = L + m_h  # K/V of the last token and the accepted drafts
        if self.draft_model is not None:
            self.draft_kv = min(self.draft_kv, L + min(m_h, k - 1))
        rejections = 1 if m_h < k else 0
        self.length.update(m_h, rejections)
        return m_h, drafts[:m_h] + [tok_h]


def speculative_round(gen: Any, plan: RowSample) -> dict[str, Any] | None:
    """One speculative round of an `ExLlamaV2StreamingGenerator` stream (filters, banned strings and CFG never
    get here: their streams step one token at a time); None when nothing was drafted."""
    from exlpy.generator.dynamic.stops import Released

    seq = gen.sequence_ids
    assert seq is not None
    room = gen.cache.max_seq_len - seq.shape[1]
    if gen.token_budget is not None:
        room = min(room, gen.token_budget - 1)  # the round adds one token besides the accepted drafts
    spec: StreamSpeculation = gen.spec
    if gen.draft_model is not None:
        spec.length.tick()
        k = min(spec.length.choose(), room, gen.draft_cache.max_seq_len - seq.shape[1])
    else:
        k = min(gen.num_speculative_tokens or gen.speculative_ngram_max_inf, room)
    if k < 1:
        return None
    gen._discard()
    t0 = time.perf_counter()
    if gen.draft_model is not None:
        drafts = spec.model_drafts(seq, k, gen.speculative_prob_threshold)  # read back: the draft is done
    else:
        drafts = spec.ngram_drafts(seq[0].tolist(), k, gen.speculative_ngram_max, gen.speculative_ngram_min,
                                   gen.speculative_ngram_threshold, getattr(gen, "_preload", None))
    if not drafts:
        return None
    t1 = time.perf_counter()
    m, emitted = spec.verify(seq, drafts, plan, gen.rng, gen.tokenizer, gen.loras, gen._verify_sampler)
    if gen.draft_model is not None:  # the draft model ran k steps, also when fewer drafts were kept
        spec.length.observe(k, t1 - t0, time.perf_counter() - t0)
    gen.total_draft_tokens += len(drafts)
    gen.accepted_draft_tokens += m
    out = Released()
    for t in emitted:
        rel = gen._feed(t, {})
        out.text += rel.text
        out.tokens += rel.tokens
        out.payloads += rel.payloads
        if rel.eos:
            out.eos, out.eos_reason, out.trigger = True, rel.eos_reason, rel.trigger
            break
    assert gen.sequence_ids is not None
    gen.cache.current_seq_len = min(gen.cache.current_seq_len, gen.sequence_ids.shape[1] - 1)
    return gen._result(out)
