"""The overlapped decode step of the dynamic generator.

A step's tokens are sampled on the device (exlpy.generator.sampling.batched) and stay there: the next step
takes them as its input ids directly (`forward_batch` copies device ids into the graph's static input), while a
non-blocking copy brings them to pinned host memory behind an event. `iterate()` launches step n+1 first and
only then reads step n's tokens, so stop checks, detokenization and scheduling run while the GPU computes.

A job's tokens in flight are counted in `job.inflight` and its step rows are tagged with `job.epoch`. When the
host finds that a job ended at step n (a stop token or string), its row in step n+1 computed one token too
many: the job is released as it would have been without the overlap (its K/V past the last real token is
never counted as valid, and a page taken for that position goes back), and the stale row is dropped when
step n+1 is read. Rows that need the host sampler (filters other than grammar masks, penalties, CFG, banned
strings, per-token extras) copy their logits to the CPU after the previous step's tokens were processed: for
them the step is synchronous, as before.

Grammar filters (exlpy/generator/filters/device.py) are applied on the device between the forward pass and
the sampling, so a constrained job is sampled on the device too and keeps its token in flight like any other
row. Its mask for step n+1 depends on token n, but the forward pass of step n+1 does not: `iterate()` then
splits the step (`forward()`, then `sample()`): it launches the forward pass of step n+1 (input: token n, still
on the device), reads token n (the one wait on the device) and feeds it to the filters, whose next mask a
worker thread computes while the GPU runs that forward pass, and then uploads the mask (pinned, non-blocking)
and launches the masking kernel and the sampling behind the forward pass on the stream. Each row carries its
job's LoRA slot.

Where decode steps are CUDA graphs (`gen.graph_sampling`), rows sample through the captured sampler
(exlpy/generator/sampling/graphed.py): one graph replay for the step's masks, penalties (each job's token counts
live in a sampler slot on the device and follow its tokens there), truncation and draw. A seeded job's random
points still come from its generator, in the same order as on the host; an unseeded job's from Philox in the
kernel. Rows the captured sampler cannot take use `sample_rows` or the host sampler as before.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from exlpy.engine.graphs import bucket_for
from exlpy.errors import SamplerError
from exlpy.generator.filters.device import collect, premask_jobs
from exlpy.generator.sampling import graphed
from exlpy.generator.sampling.batched import RowSample, is_greedy, sample_rows
from exlpy.generator.sampling.graphed import GraphRow, GraphSampler
from exlpy.model.batch import mixed_batch, paged_batch, upload_ids

if TYPE_CHECKING:
    from exlpy.generator.dynamic.generator import ExLlamaV2DynamicGenerator
    from exlpy.generator.dynamic.job import ExLlamaV2DynamicJob
    from exlpy.generator.dynamic.prefill import Chunk


BAD_ROW = ("the logits hold NaN or +inf, or leave no token with a finite, positive probability: the model output "
           "is broken or every token was excluded")


@dataclass
class Launched:
    """Tokens sampled on the device whose values the host has not read yet."""

    jobs: list[tuple[ExLlamaV2DynamicJob, int]]  # (job, its epoch at launch), in token order
    tokens: torch.Tensor  # [n] long on the device: the next step's input for these jobs
    host: torch.Tensor  # [n] on the CPU (pinned for a CUDA step), filled by a non-blocking copy
    event: Any = None  # recorded after that copy (None: a CPU step, already complete)
    ends: list[set[int] | None] | None = None  # per job: its filters' end tokens when they masked this step
    _index: dict[int, tuple[int, int]] | None = None

    def position(self, job: ExLlamaV2DynamicJob) -> int | None:
        """Index of the job's token in `tokens` (None: the job has no valid token here)."""
        if self._index is None:
            self._index = {id(j): (i, e) for i, (j, e) in enumerate(self.jobs)}
        hit = self._index.get(id(job))
        return hit[0] if hit is not None and hit[1] == job.epoch else None

    def read(self) -> tuple[list[int], list[bool]]:
        """(tokens, whether each row's distribution was usable): waits for the copy."""
        if self.event is not None:
            self.event.synchronize()
        vals = self.host.tolist()
        n = len(self.jobs)
        return vals[:n], [bool(v) for v in vals[n:]]


