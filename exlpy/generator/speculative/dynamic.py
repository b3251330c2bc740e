"""Speculative decoding in the dynamic generator: every job of the batch drafted and verified in one step.

A round: drafts for every eligible job (a draft model's greedy tokens, batched, or n-gram lookups), one target
step of T = k+1 tokens per row through the decode graphs (the last known token, then the drafts), verification
on the device (exlpy/generator/speculative/verify.py), and one read-back of what each row accepted. Jobs that
need the host sampler (filters, banned strings, CFG, penalties, min_new_tokens not reached yet, ...) ride
along in the same step: their row is padded to T tokens and they take one token, sampled on the host, from its
first position (grammar masks applied on the device first: a filter's state cannot follow unverified drafts,
so constrained jobs never draft). Padding and rejected drafts leave K/V past a sequence's end, which is never
counted as valid. Every row of the target step carries its job's LoRA slot; the draft model runs without
adapters (verification keeps the output exact either way).

Rounds are synchronous (the accepted counts decide the next input); without anything to draft the generator
uses its overlapped single-token loop instead.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from exlpy.errors import SamplerError
from exlpy.generator.dynamic.decode import BAD_ROW, HostRows, read_back, upload_floats
from exlpy.generator.filters.device import premask_jobs
from exlpy.generator.sampling import graphed
from exlpy.generator.sampling.batched import RowSample, is_greedy
from exlpy.generator.speculative.checks import check_draft
from exlpy.generator.speculative.draft import ModelDrafter
from exlpy.generator.speculative.length import DraftLength
from exlpy.generator.speculative.ngram import NgramIndex
from exlpy.generator.speculative.profile import RoundProfile
from exlpy.generator.speculative.verify import speculation_capable, verify_rows
from exlpy.model.batch import paged_batch, upload_ids

if TYPE_CHECKING:
    from exlpy.generator.dynamic.generator import ExLlamaV2DynamicGenerator
    from exlpy.generator.dynamic.job import ExLlamaV2DynamicJob


class Speculation:
    """The generator's speculative-decoding state: drafter, draft length and statistics."""

    def __init__(self, gen: ExLlamaV2DynamicGenerator, draft_model: Any, draft_cache: Any,
                 num_draft_tokens: int | None, use_ngram_draft: bool, max_ngram: int) -> None:
        check_draft(gen.model, gen.cache, gen.tokenizer, draft_model, draft_cache, num_draft_tokens,
                    use_ngram_draft, gen.max_q_size, paged=True)
        self.gen = gen
        vocab = len(gen.pieces)
        self.drafter = ModelDrafter(draft_model, draft_cache, gen.page_size, vocab) if draft_model else None
        self.max_ngram = max_ngram
        self.preloaded = NgramIndex(max_ngram)
        max_k = gen.max_q_size - 1
        cost = self.drafter.cost(gen.model) if self.drafter else 0.0
        self.length = DraftLength(num_draft_tokens, max_k, cost)
        self.profile: RoundProfile | None = None  # set to time each round's phases (benchmarks)
        self.reset_stats()

    def reset_stats(self) -> None:
        self.tokens = self.drafted = self.accepted = self.rounds = 0
        self.rejections = 0  # rows whose drafts a rejection cut short
        self.row_rounds = 0  # rows drafted for, summed over rounds

    def stats(self) -> tuple[float, float, int, int, int]:
        """(efficiency, accuracy, tokens, drafted, accepted): efficiency = share of all generated tokens that
        were accepted drafts, accuracy = accepted / drafted."""
        return (self.accepted / max(self.tokens, 1), self.accepted / max(self.drafted, 1), self.tokens,
                self.drafted, self.accepted)

    def acceptance_per_token(self) -> float:
        """The chance that a draft is accepted once the drafts before it were: accepted / (accepted +
        rejections). Unlike accepted / drafted it does not fall with the draft length (at a rate a and k drafts,
        accepted / drafted is (a + a^2 + ... + a^k) / k)."""
        return self.accepted / max(self.accepted + self.rejections, 1)

    def mean_draft_length(self) -> float:
        return self.drafted / max(self.row_rounds, 1)

    # --- prefill hooks (the draft model's cache follows the target's) -------------------------------------
    def on_prefill(self, q: Any, start: int, end: int) -> None:
        if self.drafter is not None:
            self.drafter.prefill(q, start, end)

    def on_cached(self, q: Any) -> None:
        """Positions served from cached pages: the draft's K/V for them was written alongside the target's."""
        q.draft_kv = max(q.draft_kv, q.prefill_pos)

    def on_copy(self, src: int, dst: int, n: int) -> None:
        if self.drafter is not None:
            c = self.drafter.cache
            c.copy_states(c, src, n, dst, n, 0, 1, 0, 1)

    # --- rounds -----------------------------------------------------------------------------------------
    def plan_row(self, job: ExLlamaV2DynamicJob) -> RowSample | None:
        plan = None if job.filters else job.device_sampling()
        if plan is None or plan.blocked or not speculation_capable(plan.settings):
            return None
        return plan

    def ngram_of(self, job: ExLlamaV2DynamicJob) -> NgramIndex:
        index = getattr(job, "ngram", None)
        seq = job.sequence.tolist()
        if index is None:
            index = job.ngram = NgramIndex(self.max_ngram, base=self.preloaded)  # type: ignore[attr-defined]
        index.truncate(len(seq))
        index.extend(seq[len(index.tokens):])
        return index

    def plan(self, jobs: list[ExLlamaV2DynamicJob]) -> tuple[int, dict[Any, tuple[RowSample, list[int]]]] | None:
        """(k, {job: (sampling, n-gram drafts)}) for this round, or None to decode without speculation."""
        self.length.tick()
        k = self.length.choose()
        room = min(self.gen.max_seq_len - j.sequence.numel() for j in jobs)  # positions past the last token
        k = min(k, room)
        spec: dict[Any, tuple[RowSample, list[int]]] = {}
        for j in jobs:
            plan = self.plan_row(j)
            if plan is not None:
                spec[j] = (plan, self.ngram_of(j).propose(k) if self.drafter is None else [])
        if self.drafter is None:
            k = max((len(d) for _, d in spec.values()), default=0)
        if k < 1 or not spec:
            return None
        return k, spec

    def run(self, jobs: list[ExLlamaV2DynamicJob], k: int, spec: dict[Any, tuple[RowSample, list[int]]],
            results: list[dict[str, Any]]) -> None:
        t0 = time.perf_counter()
        gen = self.gen
        dev = gen.device()
        prof = self.profile
        if prof is not None:
            prof.begin(k, dev)
        T = k + 1
        rows = [(j, q) for j in jobs for q in j.seqs]
        lengths = [q.ids.numel() for _, q in rows]
        spec_rows = [i for i, (j, _) in enumerate(rows) if j in spec]
        ids = torch.stack([q.ids[-1:].expand(T) for _, q in rows])  # padding repeats the last token
        real: list[int] = []
        for i in spec_rows:
            d = spec[rows[i][0]][1][:k]
            real.append(k if self.drafter is not None else len(d))
            ids[i, 1:1 + len(d)] = torch.tensor(d, dtype=torch.long)
        ids_dev = upload_ids(ids, dev)
        index = upload_ids(torch.tensor(spec_rows, dtype=torch.long), dev)
        if prof is not None:
            prof.mark()
        timer = _DraftTimer(self.drafter.device()) if self.drafter is not None else None
        if self.drafter is not None:
            drafts = self.drafter.propose([rows[i][1] for i in spec_rows], k, dev)
            ids_dev[index, 1:] = drafts
        else:
            drafts = ids_dev.index_select(0, index)[:, 1:]
        if timer is not None:
            timer.stop()
        if prof is not None:
            prof.mark()
        batch = paged_batch([(q.page_ids(), q.ids.numel() - 1, T) for _, q in rows], gen.cache, dev, gen.page_size,
                            [j.lora_slot for j, _ in rows])
        logits = gen.model.forward_batch(ids_dev, batch)  # [B, T, V]
        gen.decode_tokens += len(rows) * T
        if prof is not None:
            prof.mark()
        # The logits come from the last stage's device (a layer split ends on another GPU than it starts on):
        # verification runs there, next to them.
        dev = logits.device
        index, drafts = index.to(dev, non_blocking=True), drafts.to(dev, non_blocking=True)
        plans = [spec[rows[i][0]][0] for i in spec_rows]
        u, r = [], []
        for i, p in zip(spec_rows, plans):
            pts = [0.5] * (k + T) if is_greedy(p.settings) else \
                torch.rand(k + T, generator=rows[i][0].rng).tolist()
            u.append(pts[:k])
            r.append(pts[k:])
        u_dev = upload_floats([x for row in u for x in row], dev).view(len(spec_rows), k)
        r_dev = upload_floats([x for row in r for x in row], dev).view(len(spec_rows), T)
        spec_logits = logits.index_select(0, index)
        sampler = gen.stepper.graph_sampler(logits)
        if sampler is not None and all(graphed.verify_capable(p.settings, logits.shape[-1]) and not p.blocked
                                       for p in plans):
            m, tok = sampler.verify(spec_logits, drafts, [p.settings for p in plans], u, r)  # one graph replay
            m, tok = m.clone(), tok.clone()
        else:
            m, tok = verify_rows(spec_logits, drafts, plans, u_dev, r_dev, gen.tokenizer)
        ok = torch.isfinite(spec_logits.amax(-1)).all(-1)  # NaN / +inf logits: the row fails (sampling/guard.py)
        if prof is not None:
            prof.mark()
        host, event = read_back(torch.cat([m, tok, ok.long(), drafts.reshape(-1)]))
        if event is not None:
            event.synchronize()
        if prof is not None:
            prof.synced()
        vals = host.tolist()
        n = len(spec_rows)
        m_h, tok_h, ok_h, d_h = vals[:n], vals[n:2 * n], vals[2 * n:3 * n], vals[3 * n:]
        self.rounds += 1
        rejections = accepted_real = 0
        for s, i in enumerate(spec_rows):
            job, q = rows[i]
            if not ok_h[s]:
                gen.fail(job, SamplerError(BAD_ROW), results)
                continue
            emitted = [int(t) for t in d_h[s * k:s * k + m_h[s]]] + [int(tok_h[s])]
            acc = min(m_h[s], real[s])
            accepted_real += acc
            rejections += acc < real[s]
            self.drafted += real[s]
            self.accepted += acc
            self.rejections += acc < real[s]
            self.row_rounds += 1
            job.drafted_tokens += real[s]
            job.accepted_draft_tokens += acc
            if self.drafter is not None:
                ModelDrafter.accepted(q, lengths[i], m_h[s], k)
            for t in emitted:
                if job.finished:
                    break
                gen.guard(job, results, lambda j=job, t=t: gen.accept(j, t, {}, False, results))
        self.length.update(accepted_real, rejections)
        others = [j for j in jobs if j not in spec]
        if others:
            first = {id(j): next(i for i, (jj, _) in enumerate(rows) if jj is j) for j in others}
            firsts = [first[id(j)] for j in others]
            gen.stepper.sample_host(HostRows(others, firsts, premask_jobs(others, firsts, logits[:, 0])), results)
        if timer is not None:
            self.length.observe(k, timer.seconds(), time.perf_counter() - t0)
        if prof is not None:
            prof.end()


class _DraftTimer:
    """How long a round's draft steps took: host time, or on a GPU the device time between two events when
    that is longer (the host only launches the steps). Read after the round's one sync: no wait of its own."""

    def __init__(self, device: torch.device) -> None:
        self.t0 = time.perf_counter()
        self.host = 0.0
        self.events: tuple[Any, Any] | None = None
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        if self.stream is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            self.events = (start, end)

    def stop(self) -> None:
        self.host = time.perf_counter() - self.t0
        if self.events is not None:
            self.events[1].record(self.stream)

    def seconds(self) -> float:
        if self.events is None or not self.events[1].query():
            return self.host
        return max(self.host, self.events[0].elapsed_time(self.events[1]) / 1000.0)
