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

A round's accepted counts decide the next round's input, so each round ends in one sync (the read-back). What
the host then does with the tokens (append them, detokenize, check stop conditions, build results, return to the
caller, admit and plan) used to leave the GPU idle until the next round's first draft step. Now `finish` launches
the next round first (`_chain`) wherever that work cannot change it: its inputs are the sequences with the new
tokens appended (`_Ahead`; n-gram drafts are looked up in them), its pages are taken at once, and the draft length
is chosen from the updated estimate.
The next `iterate()` finishes that round (`resume`) unless a job of it ended or changed meanwhile (then the round
is dropped: its cache writes lie past the sequences' valid ends, and the draft cache's extent is restored). Within
a round nothing waits for the host: the draft's argmax feeds its next step on the device, the verification step
follows the drafts, verification is one captured graph, and the read-back is the only sync.
Without anything to draft the generator uses its overlapped single-token loop instead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
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
        # Launch the next round before a round's bookkeeping where that is safe (`_chain`). Off by default: on an
        # H100 (8B + 1B replay draft at 0.8, 2026-11-26 21:32) rounds were 1.1 ms shorter (gap between rounds 0.53 ->
        # 0.30 ms) but the run ahead drew a lower acceptance (0.74 vs 0.79) and shorter drafts: 1.40x plain against
        # 1.61x. Whether that acceptance is the chain's doing or one run's chance is not settled.
        self.chain = False
        self.ahead: _Launched | None = None  # a round launched so, not yet finished
        self.reset_stats()

    def reset_stats(self) -> None:
        self.tokens = self.drafted = self.accepted = self.rounds = 0
        self.rejections = 0  # rows whose drafts a rejection cut short
        self.row_rounds = 0  # rows drafted for, summed over rounds
        self.rounds_ahead = 0  # rounds launched ahead of the bookkeeping of the round before (`_chain`)
        self.ahead_failed = 0  # launches ahead that raised (the round was then planned and run as usual)
        self.ahead_void = 0  # rounds launched ahead and dropped (a job ended or changed before they were read)

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

    def ngram_of(self, job: ExLlamaV2DynamicJob, seq: list[int] | None = None) -> NgramIndex:
        """The job's n-gram index over its sequence (or `seq`: the sequence a round launched ahead continues)."""
        index = getattr(job, "ngram", None)
        seq = job.sequence.tolist() if seq is None else seq
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
        """One round: launch it, wait for its read-back, accept its tokens (possibly launching the next one
        first: `ahead`)."""
        self.finish(self.launch(jobs, k, spec), results)

    def launch(self, jobs: list[ExLlamaV2DynamicJob], k: int, spec: dict[Any, tuple[RowSample, list[int]]],
               ahead: dict[int, _Ahead] | None = None) -> _Launched:
        """Launch a round's device work (drafts, the target's step, verification, the read-back's copy) without
        waiting for any of it. `ahead`: the sequences as the round before will leave them (by id of the
        sequence), for a round launched before that round's tokens are accepted."""
        t0 = time.perf_counter()
        gen = self.gen
        dev = gen.device()
        prof = self.profile
        pr = prof.begin(k, dev, chained=ahead is not None) if prof is not None else None
        T = k + 1
        rows = [(j, q) for j in jobs for q in j.seqs]
        seqs = [ahead[id(q)] if ahead is not None else q for _, q in rows]  # what this round continues
        lengths = [s.ids.numel() for s in seqs]
        spec_rows = [i for i, (j, _) in enumerate(rows) if j in spec]
        ids = torch.stack([s.ids[-1:].expand(T) for s in seqs])  # padding repeats the last token
        real: list[int] = []
        for i in spec_rows:
            d = spec[rows[i][0]][1][:k]
            real.append(k if self.drafter is not None else len(d))
            ids[i, 1:1 + len(d)] = torch.tensor(d, dtype=torch.long)
        ids_dev = upload_ids(ids, dev)
        index = upload_ids(torch.tensor(spec_rows, dtype=torch.long), dev)
        if pr is not None:
            prof.mark(pr)  # type: ignore[union-attr]
        timer = _DraftTimer(self.drafter.device()) if self.drafter is not None else None
        if self.drafter is not None:
            drafts = self.drafter.propose([seqs[i] for i in spec_rows], k, dev)
            ids_dev[index, 1:] = drafts
        else:
            drafts = ids_dev.index_select(0, index)[:, 1:]
        if timer is not None:
            timer.stop()
        if pr is not None:
            prof.mark(pr)  # type: ignore[union-attr]
        batch = paged_batch([(s.page_ids(), s.ids.numel() - 1, T) for s in seqs], gen.cache, dev, gen.page_size,
                            [j.lora_slot for j, _ in rows])
        logits = gen.model.forward_batch(ids_dev, batch)  # [B, T, V]
        gen.decode_tokens += len(rows) * T
        if pr is not None:
            prof.mark(pr)  # type: ignore[union-attr]
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
        if pr is not None:
            prof.mark(pr)  # type: ignore[union-attr]
        host, event = read_back(torch.cat([m, tok, ok.long(), drafts.reshape(-1)]))
        if pr is not None:
            prof.launched(pr)  # type: ignore[union-attr]
        others = [j for j in jobs if j not in spec]
        return _Launched(jobs, k, spec, rows, lengths, spec_rows, real, others, logits if others else None, host,
                         event, timer, t0, [j.epoch for j in jobs], pr)

    def finish(self, rnd: _Launched, results: list[dict[str, Any]]) -> None:
        """Wait for a launched round's read-back (the round's one sync) and accept its tokens. Where the next
        round can be known from the tokens alone, it is launched first (`_chain`), so the device runs it while
        the host does this round's bookkeeping and the generator's caller handles the results."""
        gen, prof, pr = self.gen, self.profile, rnd.prof
        if prof is not None and pr is not None:
            prof.waiting(pr)
        if rnd.event is not None:
            rnd.event.synchronize()
        synced = time.perf_counter()
        if prof is not None and pr is not None:
            prof.synced(pr)
        vals = rnd.host.tolist()
        k, rows, spec_rows, real = rnd.k, rnd.rows, rnd.spec_rows, rnd.real
        n = len(spec_rows)
        m_h, tok_h, ok_h, d_h = vals[:n], vals[n:2 * n], vals[2 * n:3 * n], vals[3 * n:]
        self.rounds += 1
        self.rounds_ahead += rnd.prev_synced > 0.0
        rejections = accepted_real = 0
        emitted: dict[int, list[int]] = {}  # row -> tokens the round adds
        for s, i in enumerate(spec_rows):
            job, q = rows[i]
            if not ok_h[s]:
                continue
            emitted[i] = [int(t) for t in d_h[s * k:s * k + m_h[s]]] + [int(tok_h[s])]
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
                ModelDrafter.accepted(q, rnd.lengths[i], m_h[s], k)
        self.length.update(accepted_real, rejections)
        t_chain = time.perf_counter()
        nxt = self._chain(rnd, emitted, synced) if len(emitted) == len(rows) else None
        t_chain = time.perf_counter() - t_chain
        for i in spec_rows:
            job, _ = rows[i]
            if i not in emitted:
                gen.fail(job, SamplerError(BAD_ROW), results)
                continue
            for t in emitted[i]:
                if job.finished:
                    break
                gen.guard(job, results, lambda j=job, t=t: gen.accept(j, t, {}, False, results))
        if rnd.others:
            first = {id(j): next(i for i, (jj, _) in enumerate(rows) if jj is j) for j in rnd.others}
            firsts = [first[id(j)] for j in rnd.others]
            assert rnd.logits is not None
            gen.stepper.sample_host(HostRows(rnd.others, firsts, premask_jobs(rnd.others, firsts,
                                                                               rnd.logits[:, 0])), results)
        if rnd.timer is not None:
            # A round launched ahead takes the time between two read-backs (what each round adds in a chain);
            # another one its own time, less launching the next.
            seconds = synced - rnd.prev_synced if rnd.prev_synced else time.perf_counter() - rnd.t0 - t_chain
            self.length.observe(k, rnd.timer.seconds(), seconds)
        if prof is not None and pr is not None:
            prof.end(pr, t_chain if nxt is not None else 0.0)
        if nxt is not None:
            if self.valid(nxt):
                self.ahead = nxt
            else:  # a job ended (a stop condition) or was rolled back in the bookkeeping: the round is void
                self.discard(nxt)

    # --- rounds launched ahead ----------------------------------------------------------------------------
    def _chain(self, rnd: _Launched, emitted: dict[int, list[int]], synced: float) -> _Launched | None:
        """Launch the round after `rnd` before `rnd`'s tokens are accepted, where nothing the host does in
        between can change it: every row drafting (no host-sampled rows, none failed), no job waiting to be
        admitted or running outside the round, each job continuing by count and its sampling unchanged by the
        new tokens (min_new_tokens reached), the cache pages at hand (no preemption), and the draft length still
        above 0 (n-gram drafts: some proposal). A job that a stop condition ends in the bookkeeping voids the
        round (`finish` discards it: its cache writes lie past the job's end)."""
        gen = self.gen
        if (not self.chain or rnd.others or gen.pending
                or len(gen.active) != len(rnd.jobs) or any(j not in gen.active for j in rnd.jobs)):
            return None
        new: dict[int, int] = {}  # job id -> tokens the round adds
        for i, (job, _) in enumerate(rnd.rows):
            new[id(job)] = len(emitted[i])
        room = gen.max_seq_len
        for job in rnd.jobs:
            e = new[id(job)]
            if (job.finished or job.inflight or job.new_tokens < job.min_new_tokens
                    or job.new_tokens + e >= job.max_new_tokens):
                return None
            room = min(room, min(gen.max_seq_len - (q.ids.numel() + e) for q in job.seqs))
        k = min(self.length.choose(), room)
        if k < 1:
            return None
        ahead = {id(q): _Ahead(q, emitted[i]) for i, (_, q) in enumerate(rnd.rows)}
        drafts: dict[Any, list[int]] = {j: [] for j in rnd.jobs}
        if self.drafter is None:  # n-grams: proposals from each sequence with the round's tokens
            for j in rnd.jobs:
                drafts[j] = self.ngram_of(j, ahead[id(j.seqs[0])].ids.tolist()).propose(k)
            k = max(len(d) for d in drafts.values())
            if k < 1:
                return None
        table = gen.page_table
        want = [(job, q, q.pages_for(q.ids.numel() + new[id(job)] + k)) for job in rnd.jobs for q in job.seqs]
        if sum(max(0, n - len(q.pages)) for _, q, n in want) > table.num_unreferenced():
            return None
        for job, q, n in want:
            if n > len(q.pages):
                table.grow(q.pages, n, job.serial or 0)
        self.length.tick()  # a planning, as `plan` counts them
        saved = {id(q): q.draft_kv for _, q in rnd.rows}
        spec = {j: (rnd.spec[j][0], drafts[j]) for j in rnd.jobs}
        try:
            nxt = self.launch(rnd.jobs, k, spec, ahead)
        except Exception:
            self.ahead_failed += 1
            if self.profile is not None and self.profile.rounds and self.profile.rounds[-1].chained:
                self.profile.drop(self.profile.rounds[-1])
            return None  # the next round, planned as usual, meets the fault where the generator handles it
        for _, q in rnd.rows:
            q.draft_kv = ahead[id(q)].draft_kv
        nxt.expected = [a.ids.numel() for a in ahead.values()]
        nxt.saved_kv = list(saved.values())
        nxt.prev_synced = synced
        return nxt

    def valid(self, rnd: _Launched) -> bool:
        """Whether a round launched ahead still continues its jobs as they are now."""
        gen = self.gen
        return all(j in gen.active and not j.finished and j.epoch == e for j, e in zip(rnd.jobs, rnd.epochs)) \
            and [q.ids.numel() for _, q in rnd.rows] == rnd.expected

    def discard(self, rnd: _Launched) -> None:
        """Drop a round launched ahead: the draft cache holds again what it held before it."""
        self.ahead_void += 1
        for (_, q), kv in zip(rnd.rows, rnd.saved_kv):
            q.draft_kv = min(kv, q.ids.numel() - 1)
        if self.profile is not None and rnd.prof is not None:
            self.profile.drop(rnd.prof)

    def resume(self, results: list[dict[str, Any]]) -> bool:
        """Finish the round launched ahead by the last one, if it still applies; False when there is none."""
        rnd, self.ahead = self.ahead, None
        if rnd is None:
            return False
        if not self.valid(rnd):
            self.discard(rnd)
            return False
        try:
            self.finish(rnd, results)
        except Exception as e:
            for j in rnd.jobs:
                for q in j.seqs:
                    q.draft_kv = min(q.draft_kv, q.ids.numel() - 2)
            self.gen._isolate([j for j in rnd.jobs if j in self.gen.active], e, results)
        return True


