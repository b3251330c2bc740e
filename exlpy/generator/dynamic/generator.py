"""`ExLlamaV2DynamicGenerator`: continuous batching over a paged KV cache shared by all jobs.

Each `iterate()` (1) starts queued jobs while pages and batch room allow, (2) runs one prefill chunk per job
that still has prompt left (skipping pages another job already computed), (3) runs one batched decode step
(q_len 1) for every prefilled job and samples each row with that job's settings and torch.Generator.
Finished or cancelled jobs give their pages back at once; full pages keep their prefix hash so a later prompt
with the same prefix references them instead of recomputing them, and a partly filled last page remembers its
tokens so that the next turn of a conversation copies its K/V instead of recomputing it.

Counters: `prefill_tokens` (prompt tokens actually run through the model), `cached_tokens` (prompt tokens
served from the cache instead) and `decode_tokens` (rows of batched decode steps).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import torch

from exlpy.errors import GeneratorError, NotSupportedError
from exlpy.generator.dynamic import adapters
from exlpy.generator.dynamic.job import ExLlamaV2DynamicJob, SeqState
from exlpy.generator.dynamic.pages import PAGE_SIZE, PageTable
from exlpy.generator.dynamic.scheduler import decode_step, plan_prefill, skip_cached_pages
from exlpy.generator.dynamic.validate import check_job_vocab
from exlpy.generator.filters.base import drop_background
from exlpy.model.batch import paged_batch


class ExLlamaV2DynamicGenerator:
    def __init__(self, model: Any, cache: Any, tokenizer: Any, max_batch_size: int | None = None,
                 max_seq_len: int | None = None, max_chunk_size: int | None = None, max_q_size: int = 8,
                 draft_model: Any = None, draft_cache: Any = None, num_draft_tokens: int = 4,
                 use_ngram_draft: bool = False, max_ngram: int = 4, max_sampling_threads: int = 16,
                 min_sampling_threads: int = 3, paged: bool = True, filter_background_eval: bool = True) -> None:
        """exllamav2's arguments. max_sampling_threads / min_sampling_threads / filter_background_eval tune
        exllamav2's thread pools; exlpy samples on the calling thread, so they change nothing."""
        cfg = model.config
        if draft_model is not None or draft_cache is not None or use_ngram_draft:
            raise NotSupportedError("speculative decoding (draft_model / draft_cache / use_ngram_draft) is not "
                                    "supported by exlpy's dynamic generator yet")
        if "8bit" in type(cache).__name__:
            raise GeneratorError("Dynamic generator does not currently work with 8-bit cache. Use either FP16 "
                                 "or Q4.")
        if cache.batch_size != 1:
            raise GeneratorError(f"the dynamic generator needs a cache with batch_size 1 (its rows are pages), "
                                 f"got batch_size {cache.batch_size}")
        if cache.max_seq_len % PAGE_SIZE != 0:
            raise GeneratorError(f"cache max_seq_len {cache.max_seq_len} must be a multiple of the page size "
                                 f"{PAGE_SIZE}")
        self.model, self.cache, self.tokenizer = model, cache, tokenizer
        self.paged = paged
        self.max_q_size = max_q_size
        default_batch = max(1, cfg.max_input_len // max_q_size)
        # Unpaged mode keeps exllamav2's meaning (one sequence at a time) on top of the same page machinery.
        self.max_batch_size = 1 if not paged else (max_batch_size or default_batch)
        if self.max_batch_size < 1:
            raise GeneratorError(f"max_batch_size must be >= 1, got {max_batch_size}")
        # A sequence may not outgrow the cache nor the model's context (its RoPE tables end there).
        self.max_seq_len = min(max_seq_len or cache.max_seq_len, cache.max_seq_len, cfg.max_seq_len)
        chunk = max_chunk_size or cfg.max_input_len
        if chunk % PAGE_SIZE != 0 or chunk < PAGE_SIZE:
            raise GeneratorError(f"max_chunk_size {chunk} must be a positive multiple of the page size {PAGE_SIZE}")
        self.max_chunk_size = chunk
        self.num_pages = cache.max_seq_len // PAGE_SIZE
        self.page_table = PageTable(self.num_pages)
        self.pieces: list[str] = tokenizer.get_id_to_piece_list(True)
        self.special_ids = _special_ids(tokenizer)
        self.pending: list[ExLlamaV2DynamicJob] = []
        self.active: list[ExLlamaV2DynamicJob] = []
        self.next_serial = 0
        # Counters: tokens actually run through the model (prefill / decode), and prompt tokens served from cache.
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.cached_tokens = 0
        self.copy_partial_pages = True
        self.current_loras: list[Any] = []  # set_loras: adapters of jobs that name none (exllamav2's attribute)
        self.draft_model = self.draft_cache = None
        self.use_ngram_draft = False
        self.num_draft_tokens, self.max_ngram = num_draft_tokens, max_ngram
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
        check_job_vocab(job.all_input_ids, self.model.config.vocab_size)
        with self._lock:
            serial = self.next_serial
            job.prepare(self, serial)
            if job.num_pages > self.num_pages:
                job.serial = None
                raise GeneratorError(f"Job requires {job.num_pages} pages (only {self.num_pages} available): "
                                     f"{job.prompt_len} prompt + up to {job.max_new_tokens} new tokens at "
                                     f"{PAGE_SIZE} tokens per page")
            if job.prompt_len >= self.max_seq_len:
                job.serial = None
                raise GeneratorError(f"prompt of {job.prompt_len} tokens does not fit max_seq_len "
                                     f"{self.max_seq_len} with room for a new token")
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

    def reset_page_table(self) -> None:
        if self.active:
            raise GeneratorError("reset_page_table() needs an idle generator: jobs are still running")
        self.page_table.reset()

    def set_loras(self, loras: Any) -> None:  # for jobs enqueued later that name none (no empty queue needed)
        self.current_loras = list(adapters.normalize(loras, self.model))

    def warmup(self) -> None:
        """Run one tiny job so first-call costs (allocation, kernel compilation) are paid up front."""
        if self.num_remaining_jobs():
            raise GeneratorError("warmup() needs an empty queue")
        from exlpy.generator.sampler import ExLlamaV2Sampler

        bos = getattr(self.tokenizer, "bos_token_id", None) or 1
        self.enqueue(ExLlamaV2DynamicJob(torch.tensor([[bos, bos]]), 2, stop_conditions=[],
                                         gen_settings=ExLlamaV2Sampler.Settings.greedy()))
        while self.num_remaining_jobs():
            self.iterate()
        self.page_table.reset()
        self.prefill_tokens = self.decode_tokens = self.cached_tokens = 0

    # --- iteration -----------------------------------------------------------------------------------------
    def _release(self, job: ExLlamaV2DynamicJob) -> None:
        drop_background(job.filters)  # a mask computed for a step that will not come
        for q in job.seqs:
            self.page_table.release(q.pages, job.serial or 0, q.ids, q.kv_valid(), q.salt)
            q.pages = []
        adapters.free_slot(self, job)
        job.finished = True
        if job in self.active:
            self.active.remove(job)

    def _schedule(self, results: list[dict[str, Any]]) -> None:
        for job in list(self.pending):
            if len(self.active) >= self.max_batch_size:
                job.wait_reason = f"batch full ({self.max_batch_size} jobs running)"
                break
            try:
                fits = self.page_table.can_allocate([(q.hashes, q.num_pages) for q in job.seqs])
            except Exception as e:  # a job the enqueue checks missed ends here instead of blocking the queue
                self.pending.remove(job)
                self._fail(job, e, results)
                continue
            if not fits:
                free = self.page_table.num_unreferenced()
                job.wait_reason = f"not enough free cache pages (needs {job.num_pages}, {free} free)"
                if job.skips >= job.max_skips:
                    break  # skipped too often: later jobs may not overtake it any more
                continue
            if not (admitted := adapters.admit(self, job, results)):  # its LoRA adapter slot, if it needs one
                if admitted is False and job.skips >= job.max_skips:
                    break
                continue
            for other in self.pending:
                if other is job:
                    break
                other.skips += 1
            self.pending.remove(job)
            self.active.append(job)
            # A job that cannot start (its filters' begin() raises...) ends with an error result, pages freed.
            self._guard(job, results, lambda j=job: self._start(j, results))

    def _start(self, job: ExLlamaV2DynamicJob, results: list[dict[str, Any]]) -> None:
        reused = 0
        for q in job.seqs:
            q.pages, n = self.page_table.allocate(q.hashes, q.num_pages, job.serial or 0)
            reused += n
        job.start(reused)
        results.append(job.base_result("started"))

    def iterate(self) -> list[dict[str, Any]]:
        """Advance every job by one step; returns the results produced (see the module docstring)."""
        with self._lock:
            results: list[dict[str, Any]] = []
            self._schedule(results)
            for job in list(self.active):
                if not job.is_prefilled():
                    self._guard(job, results, lambda j=job: self._prefill(j, results))
            decoding = [j for j in self.active if j.is_prefilled()]
            if decoding:
                try:
                    groups = [(decoding, self._decode_step(decoding))]
                except Exception:  # retried job by job (same K/V slots): only a job that fails alone ends
                    groups = []
                    for job in decoding:
                        try:
                            groups.append(([job], self._decode_step([job])))
                        except Exception as e:
                            self._fail(job, e, results)
                for jobs, (greedy, logits) in groups:
                    for i, job in enumerate(jobs):
                        if i in greedy:
                            self._guard(job, results,
                                        lambda j=job, t=greedy[i]: self._accept(
                                            j, t, {}, j.premask_end is not None and t in j.premask_end, results))
                        else:
                            self._guard(job, results, lambda j=job, row=logits[i]: self._sample(j, row, results))
            return results

    def _guard(self, job: ExLlamaV2DynamicJob, results: list[dict[str, Any]], fn: Any) -> None:
        """Run one job's step; an exception ends that job with an error result and leaves the others running."""
        try:
            fn()
        except Exception as e:
            self._fail(job, e, results)

    def _fail(self, job: ExLlamaV2DynamicJob, e: Exception, results: list[dict[str, Any]]) -> None:
        r = job.base_result("streaming")
        r.update(eos=True, text="", token_ids=torch.empty(1, 0, dtype=torch.long), error=e,
                 error_message=f"{type(e).__name__}: {e}")
        job.add_final_fields(r, "error")
        self._release(job)
        results.append(r)

    def _prefill(self, job: ExLlamaV2DynamicJob, results: list[dict[str, Any]]) -> None:
        progressed = False
        for q in job.seqs:
            if q.is_prefilled():
                continue
            self.cached_tokens += skip_cached_pages(q)
            self._copy_partial_page(q, job.serial or 0)
            self.cached_tokens += skip_cached_pages(q)
            plan = plan_prefill(q, job.serial or 0, self.max_chunk_size)
            if plan is None:
                job.wait_reason = "waiting for another job to finish computing a shared prefix page"
                continue
            progressed = True
            start, end = plan
            if end > start:
                ids = q.ids[start:end].unsqueeze(0)
                batch = paged_batch([(q.page_ids(), start, end - start)], self.cache, self._device(), PAGE_SIZE,
                                    [job.lora_slot])
                self.model.forward_batch(ids, batch, preprocess_only=True)
                self.prefill_tokens += end - start
                for p in range(start // PAGE_SIZE, (end - 1) // PAGE_SIZE + 1):
                    q.pages[p].kv_position = max(q.pages[p].kv_position, min(PAGE_SIZE, end - p * PAGE_SIZE))
                q.prefill_pos = end
        if progressed:
            job.wait_reason = None
            r = job.base_result("prefill")
            r.update(curr_progress=sum(q.prefill_pos for q in job.seqs),
                     max_progress=sum(q.prefill_target for q in job.seqs))
            results.append(r)

    def _copy_partial_page(self, q: SeqState, serial: int) -> None:
        """At a page start, copy K/V from a free page that followed the same prefix and holds the same leading
        tokens (e.g. the previous turn of a chat, whose last page was not full): those tokens skip prefill."""
        pos, target = q.prefill_pos, q.prefill_target
        if not self.copy_partial_pages:
            return
        p = pos // PAGE_SIZE
        if pos % PAGE_SIZE or pos >= target or (p > 0 and p - 1 >= len(q.hashes)):
            return
        page = q.pages[p]
        if page.complete or page.kv_position or page.filler not in (None, serial):
            return
        donor, n = self.page_table.find_partial(q.hashes[p - 1] if p else q.salt, q.ids[pos:target])
        if donor is None or n == 0:
            return
        try:
            self.cache.copy_states(self.cache, donor.index * PAGE_SIZE, n, page.index * PAGE_SIZE, n, 0, 1, 0, 1)
        except NotImplementedError:
            self.copy_partial_pages = False  # e.g. quantized caches: recompute instead
            return
        page.filler, page.kv_position = serial, n
        q.prefill_pos += n
        self.cached_tokens += n

    def _device(self) -> torch.device:
        return self.model.strategy_for_forward().first_device

    def _decode_step(self, jobs: list[ExLlamaV2DynamicJob]) -> tuple[dict[int, int], list[torch.Tensor]]:
        """One batched q_len-1 step over `jobs` (scheduler.decode_step): ({job index: greedy token}, per job its
        logits [rows, 1, V] on the CPU)."""
        greedy, per_job, rows = decode_step(self.model, self.cache, self._device(), jobs, len(self.pieces))
        self.decode_tokens += rows
        return greedy, per_job

    def _sample(self, job: ExLlamaV2DynamicJob, logits: torch.Tensor, results: list[dict[str, Any]]) -> None:
        from exlpy.generator.sampler import ExLlamaV2Sampler

        settings = job.gen_settings or ExLlamaV2Sampler.Settings()
        token, payload, end_filter = job.sample(logits, ExLlamaV2Sampler, settings)
        self._accept(job, token, payload, end_filter, results)

    def _accept(self, job: ExLlamaV2DynamicJob, token: int, payload: dict[str, Any], end_filter: bool,
                results: list[dict[str, Any]]) -> None:
        r = job.receive(token, payload, end_filter)
        for q in job.seqs:
            q.prefill_pos = q.ids.numel() - 1
        if r is not None:
            results.append(r)
            if r["eos"]:
                self._release(job)

    # --- one-call generation -------------------------------------------------------------------------------
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