def read_back(tokens: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """Start copying device tokens to the host without waiting: (host tensor, event to wait on)."""
    if tokens.device.type != "cuda":
        return tokens, None
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tokens.device))
    return host, event


def upload_floats(values: list[float], device: torch.device) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float32)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class Pending:
    """A step whose forward pass is launched and whose rows are not sampled yet (DecodeStepper.forward)."""

    jobs: list[ExLlamaV2DynamicJob]
    first: list[int]  # each job's first row in `logits`
    logits: torch.Tensor  # [rows, V] on the device, not masked yet
    epochs: list[int]  # each job's epoch at launch: a job whose epoch moved since has ended or was rolled back
    device: torch.device  # the logits' device (where the sampler's small uploads go)


@dataclass
class HostRows:
    """Jobs of a launched step that the host samples, and where their rows are in the step's logits."""

    jobs: list[ExLlamaV2DynamicJob]
    first_row: list[int]
    logits: torch.Tensor | None = None  # [rows, V]: grammar masks already applied
    points: dict[int, float] | None = None  # serial -> random point already drawn for the job


class DecodeStepper:
    """Launches decode steps for the generator and keeps the one step whose tokens are still in flight."""

    def __init__(self, gen: ExLlamaV2DynamicGenerator) -> None:
        self.gen = gen
        self.inflight: Launched | None = None
        self.graphed: GraphSampler | None = None  # the captured sampler, made on first use
        self.slot_of: dict[int, list[Any]] = {}  # id(job) -> [sampler slot, tokens its counts hold, weakref]

    def input_ids(self, rows: list[tuple[ExLlamaV2DynamicJob, Any]], prev: Launched | None,
                  device: torch.device) -> torch.Tensor:
        """[B, 1] ids: a row whose job has a token in flight takes it from `prev` on the device, the others
        their last host token."""
        src = [prev.position(job) if (prev is not None and job.inflight) else None for job, _ in rows]
        if prev is None or all(s is None for s in src):
            return torch.stack([q.ids[-1:] for _, q in rows])
        n = prev.tokens.numel()
        if src == list(range(n)):  # the same jobs in the same order: the sampled tokens are the input
            return prev.tokens.view(n, 1)
        host_vals = [int(q.ids[-1]) for (_, q), s in zip(rows, src) if s is None]
        index, k = [], n
        for s in src:
            if s is None:
                index.append(k)
                k += 1
            else:
                index.append(s)
        # On the previous tokens' device: under a layer split they were sampled on the last GPU, not the first.
        packed = upload_ids(torch.tensor(host_vals + index, dtype=torch.long), prev.tokens.device)
        combined = torch.cat([prev.tokens, packed[:len(host_vals)]])
        return combined.index_select(0, packed[len(host_vals):]).view(len(rows), 1)

    def launch(self, jobs: list[ExLlamaV2DynamicJob], prev: Launched | None
               ) -> tuple[Launched | None, HostRows]:
        """Run one batched q_len-1 step over every sequence of `jobs` (CFG jobs have two rows) and sample
        what can be sampled on the device. Nothing is read back here."""
        return self.sample(self.forward(jobs, prev))

    def forward(self, jobs: list[ExLlamaV2DynamicJob], prev: Launched | None, chunks: Sequence[Chunk] = ()
                ) -> Pending:
        """Launch the forward pass of one step (its input: the tokens of `prev` still on the device, or the
        host's last tokens); `sample()` masks and samples it. Between the two the host may read `prev` and feed
        its tokens to grammar filters: the masks of this step are collected in `sample()`, while the GPU runs
        this forward pass.

        `chunks`: prompt chunks that run in the same pass (a mixed pass: one eager forward whose tokens are the
        decode rows, then each chunk; model/batch.py `mixed_batch`). Only the decode rows get logits; a job whose
        last chunk is among them decodes in this pass too (its row attends over the chunk's K/V, written first)."""
        gen = self.gen
        device = gen.device()
        rows = [(j, q) for j in jobs for q in j.seqs]
        first: list[int] = []  # each job's first row (a CFG job's two rows are consecutive)
        n = 0
        for j in jobs:
            first.append(n)
            n += len(j.seqs)
        ids = self.input_ids(rows, prev, device)
        decode = [(q.page_ids(), j.next_position(q), 1) for j, q in rows]
        if chunks:
            # The decode rows padded to the captured step's row and width buckets: their attention meets only
            # kernel variants the decode warm-up compiled (the split-K count follows rows and width), never a
            # compile in the middle of serving. Padding rows are tokens that write and read nothing.
            shape = (bucket_for(len(rows)) or len(rows), max(len(p) for p, _, _ in decode))
            shape = (shape[0], bucket_for(shape[1]) or shape[1])
            groups = [decode] + [[(c.seq.page_ids(), c.start, c.end - c.start)] for c in chunks]
            batch = mixed_batch(groups, gen.cache, device, gen.page_size, len(rows), shape)
            prompt = torch.cat([torch.zeros(shape[0] - len(rows), dtype=torch.long), *(c.ids for c in chunks)])
            if ids.device.type != "cpu":  # the decode rows' tokens are still on the device: the prompt's join them
                prompt = upload_ids(prompt.view(1, -1), ids.device).view(-1)
            logits = gen.model.forward_batch(torch.cat([ids.view(-1), prompt]).view(1, -1), batch,
                                             last_id_only=True)[0]  # [rows, V]
        else:
            batch = paged_batch(decode, gen.cache, device, gen.page_size, [j.lora_slot for j, _ in rows])
            if any(j.embeddings for j in jobs):
                mm_rows(batch, rows, device)
            logits = gen.model.forward_batch(ids, batch, last_id_only=True)[:, -1]  # [rows, V]
        gen.decode_tokens += len(rows)
        # Sampling runs where the logits are: the last stage's device (not the first one under a layer split).
        return Pending(jobs, first, logits, [j.epoch for j in jobs], logits.device)

    def sample(self, step: Pending) -> tuple[Launched | None, HostRows]:
        """Mask the step's constrained rows on the device (grammar filters: each waits for its mask), sample
        the rows that can be sampled there, and start reading their tokens back. Jobs that ended since the
        forward pass was launched (the host read their previous token meanwhile) are left out: their rows
        computed one token too many.

        Where the generator samples through the captured sampler (`graph_sampling`), its rows (penalties, bias,
        masks and blocked tokens included) take `GraphSampler`: their masks go into its buffers instead of a
        masking kernel here; the remaining device rows take `sample_rows`."""
        live = [k for k, (j, e) in enumerate(zip(step.jobs, step.epochs)) if not j.finished and j.epoch == e]
        jobs, first = [step.jobs[k] for k in live], [step.first[k] for k in live]
        graph = self._graph_rows(jobs, step.logits)
        # Grammar filters: each masks its rows on the device (the mask was computed while the step ran).
        others = [k for k in range(len(jobs)) if k not in graph]
        logits = premask_jobs([jobs[k] for k in others], [first[k] for k in others], step.logits)
        plans: list[RowSample | None] = [None if k in graph else j.device_sampling() for k, j in enumerate(jobs)]
        points: dict[int, float] = {}
        for k, p in enumerate(plans):
            if p is not None and not is_greedy(p.settings):
                try:
                    points[k] = jobs[k].draw_point()
                except Exception:
                    plans[k] = None  # the host sampler will meet the same fault and fail this job alone
        dev = [k for k, p in enumerate(plans) if p is not None]
        on_host = [k for k in range(len(jobs)) if plans[k] is None and k not in graph]
        host = HostRows([jobs[k] for k in on_host], [first[k] for k in on_host])
        launched = None
        if dev or graph:
            try:
                launched = self._sample(jobs, first, plans, dev, [points.get(k, 0.0) for k in dev], logits,
                                        step.device, graph)
            except Exception as e:
                # e.g. a malformed token_bias: the host sampler runs these rows one by one (with the points
                # already drawn) and fails only the job at fault
                if graph:  # the captured sampler failed: the generator goes on without it
                    warnings.warn(f"captured sampler failed ({type(e).__name__}: {e}); sampling without it from "
                                  "now on", stacklevel=2)
                    self.gen.graph_sampling = False
                logits = premask_jobs(jobs, first, step.logits)
                drawn = {**points, **{k: row.point for k, row in graph.items() if row.point is not None}}
                host = HostRows(list(jobs), first, points={jobs[k].serial or 0: v for k, v in drawn.items()})
        host.logits = logits
        return launched, host

    # --- the captured sampler (exlpy/generator/sampling/graphed.py) ---------------------------------------------
    def graph_sampler(self, logits: torch.Tensor) -> GraphSampler | None:
        """The captured sampler for logits like these ([..., V] on their device), or None where the generator
        does not use it (`gen.graph_sampling`)."""
        if not graphed.wanted(self.gen.model, logits.device, self.gen.graph_sampling) or \
                (self.graphed is not None and self.graphed.failed):
            return None
        vocab = logits.shape[-1]
        if self.graphed is None or self.graphed.device != logits.device or self.graphed.vocab != vocab:
            self.graphed = graphed.for_logits(logits.view(-1, vocab), self.gen.max_batch_size, self.gen.tokenizer)
            self.slot_of.clear()
        return self.graphed

    def _graph_rows(self, jobs: list[ExLlamaV2DynamicJob], logits: torch.Tensor) -> dict[int, GraphRow]:
        """The jobs (by index) that the captured sampler samples this step, with their rows."""
        if self.graph_sampler(logits) is None:
            return {}
        vocab = logits.shape[-1]
        rows: dict[int, GraphRow] = {}
        live = {id(j) for j in jobs}
        for k, job in enumerate(jobs):
            if not job.graph_sampling(vocab):
                continue
            s = job.settings
            slot = -1
            if graphed.has_penalties(s) or s.token_bias is not None:
                slot = self._slot(job, live)
                if slot < 0:
                    continue
            try:
                point = job.draw_point() if job.seed is not None and not is_greedy(s) else None
                seed = job.philox_seed() if point is None else 0
            except Exception:
                continue  # the host sampler meets the same fault and fails this job alone
            row = GraphRow(s, slot, seed, len(job.sequence) + job.inflight, point, job.blocked_tokens())
            if job.filters and job.device_masked():
                row.mask, job.premask_end = collect(job.filters)
            else:
                job.premask_end = None
            rows[k] = row
        return rows

    def _slot(self, job: ExLlamaV2DynamicJob, live: set[int]) -> int:
        """The job's slot of penalty counts and bias, its counts rebuilt from its context when they do not hold
        exactly its tokens (a first step, or tokens sampled elsewhere); -1 when they cannot be rebuilt now (a
        token of it still in flight)."""
        g = self.graphed
        assert g is not None
        entry = self.slot_of.get(id(job))
        if entry is None or entry[2]() is not job:
            used = {e[0] for key, e in self.slot_of.items() if key in live and e[2]() is not None
                    and not e[2]().finished}  # type: ignore[union-attr]
            free = next((i for i in range(g.slots) if i not in used), None)
            if free is None:
                return -1
            for key in [key for key, e in self.slot_of.items() if e[0] == free]:
                del self.slot_of[key]
            entry = self.slot_of[id(job)] = [free, -1, weakref.ref(job)]
        slot, length = entry[0], entry[1]
        expected = len(job.sequence) + job.inflight
        if graphed.has_penalties(job.settings) and length != expected:
            if job.inflight:
                return -1
            g.bind_counts(slot, job.sequence)
        entry[1] = expected + 1  # the graph counts the token it samples now
        return slot

    def _sample(self, jobs: list[ExLlamaV2DynamicJob], first: list[int], plans: list[RowSample | None],
                dev: list[int], points: list[float], logits: torch.Tensor, device: torch.device,
                graph: dict[int, GraphRow] | None = None) -> Launched:
        graph = graph or {}
        parts: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []
        if graph:
            gk = list(graph)
            assert self.graphed is not None
            x = logits if gk == list(range(logits.shape[0])) and all(len(jobs[k].seqs) == 1 for k in gk) \
                else logits.index_select(0, upload_ids(torch.tensor([first[k] for k in gk]), device))
            t, _, ok = self.graphed.sample(x, [graph[k] for k in gk])
            parts.append((gk, t, ok))
        if dev:
            row_plans = [plans[k] for k in dev]
            assert all(p is not None for p in row_plans)
            x = logits
            if len(dev) != logits.shape[0]:
                x = x.index_select(0, upload_ids(torch.tensor([first[k] for k in dev]), device))
            t, _, ok = sample_rows(x, row_plans, upload_floats(points, device).view(-1, 1),  # type: ignore[arg-type]
                                   self.gen.tokenizer)
            parts.append((dev, t, ok))
        order = [k for ks, _, _ in parts for k in ks]
        tokens = torch.cat([t for _, t, _ in parts]) if len(parts) > 1 else parts[0][1].clone()
        ok = torch.cat([o for _, _, o in parts]) if len(parts) > 1 else parts[0][2]
        for k in order:
            jobs[k].inflight += 1
        host, event = read_back(torch.cat([tokens, ok.long()]))
        return Launched([(jobs[k], jobs[k].epoch) for k in order], tokens, host, event,
                        [jobs[k].premask_end for k in order])

    def finish(self, launched: Launched, results: list[dict[str, Any]]) -> None:
        """Read a launched step's tokens (waits for its copy) and hand each to its job."""
        tokens, usable = launched.read()
        ends = launched.ends or [None] * len(tokens)
        for (job, epoch), token, ok, end in zip(launched.jobs, tokens, usable, ends):
            if job.finished or job.epoch != epoch:
                continue  # ended, cancelled, preempted or rewound since: a token one step too many
            job.inflight -= 1
            if not ok:
                self.gen.fail(job, SamplerError(BAD_ROW), results)
                continue
            self.gen.guard(job, results, lambda j=job, t=token, e=end is not None and token in end:
                           self.gen.accept(j, t, {}, e, results))

    def sample_host(self, host: HostRows, results: list[dict[str, Any]]) -> None:
        """Sample the host rows (after the previous step's tokens were processed: they see the whole context)."""
        if not host.jobs:
            return
        assert host.logits is not None
        index = [f + r for job, f in zip(host.jobs, host.first_row) for r in range(len(job.seqs))]
        cpu = host.logits[index].unsqueeze(1).float().cpu()  # waits for this step
        i = 0
        for job in host.jobs:
            n = len(job.seqs)
            part = cpu[i:i + n]
            i += n
            point = (host.points or {}).get(job.serial or 0)
            if not job.finished:
                self.gen.guard(job, results,
                               lambda j=job, row=part, r=point: self.gen.sample_on_host(j, row, results, r))

    def drain(self, results: list[dict[str, Any]]) -> bool:
        """Process the step in flight now (the scheduler needs the tokens first); False if there is none."""
        launched, self.inflight = self.inflight, None
        if launched is None:
            return False
        self.finish(launched, results)
        return True


def mm_rows(batch: Any, rows: list[tuple[Any, Any]], device: torch.device) -> None:
    """A decode step with jobs that hold images: their embeddings when a row's input is one of their ids (a
    prompt's last token may be an image's end token) and, for M-RoPE, each row's position shift. Such steps run
    eagerly, outside the CUDA graphs; a step that needs neither (Gemma 3 after a prompt ending in text) keeps
    its graph. Sampled tokens are never embedding ids, so only a row's last host token can be one."""
    from exlpy.vision.embedding import EMBEDDING_INDEX
    from exlpy.vision.mm import MMInputs
    from exlpy.vision.transfer import upload

    deltas = [q.rope_delta for _, q in rows] + [0] * (batch.batch_size - len(rows))
    if not any(deltas) and all(int(q.ids[-1]) < EMBEDDING_INDEX for _, q in rows):
        return
    embeddings = [e for j in dict.fromkeys(j for j, _ in rows) for e in j.embeddings]
    batch.mm = MMInputs(embeddings)
    if any(deltas):
        shift = upload(torch.tensor(deltas, dtype=torch.long).view(-1, 1), device)  # no wait for the prefill
        batch.rope_positions = (batch.positions + shift).clamp(min=0)