class _Ahead:
    """A sequence as the round just read back will leave it: its ids with that round's tokens appended (the
    next round is launched before the host's bookkeeping appends them), its pages, and the draft cache's
    extent, which the launch moves and which is copied back onto the sequence."""

    def __init__(self, base: Any, tokens: list[int]) -> None:
        self.base = base
        self.ids = torch.cat([base.ids, torch.tensor(tokens, dtype=torch.long)])
        self.draft_kv = base.draft_kv

    def page_ids(self) -> list[int]:
        return self.base.page_ids()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)


@dataclass
class _Launched:
    """A round whose device work is queued: what `finish` needs to read and accept it."""

    jobs: list[Any]
    k: int
    spec: dict[Any, tuple[RowSample, list[int]]]
    rows: list[tuple[Any, Any]]
    lengths: list[int]  # each row's length when launched (with the tokens of the round before, when ahead)
    spec_rows: list[int]
    real: list[int]  # drafts per spec row
    others: list[Any]  # jobs the host samples from the step's first position
    logits: torch.Tensor | None  # the step's logits, kept for those
    host: torch.Tensor
    event: Any
    timer: _DraftTimer | None
    t0: float
    epochs: list[int]
    prof: Any
    expected: list[int] = field(default_factory=list)  # launched ahead: each row's length it continues
    saved_kv: list[int] = field(default_factory=list)  # launched ahead: each row's draft_kv before the launch
    prev_synced: float = 0.0  # launched ahead: when the round before was read back


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
