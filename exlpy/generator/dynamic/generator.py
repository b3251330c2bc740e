"""`ExLlamaV2DynamicGenerator`: continuous batching over a paged KV cache shared by all jobs.

Each `iterate()` (1) starts queued jobs while batch room and pages for their prompts allow
(dynamic/scheduler.py), (2) runs prompt chunks of jobs still prefilling, within a token budget while other jobs
decode so that a long prompt does not stall them, (3) gives every decoding job the page its next token goes
to (preempting the newest job when the cache is full), launches one batched decode step (q_len 1; with the
prompt chunks of (2) in the same pass where jobs decode: `mixed_step`, one read of the weights) and
samples it on the device where it can, and (4) only then reads the previous step's tokens and turns them
into results (dynamic/decode.py): the host's work overlaps the GPU's. With a grammar-constrained job in the
batch, the step's masking and sampling are launched after (4), once the previous tokens were fed to the
filters; its forward pass is still launched first.

Finished or cancelled jobs give their pages back at once; full pages keep their prefix hash so a later prompt
with the same prefix references them instead of recomputing them, and a partly filled last page remembers its
tokens so that the next turn of a conversation copies its K/V instead of recomputing it.

Counters: `prefill_tokens` (prompt tokens actually run through the model), `cached_tokens` (prompt tokens
served from the cache instead), `decode_tokens` (rows of batched decode steps), `preemptions`, `mixed_steps`
(decode steps that carried prompt chunks in the same pass).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import torch

from exlpy.arguments import refuse_unknown_arguments
from exlpy.errors import GeneratorError, MultimodalError
from exlpy.generator.dynamic import adapters, scheduler
from exlpy.generator.dynamic.decode import DecodeStepper, Pending
from exlpy.generator.dynamic.job import ExLlamaV2DynamicJob
from exlpy.generator.dynamic.pages import PAGE_SIZE, PageTable
from exlpy.generator.dynamic.prefill import Chunk, commit_chunks, completes_prompt, run_chunk, run_prefill, run_together
from exlpy.generator.dynamic.validate import check_job_embeddings, check_job_vocab
from exlpy.generator.filters.base import drop_background
from exlpy.generator.speculative.api import SpeculativeAPI
from exlpy.generator.speculative.dynamic import Speculation
from exlpy.runtime import options


class ExLlamaV2DynamicGenerator(SpeculativeAPI):
    @refuse_unknown_arguments
    def __init__(self, model: Any, cache: Any, tokenizer: Any, max_batch_size: int | None = None,
                 max_seq_len: int | None = None, max_chunk_size: int | None = None, max_q_size: int = 8,
                 draft_model: Any = None, draft_cache: Any = None, num_draft_tokens: int | None = None,
                 use_ngram_draft: bool = False, max_ngram: int = 4, max_sampling_threads: int = 16,
                 min_sampling_threads: int = 3, paged: bool = True, filter_background_eval: bool = True,
                 page_size: int = PAGE_SIZE, max_prefill_per_step: int = 2048) -> None:
        """exllamav2's arguments. max_sampling_threads / min_sampling_threads / filter_background_eval tune
        exllamav2's thread pools; exlpy samples on the calling thread, so they change nothing. Two exlpy
        extensions: `page_size` (tokens per cache page; 256 as in exllamav2) and `max_prefill_per_step` (prompt
        tokens run per iteration while other jobs decode, at the start of a prompt; fewer deeper into long
        prompts, but not below 128 (scheduler.prefill_limit); 256 for a lone prompt: scheduler.prefill_budget;
        2048, where 256 made a crowd of arriving requests wait twice as long, benchmarks/results/serving.md)."""
        cfg = model.config
        if "8bit" in type(cache).__name__:
            raise GeneratorError("Dynamic generator does not currently work with 8-bit cache. Use either FP16 "
                                 "or Q4.")
        if cache.batch_size != 1:
            raise GeneratorError(f"the dynamic generator needs a cache with batch_size 1 (its rows are pages), "
                                 f"got batch_size {cache.batch_size}")
        if page_size < 1 or cache.max_seq_len % page_size != 0:
            raise GeneratorError(f"cache max_seq_len {cache.max_seq_len} must be a multiple of the page size "
                                 f"{page_size}")
        for name, value in (("max_q_size", max_q_size), ("max_batch_size", max_batch_size),
                            ("max_seq_len", max_seq_len), ("max_chunk_size", max_chunk_size)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise GeneratorError(f"{name} must be an integer >= 1 (or None for the default), got {value!r}")
        if max_prefill_per_step < 1:
            raise GeneratorError(f"max_prefill_per_step must be >= 1, got {max_prefill_per_step}")
        self.model, self.cache, self.tokenizer = model, cache, tokenizer
        self.paged = paged
        self.page_size = page_size
        self.max_q_size = max_q_size
        default_batch = max(1, cfg.max_input_len // max_q_size)
        # Unpaged mode keeps exllamav2's meaning (one sequence at a time) on top of the same page machinery.
        self.max_batch_size = 1 if not paged else (max_batch_size or default_batch)
        if self.max_batch_size < 1:
            raise GeneratorError(f"max_batch_size must be >= 1, got {max_batch_size}")
        # A sequence may not outgrow the cache nor the model's context (its RoPE tables end there).
        self.max_seq_len = min(max_seq_len or cache.max_seq_len, cache.max_seq_len, cfg.max_seq_len)
        chunk = max_chunk_size or cfg.max_input_len
        if chunk % page_size != 0 or chunk < page_size:
            raise GeneratorError(f"max_chunk_size {chunk} must be a positive multiple of the page size {page_size}")
        self.max_chunk_size = chunk
        self.max_prefill_per_step = max_prefill_per_step
        # Attention's share of a prompt token's cost deep into a long prompt (scheduler.prefill_limit).
        self.context_cost_tokens = scheduler.context_cost_tokens(cfg)
        self.model_vocab = int(cfg.vocab_size)
        self.num_pages = cache.max_seq_len // page_size
        self.page_table = PageTable(self.num_pages, page_size)
        self.pieces: list[str] = tokenizer.get_id_to_piece_list(True)
        self.special_ids = _special_ids(tokenizer)
        self.pending: list[ExLlamaV2DynamicJob] = []
        self.active: list[ExLlamaV2DynamicJob] = []
        self.next_serial = 0
        self.admissions = 0
        # Counters: tokens actually run through the model (prefill / decode), and prompt tokens served from cache.
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.cached_tokens = 0
        self.preemptions = 0
        self.mixed_steps = 0  # decode steps that carried prompt chunks (one pass: `mixed_step`)
        self.copy_partial_pages = True
        self.stepper = DecodeStepper(self)
        # Sample through the captured sampler (exlpy/generator/sampling/graphed.py): None = where decode steps
        # are CUDA graphs; True / False force it (tests compare both paths on the CPU).
        self.graph_sampling: bool | None = None
        # Prompt chunks next to decoding jobs as captured chunks (exlpy/engine/graphs.py run_chunk) where the model
        # runs CUDA graphs; False: eager chunks for this generator (EXLPY_PREFILL_GRAPHS=0: for every one).
        self.prefill_graphs = True
        # Prompt chunks next to decoding jobs inside the decode step: one eager pass whose rows are the decode rows
        # and the chunks (model/batch.py mixed_batch), so the weights are read once per iteration, not twice. None:
        # the runtime option EXLPY_MIXED_STEP; True / False force it for this generator.
        self.mixed_step: bool | None = None
        # Prompt chunks of several sequences in one iteration as shared eager passes (prefill.run_together), not a
        # pass (or captured pieces) each. None: the runtime option EXLPY_COMBINED_PREFILL; True / False force it.
        self.combined_prefill: bool | None = None
        self.current_loras: list[Any] = []  # set_loras: adapters of jobs that name none (exllamav2's attribute)
        # Speculative decoding (exlpy/generator/speculative/): a draft model or n-gram drafting. num_draft_tokens
        # None adapts the draft length to the acceptance rate; a number fixes it.
        self.draft_model, self.draft_cache = draft_model, draft_cache
        self.use_ngram_draft, self.num_draft_tokens, self.max_ngram = use_ngram_draft, num_draft_tokens, max_ngram
        self.spec: Speculation | None = None
        if draft_model is not None or draft_cache is not None or use_ngram_draft or num_draft_tokens is not None:
            self.spec = Speculation(self, draft_model, draft_cache, num_draft_tokens, use_ngram_draft, max_ngram)
            if draft_model is None and not use_ngram_draft:
                self.spec = None  # num_draft_tokens alone: checked, nothing to draft with
        self._lock = threading.RLock()

    # --- queue ---------------------------------------------------------------------------------------------
    def default_stop_conditions(self) -> list[int | str]:
        ids = getattr(self.tokenizer, "stop_token_ids", None)
        if ids:
            return list(ids)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return [eos] if eos is not None else []

    def enqueue(self, job: ExLlamaV2DynamicJob | list[ExLlamaV2DynamicJob]) -> int | list[int]:
        if isinstance(job, list):
            done: list[ExLlamaV2DynamicJob] = []
            try:
                for j in job:
                    self.enqueue(j)
                    done.append(j)
            except Exception:
                for j in done:  # all or nothing: no orphan jobs left running for a caller that got an error
                    self.cancel(j)
                raise
            return [j.serial for j in done]  # type: ignore[misc]
        if not isinstance(job, ExLlamaV2DynamicJob):
            raise GeneratorError(f"enqueue() takes an ExLlamaV2DynamicJob (or a list of them), got "
                                 f"{type(job).__name__}")
        if job.serial is not None:
            raise GeneratorError(f"job was already enqueued (serial {job.serial}); create a new job to run the "
                                 "prompt again")
        if job.embeddings:
            check_job_embeddings(self, job)
        else:
            check_job_vocab(job.all_input_ids, self.model_vocab)
        with self._lock:
            serial = self.next_serial
            try:
                job.prepare(self, serial)
            except Exception:
                job.serial = None
                raise
            if job.prompt_len >= self.max_seq_len:
                job.serial = None
                if job.embeddings:
                    images = sum(int((job.input_ids >= e.first_index).logical_and(
                        job.input_ids < e.first_index + e.length).sum()) for e in job.embeddings)
                    raise MultimodalError(f"prompt of {job.prompt_len} tokens, {images} of them image tokens, does "
                                          f"not fit the context (max_seq_len {self.max_seq_len}) with room for a "
                                          "new token; use fewer or smaller images (the tower's max_pixels)")
                raise GeneratorError(f"prompt of {job.prompt_len} tokens does not fit max_seq_len "
                                     f"{self.max_seq_len} with room for a new token")
            if job.num_pages > self.num_pages:
                job.serial = None
                raise GeneratorError(f"Job requires {job.num_pages} pages (only {self.num_pages} available): "
                                     f"{job.prompt_len} prompt + up to {job.max_new_tokens} new tokens at "
                                     f"{self.page_size} tokens per page")
            self.next_serial += 1
            job.wait_reason = "queued"
            self.pending.append(job)
            return serial

    def num_remaining_jobs(self) -> int:
        return len(self.pending) + len(self.active)

    def num_active_jobs(self) -> int:
        return len(self.active)

    def num_pending_jobs(self) -> int:
        return len(self.pending)

    def cancel(self, job: ExLlamaV2DynamicJob) -> None:
        with self._lock:
            if job in self.pending:
                self.pending.remove(job)
                job.finished = True
            elif job in self.active:
                self._release(job)
            else:
                raise GeneratorError(f"cannot cancel job {job.serial}: it is not queued or running in this "
                                     "generator")

    def clear_queue(self) -> None:
        with self._lock:
            for job in list(self.active):
                self._release(job)
            for job in self.pending:
                job.finished = True
            self.pending = []
            self.stepper.inflight = None

    def reset_page_table(self) -> None:
        if self.active:
            raise GeneratorError("reset_page_table() needs an idle generator: jobs are still running")
        self.page_table.reset()

    def set_loras(self, loras: Any) -> None:  # for jobs enqueued later that name none (no empty queue needed)
        self.current_loras = list(adapters.normalize(loras, self.model))

    def warmup(self, full: bool | None = None) -> None:
        """Pay first-call costs up front. Always: one tiny job (allocation, first kernels). With `full` (default:
        when the model runs on a CUDA device): every decode graph, prefill chunk shape and sampler batch a
        server will meet (exlpy/generator/dynamic/warmup.py), so no request waits for a compile or a capture."""
        if self.num_remaining_jobs():
            raise GeneratorError("warmup() needs an empty queue")
        from exlpy.generator.sampler import ExLlamaV2Sampler

        bos = getattr(self.tokenizer, "bos_token_id", None) or 1
        self.enqueue(ExLlamaV2DynamicJob(torch.tensor([[bos, bos]]), 2, stop_conditions=[],
                                         gen_settings=ExLlamaV2Sampler.Settings.greedy()))
        while self.num_remaining_jobs():
            self.iterate()
        if full if full is not None else self.device().type == "cuda":
            from exlpy.generator.dynamic.warmup import run_warmup

            run_warmup(self)
        self.page_table.reset()
        self.prefill_tokens = self.decode_tokens = self.cached_tokens = 0
        self.preemptions = self.mixed_steps = 0

    def status(self) -> dict[str, Any]:
        """Cache and queue figures for monitoring (the server's /health). Reads snapshots without the lock, so
        it answers at once even while a step runs in another thread."""
        t = self.page_table
        active, pending = list(self.active), list(self.pending)
        used = sum(q.kv_valid() for j in active for q in j.seqs)
        waiting = [{"serial": j.serial, "reason": j.wait_reason} for j in pending[:8]]
        return {"cache_tokens": t.num_pages * t.page_size, "cache_pages": t.num_pages, "page_size": t.page_size,
                "cache_pages_free": t.num_unreferenced(), "cache_tokens_in_use": used,
                "running": len(active), "waiting": len(pending), "waiting_reasons": waiting,
                "preemptions": self.preemptions, **self._sd_status()}

    # --- iteration -----------------------------------------------------------------------------------------
    def device(self) -> torch.device:
        return self.model.strategy_for_forward().first_device

    def chunk_buckets(self) -> tuple[int, ...]:
        """Sizes of the captured prompt chunks this generator runs next to decoding jobs (empty: eager chunks)."""
        sizes = getattr(self.model, "chunk_buckets", None)  # a model without CUDA graphs (a stand-in) has none
        if not self.prefill_graphs or sizes is None or not getattr(self.cache, "graph_safe", False):
            return ()
        return tuple(sizes())

    def release_pages(self, job: ExLlamaV2DynamicJob) -> None:
        """Give back a job's pages (full ones stay cached under its LoRA salt) and its adapter slot."""
        for q in job.seqs:
            self.page_table.release(q.pages, job.serial or 0, q.ids, q.kv_valid(), q.salt)
            q.pages = []
        adapters.free_slot(self, job)

    def _release(self, job: ExLlamaV2DynamicJob) -> None:
        drop_background(job.filters)  # a mask computed for a step that will not come
        self.release_pages(job)
        job.finished = True
        job.epoch += 1
        job.inflight = 0
        if job in self.active:
            self.active.remove(job)

    def iterate(self) -> list[dict[str, Any]]:
        """Advance every job by one step; returns the results produced (see the module docstring). With the
        overlapped loop a token reaches its result one call after the step that sampled it was launched."""
        with self._lock, torch.inference_mode():
            results: list[dict[str, Any]] = []
            scheduler.admit(self, results)
            decoding = sum(1 for j in self.active if j.is_prefilled())
            budget = scheduler.prefill_budget(self, decoding, len(self.active) - decoding)
            # Prompt chunks that run inside this iteration's decode step (one pass, the weights read once): planned
            # here, run by the step, committed after it (None: each chunk runs as a pass of its own, now).
            chunks: list[Chunk] | None = [] if self._mixes(decoding) else None
            # Else the prompt chunks of several sequences may run together, in shared passes after planning
            # (`combined_prefill`); a job with a LoRA adapter or images keeps its passes of its own.
            together: list[Chunk] | None = [] if chunks is None and self._combines(decoding, budget) else None
            spent = 0
            for job in list(self.active):
                if not job.is_prefilled():
                    shares = together if self._shares_passes(job) else None
                    spent += self._guard_n(job, results, lambda j=job, s=spent, t=shares: run_prefill(
                        self, j, results, decoding, budget, s, chunks, t))
            if together:
                run_together(self, together, decoding, results)
            chunks = chunks or []
            jobs = [j for j in self.active if (j.is_prefilled() or completes_prompt(j, chunks)) and self._continues(j)]
            if self.spec is not None and jobs and self._speculate(jobs, results):
                return results
            jobs = scheduler.decode_pages(self, jobs, 1, lambda: self.stepper.drain(results))
            chunks = [c for c in chunks if c.job in self.active]  # a job preempted for pages: its chunk waits
            prev, self.stepper.inflight = self.stepper.inflight, None
            step = self._mixed_pass(jobs, prev, chunks, results) if chunks else None
            jobs = [j for j in jobs if j in self.active and j.is_prefilled()]
            if not jobs:
                if prev is not None:
                    self.stepper.finish(prev, results)
                return results
            # A grammar-constrained job's mask for this step needs its token in flight, fed to its filters:
            # then the step's forward pass is launched first, the previous tokens are read (and fed; the masks
            # are computed) while it runs, and only then are the rows masked and sampled.
            split = prev is not None and any(j.filters and j.device_masked() for j in jobs)
            try:
                step = step or self.stepper.forward(jobs, prev)
                launched, host = (None, None) if split else self.stepper.sample(step)
            except Exception as e:
                if prev is not None:
                    self.stepper.finish(prev, results)
                self._isolate(jobs, e, results)
                return results
            if prev is not None:
                self.stepper.finish(prev, results)
            if split:
                try:
                    launched, host = self.stepper.sample(step)
                except Exception as e:  # e.g. a filter failing to compute its mask: find the job at fault
                    self._isolate([j for j in jobs if j in self.active and not j.finished], e, results)
                    return results
            assert host is not None
            self.stepper.sample_host(host, results)
            self.stepper.inflight = launched
            return results

    def _mixes(self, decoding: int) -> bool:
        """Whether this iteration's prompt chunks run inside its decode step (`mixed_step`, EXLPY_MIXED_STEP).
        Not with speculative decoding (its round drafts and verifies several tokens per row, and its draft model
        prefills beside each chunk), nor while a job holds images (embedding rows and M-RoPE positions per chunk)
        or a LoRA adapter (the adapter kernels take one slot per row of q_len tokens, not per token): those
        iterations run each chunk as a pass of its own, before the decode step."""
        on = options().mixed_step if self.mixed_step is None else self.mixed_step
        return (on and decoding > 0 and self.spec is None
                and not any(j.embeddings or j.lora_slot >= 0 for j in self.active))

    def _combines(self, decoding: int, budget: int) -> bool:
        """Whether this iteration's prompt chunks of several sequences run as shared passes (`combined_prefill`,
        EXLPY_COMBINED_PREFILL; when: scheduler.combines_prompts)."""
        on = options().combined_prefill if self.combined_prefill is None else self.combined_prefill
        waiting = sum(1 for j in self.active if self._shares_passes(j) for q in j.seqs if not q.is_prefilled())
        return on and scheduler.combines_prompts(waiting, decoding, budget)

    @staticmethod
    def _shares_passes(job: ExLlamaV2DynamicJob) -> bool:
        """Whether the job's prompt chunks may share a pass with other sequences': `mixed_batch` carries neither
        LoRA adapters (their kernels take one slot per row) nor image embeddings and M-RoPE positions."""
        return not job.embeddings and job.lora_slot < 0

    def _mixed_pass(self, jobs: list[ExLlamaV2DynamicJob], prev: Any, chunks: list[Chunk],
                    results: list[dict[str, Any]]) -> Pending | None:
        """Launch the decode step of `jobs` with the prompt chunks in the same pass, and record the chunks. With no
        decode row left to carry them, or when the pass raises (one job's fault fails it whole), the chunks run
        as passes of their own (a failing one ends its job alone) and None is returned: the decode step then
        runs on its own, isolated as ever."""
        if jobs:
            try:
                step = self.stepper.forward(jobs, prev, chunks)
            except Exception:
                pass
            else:
                commit_chunks(self, chunks, results)
                self.mixed_steps += 1
                return step
        self._run_chunks(chunks, results)
        return None

    def _run_chunks(self, chunks: list[Chunk], results: list[dict[str, Any]]) -> None:
        """Planned chunks, each as a pass of its own; a chunk that raises ends its job alone."""
        for c in chunks:
            if c.job in self.active and not c.job.finished:
                self.guard(c.job, results, lambda c=c: (run_chunk(self, c), commit_chunks(self, [c], results)))

    def _continues(self, job: ExLlamaV2DynamicJob) -> bool:
        """Whether the job needs another step: it ends by count once its tokens in flight arrive."""
        n = job.new_tokens + job.inflight
        return n < job.max_new_tokens and max(q.ids.numel() for q in job.seqs) + job.inflight < self.max_seq_len

    def _isolate(self, jobs: list[ExLlamaV2DynamicJob], error: Exception, results: list[dict[str, Any]]) -> None:
        """A batched step raised: run each job's step alone so that only the job at fault fails."""
        if len(jobs) == 1:
            self.fail(jobs[0], error, results)
            return
        for job in jobs:
            if job.finished or job not in self.active:
                continue

            def solo(j: ExLlamaV2DynamicJob = job) -> None:
                launched, host = self.stepper.launch([j], None)
                if launched is not None:
                    self.stepper.finish(launched, results)
                self.stepper.sample_host(host, results)

            self.guard(job, results, solo)

    def guard(self, job: ExLlamaV2DynamicJob, results: list[dict[str, Any]], fn: Any) -> None:
        """Run one job's step; an exception ends that job with an error result and leaves the others running."""
        try:
            fn()
        except Exception as e:
            self.fail(job, e, results)

    def _guard_n(self, job: ExLlamaV2DynamicJob, results: list[dict[str, Any]], fn: Any) -> int:
        try:
            return int(fn())
        except Exception as e:
            self.fail(job, e, results)
            return 0

    def fail(self, job: ExLlamaV2DynamicJob, e: Exception, results: list[dict[str, Any]]) -> None:
        r = job.base_result("streaming")
        r.update(eos=True, text="", token_ids=torch.empty(1, 0, dtype=torch.long), error=e,
                 error_message=f"{type(e).__name__}: {e}")
        job.add_final_fields(r, "error")
        self._release(job)
        results.append(r)

    def sample_on_host(self, job: ExLlamaV2DynamicJob, logits: torch.Tensor, results: list[dict[str, Any]],
                       point: float | None = None) -> None:
        from exlpy.generator.sampler import ExLlamaV2Sampler

        token, payload, end_filter = job.sample(logits, ExLlamaV2Sampler, job.settings, point)
        self.accept(job, token, payload, end_filter, results)

    def accept(self, job: ExLlamaV2DynamicJob, token: int, payload: dict[str, Any], end_filter: bool,
               results: list[dict[str, Any]]) -> None:
        r = job.receive(token, payload, end_filter)
        if self.spec is not None:
            self.spec.tokens += 1
        if r is not None:
            results.append(r)
            if r["eos"]:
                self._release(job)

    # --- one-call generation -------------------------------------------------------------------------------
    @refuse_unknown_arguments
    def generate(self, prompt: str | tuple[str, str] | list[Any], max_new_tokens: int, min_new_tokens: int = 0,
                 seed: int | None = None, gen_settings: Any = None, token_healing: bool = False,
                 encode_special_tokens: bool = False, decode_special_tokens: bool = False,
                 stop_conditions: Iterable[int | str] | None = None, add_bos: bool = False,
                 abort_event: threading.Event | None = None, completion_only: bool = False,
                 filters: list[Any] | None = None, filter_prefer_eos: bool = False,
                 return_last_results: bool = False, embeddings: Any = None,
                 banned_strings: list[str] | None = None) -> Any:
        """Generate for one prompt (str) or a batch (list); returns text (or a list), plus the final results
        when `return_last_results`. A failing job raises its error here."""
        from exlpy.generator.dynamic.oneshot import run_generate

        return run_generate(self, prompt, max_new_tokens, min_new_tokens, seed, gen_settings, token_healing,
                            encode_special_tokens, decode_special_tokens, stop_conditions, add_bos, abort_event,
                            completion_only, filters, filter_prefer_eos, return_last_results, embeddings,
                            banned_strings)


def _special_ids(tokenizer: Any) -> set[int]:
    for name in ("extended_id_to_piece", "special_ids"):
        v = getattr(tokenizer, name, None)
        if v:
            return set(v.keys()) if isinstance(v, dict) else set(v)
    return set()
