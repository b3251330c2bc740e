"""`ExLlamaV2DynamicJob`: one generation request of the dynamic generator and its per-token bookkeeping."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from exlpy.arguments import refuse_unknown_arguments
from exlpy.errors import GeneratorError
from exlpy.generator.dynamic import adapters
from exlpy.generator.dynamic.pages import PAGE_SIZE, CachePage
from exlpy.generator.dynamic.sequence import JobSequence, SeqState
from exlpy.generator.dynamic.stops import (
    Released,
    TextStream,
    heal_split,
    split_stop_conditions,
    token_payload,
    tokenizer_decode,
)
from exlpy.generator.dynamic.validate import check_job_args, check_prompt_ids
from exlpy.generator.filters.base import drop_background, feed_token, schedule_background
from exlpy.generator.filters.device import device_maskable
from exlpy.generator.sampling.batched import RowSample, device_capable
from exlpy.generator.sampling.graphed import graph_capable

if TYPE_CHECKING:
    from exlpy.generator.dynamic.generator import ExLlamaV2DynamicGenerator


class ExLlamaV2DynamicJob:
    """A prompt plus its generation settings. Enqueue it with `generator.enqueue(job)`.

    While the job is not running, `job.wait_reason` says why in plain words: "queued" (not yet considered),
    "batch full (N jobs running)", "waiting for cache pages (...)" with the cache's size and what the job
    needs, "preempted (...)" when a longer-running job needed its pages, or, during prefill, "waiting for
    another job to finish computing a shared prefix page". It is None while the job makes progress. A job
    whose pages can never fit is refused at enqueue() with a GeneratorError instead.
    A job that fails while running (e.g. its filter raises) ends with a result whose `eos_reason` is "error"
    and which carries `error` (the exception) and `error_message`; the other jobs continue.
    """

    @refuse_unknown_arguments
    def __init__(self, input_ids: torch.Tensor | list[torch.Tensor], max_new_tokens: int, min_new_tokens: int = 0,
                 max_skips: int = 4, gen_settings: Any = None, seed: int | None = None,
                 stop_conditions: Iterable[int | str] | None = None, decode_special_tokens: bool = False,
                 return_top_tokens: int = 0, return_logits: bool = False, return_probs: bool = False,
                 filters: list[Any] | None = None, filter_prefer_eos: bool = False, token_healing: bool = False,
                 identifier: Any = None, banned_strings: list[str] | None = None, embeddings: Any = None,
                 loras: Any = None) -> None:
        prompts = list(input_ids) if isinstance(input_ids, (list, tuple)) else [input_ids]
        cfg = gen_settings is not None and getattr(gen_settings, "cfg_scale", None) is not None
        if len(prompts) not in (1, 2) or (len(prompts) == 2) != cfg:
            raise GeneratorError("CFG takes exactly two input_ids (positive, negative) together with "
                                 "gen_settings.cfg_scale; any other job takes one [1, n] tensor and no cfg_scale "
                                 f"(got {len(prompts)} input_ids, cfg_scale "
                                 f"{getattr(gen_settings, 'cfg_scale', None)})")
        for p in prompts:
            if not isinstance(p, torch.Tensor) or p.dim() != 2 or p.shape[0] != 1:
                raise GeneratorError(f"job input_ids must be a [1, n] LongTensor, got "
                                     f"{getattr(p, 'shape', type(p))}")
            if p.shape[1] < 1:
                raise GeneratorError("job input_ids is empty: a prompt needs at least one token")
            check_prompt_ids(p)
        if cfg and token_healing:
            raise GeneratorError("token_healing cannot be combined with CFG")
        check_job_args(max_new_tokens, min_new_tokens, max_skips, seed, return_top_tokens, stop_conditions,
                       banned_strings)
        from exlpy.vision.embedding import check_embeddings

        self.embeddings = check_embeddings(embeddings, what="job embeddings")
        if filters and any(f is not None for f in filters) and banned_strings:
            raise GeneratorError("banned_strings cannot be combined with filters")
        self.all_input_ids = [p.detach().to("cpu", torch.long) for p in prompts]
        self.input_ids = self.all_input_ids[0]
        self.max_new_tokens = max_new_tokens
        self.min_new_tokens = min_new_tokens
        self.max_skips = max_skips
        self.gen_settings = gen_settings
        self.seed = seed
        self.stop_conditions = list(stop_conditions) if stop_conditions is not None else None
        self.decode_special_tokens = decode_special_tokens
        self.return_top_tokens = return_top_tokens
        self.return_logits = return_logits
        self.return_probs = return_probs
        self.filters = [f for f in (filters or []) if f is not None]  # None entries: no filter
        self.filter_prefer_eos = filter_prefer_eos
        self.token_healing = token_healing
        self.identifier = identifier
        self.banned_strings = list(banned_strings or [])
        # LoRA adapters (exlpy extension; None: the generator's set_loras): resolved at enqueue, slot while running
        self.loras = loras
        self.lora_key: tuple[Any, ...] = ()
        self.lora_salt: bytes | None = None
        self.lora_slot = -1

        self.serial: int | None = None
        self.generator: ExLlamaV2DynamicGenerator | None = None
        self.wait_reason: str | None = None
        self.skips = 0
        self.seqs: list[SeqState] = []
        self.cached_pages = 0
        self.new_tokens = 0
        self.full_completion = ""
        self.started = False
        self.finished = False
        self.time_enqueue = 0.0
        self.time_start = 0.0
        self.time_first_token = 0.0
        self.ban_pos = -1
        self.ban_set: set[int] = set()
        # Overlapped decoding: tokens sampled on the device whose values the host has not read yet, and an
        # epoch that any rollback (end, cancel, preemption, rewind) bumps so stale in-flight rows are dropped.
        self.inflight = 0
        self.epoch = 0
        self.admitted = 0  # admission order (the newest running job is preempted first)
        self.preemptions = 0
        self.drafted_tokens = self.accepted_draft_tokens = 0  # speculative decoding
        self.premask_end: set[int] | None = None  # end tokens when the generator masked this step's logits
        self._device_masked: bool | None = None
        self._philox_seed: int | None = None

    # --- setup (called by the generator when the job is enqueued / started) ----------------------------------
    def prepare(self, generator: ExLlamaV2DynamicGenerator, serial: int) -> None:
        from exlpy.generator.sampler import ExLlamaV2Sampler

        self.generator = generator
        self.serial = serial
        self.settings = self.gen_settings if self.gen_settings is not None else ExLlamaV2Sampler.Settings()
        self.time_enqueue = time.time()
        adapters.resolve(generator, self)  # its LoRA adapters, checked, and their prefix-cache salt
        tok = generator.tokenizer
        ids, self.prefix_token, strip = heal_split(self.input_ids[0], generator.pieces, self.token_healing)
        rows = [ids] + [p[0] for p in self.all_input_ids[1:]]
        self.seqs = [SeqState(r.clone(), generator.page_size, self.lora_salt) for r in rows]
        if self.embeddings:
            from exlpy.vision.mm import rope_delta

            for q in self.seqs:  # M-RoPE: text after the images continues at cache position + delta
                q.rope_delta = rope_delta(generator.model.config, q.ids, self.embeddings)
        self.prompt_len = ids.numel()
        conds = self.stop_conditions if self.stop_conditions is not None else generator.default_stop_conditions()
        self.stop_tokens, stop_strings = split_stop_conditions(conds)
        self.stream = TextStream(generator.pieces, lambda t: tokenizer_decode(tok, t, self.decode_special_tokens),
                                 self.stop_tokens, stop_strings, self.banned_strings, generator.special_ids,
                                 self.decode_special_tokens, strip)
        if self.seed is not None:
            self.rng: torch.Generator = torch.Generator().manual_seed(self.seed)
        else:
            self.rng = torch.Generator()
            self.rng.seed()
        # Most pages the job can hold at once: each sequence ends at max_new_tokens or max_seq_len.
        limit = generator.max_seq_len
        self.num_pages = sum(q.pages_for(min(q.ids.numel() + self.max_new_tokens, limit)) for q in self.seqs)

    def admission_needs(self) -> list[tuple[list[bytes], int]]:
        """(prefix hashes, pages) per sequence to start: pages for every token so far (the last one is
        written by the first decode step)."""
        return [(q.hashes, q.pages_for(q.ids.numel())) for q in self.seqs]

    def start(self, reused: int) -> bool:
        """Admitted (again); returns whether this is the first start (a "started" result is due)."""
        first = not self.started
        self.wait_reason = None
        if first:
            self.cached_pages = reused
            self.started = True
            self.time_start = time.time()
            drop_background(self.filters)  # a result left from an earlier job with the same filter objects
            for f in self.filters:
                if hasattr(f, "begin"):
                    f.begin("")
            schedule_background(self.filters)  # the first mask is computed while the prompt is prefilled
        return first

    def preempt(self, reason: str) -> None:
        """Its pages were taken back (the caller released them): recompute the sequence so far later."""
        self.epoch += 1
        self.inflight = 0
        self.premask_end = None  # a mask applied to a step that was dropped
        self.preemptions += 1
        self.wait_reason = reason
        for q in self.seqs:
            q.pages = []
            q.restart()

    def next_position(self, q: SeqState) -> int:
        """Cache position sequence q's next decode step writes (past the tokens fed, in flight included)."""
        return q.ids.numel() - 1 + self.inflight

    @property
    def sequence(self) -> torch.Tensor:
        """The job's token ids (prompt + generated so far), 1-D; for CFG the positive sequence."""
        return self.seqs[0].ids

    @property
    def sequences(self) -> list[JobSequence]:
        """One view per sequence (two for CFG), as exllamav2's `job.sequences`."""
        states: list[SeqState | None] = list(self.seqs) or [None] * len(self.all_input_ids)
        return [JobSequence(p, q, not self.finished) for p, q in zip(self.all_input_ids, states)]

    @property
    def pages(self) -> list[CachePage]:
        return [p for q in self.seqs for p in q.pages]

    def is_prefilled(self) -> bool:
        return all(q.is_prefilled() for q in self.seqs)

    # --- sampling ------------------------------------------------------------------------------------------
    def blocked_tokens(self) -> list[int] | None:
        blocked: set[int] = set()
        if self.new_tokens + self.inflight < self.min_new_tokens:
            blocked |= self.stop_tokens
        if self.ban_pos == self.sequence.numel():
            blocked |= self.ban_set
        return sorted(blocked) if blocked else None

    def device_masked(self) -> bool:
        """Whether the generator applies this job's filters to its logits on the device (grammar filters)."""
        if self._device_masked is None:  # asked every step: the filter list does not change, so ask it once
            self._device_masked = device_maskable(self.filters, self.filter_prefer_eos)
        return self._device_masked

    def device_sampling(self) -> RowSample | None:
        """How to sample the next token on the device, or None when it needs the host sampler (filters other
        than device-masked ones, banned strings, CFG, penalties over the context, token healing's first token,
        per-token extras). A device-masked job's mask is applied to its logits before they are sampled."""
        s = self.settings
        if ((self.filters and not self.device_masked()) or self.banned_strings or len(self.seqs) > 1
                or not device_capable(s) or (self.return_probs or self.return_top_tokens or self.return_logits)
                or (self.prefix_token is not None and self.new_tokens + self.inflight == 0)):
            return None
        return RowSample(s, self.blocked_tokens())

    def graph_sampling(self, vocab: int) -> bool:
        """Whether the generator's captured sampler (exlpy/generator/sampling/graphed.py) can sample this job's
        next token: like `device_sampling`, and penalties over the context are allowed (device token counts)."""
        s = self.settings
        return not ((self.filters and not self.device_masked()) or self.banned_strings or len(self.seqs) > 1
                    or not graph_capable(s, vocab) or self.return_probs or self.return_top_tokens
                    or self.return_logits or (self.prefix_token is not None and self.new_tokens + self.inflight == 0))

    def philox_seed(self) -> int:
        """Key of the in-kernel random numbers of an unseeded job (drawn once from its randomly seeded generator;
        a seeded job's points come from its torch.Generator instead, as the host sampler draws them)."""
        if self._philox_seed is None:
            self._philox_seed = int(torch.randint(0, 2**62, (1,), generator=self.rng))
        return self._philox_seed

    def draw_point(self) -> float:
        """The next random point of this job's generator: what the host sampler would draw for this token."""
        return float(torch.rand(1, 1, generator=self.rng)[0, 0])

    def sample(self, logits: torch.Tensor, sampler: Any, settings: Any, point: float | None = None
               ) -> tuple[int, dict[str, Any], bool]:
        """Sample the next token from logits [1, 1, V] (at `point` when this token's random point was already
        drawn from the job's generator). Returns (token, per-token payload, end_filter)."""
        prefix = self.prefix_token if self.new_tokens == 0 else None
        premasked = self.premask_end is not None  # the generator applied the filters on the device already
        tok, top_tok, top_prob, prob, end_filter = sampler.sample(
            logits, settings, self.sequence.unsqueeze(0), point, self.generator.tokenizer if self.generator else None,
            prefix_token=prefix, return_top_tokens=self.return_top_tokens,
            blocked_tokens=self.blocked_tokens(), filters=None if premasked else (self.filters or None),
            filter_prefer_eos=self.filter_prefer_eos, generator=None if point is not None else self.rng)
        token = int(tok.view(-1)[0])
        if premasked:
            end_filter = torch.tensor(token in self.premask_end)  # type: ignore[operator]
        # CFG: the positive row's logits
        payload = token_payload(prob, top_tok, top_prob, logits[0], self.return_probs, self.return_top_tokens,
                                self.return_logits)
        return token, payload, bool(end_filter)

    def receive(self, token: int, payload: dict[str, Any], end_filter: bool) -> dict[str, Any] | None:
        """Append a sampled token; return the streaming result for it, or None when all of it is held."""
        if self.new_tokens == 0:
            self.time_first_token = time.time()
        new = torch.tensor([token], dtype=torch.long)
        for q in self.seqs:
            q.ids = torch.cat([q.ids, new])
        self.new_tokens += 1
        self.premask_end = None
        feed_token(self.filters, token)
        if self.filters and not end_filter and self.new_tokens < self.max_new_tokens:
            # The next mask is computed in a worker while this thread goes on (the text below) and the GPU runs
            # the next step's forward pass; a job that a stop condition ends here drops it when released.
            schedule_background(self.filters)
        rel = self.stream.add(token, payload)
        if rel.rewind:
            self.new_tokens -= rel.rewind
            self.epoch += 1
            for q in self.seqs:
                q.truncate(rel.rewind)
            if self.ban_pos != self.sequence.numel():
                self.ban_pos, self.ban_set = self.sequence.numel(), set()
            assert rel.ban is not None
            self.ban_set.add(rel.ban)
            # exllamav2 reports what a banned string suppressed, in a result of its own.
            r = self.base_result("streaming")
            r.update(text="", token_ids=torch.empty(1, 0, dtype=torch.long), suppressed_text=rel.suppressed_text,
                     suppressed_tokens=torch.tensor([rel.suppressed_tokens], dtype=torch.long))
            return r
        if not rel.eos:
            assert self.generator is not None
            if end_filter:
                rel = self._end(rel, "end_filter")
            elif self.new_tokens >= self.max_new_tokens or max(q.ids.numel() for q in self.seqs) >= \
                    self.generator.max_seq_len:
                rel = self._end(rel, "max_new_tokens")
        return self._result(rel)

    def _end(self, rel: Released, reason: str) -> Released:
        """`rel` plus everything still held, marked as the end."""
        return self.stream.end(rel, reason)

    def _result(self, rel: Released) -> dict[str, Any] | None:
        self.full_completion += rel.text
        if not rel.eos and not rel.text and not rel.tokens:
            return None
        r: dict[str, Any] = self.base_result("streaming")
        r["eos"] = rel.eos
        r["text"] = rel.text
        r["token_ids"] = torch.tensor(rel.tokens, dtype=torch.long).unsqueeze(0)
        if self.return_probs:
            r["token_probs"] = torch.tensor([p.get("prob", 0.0) for p in rel.payloads]).unsqueeze(0)
        if self.return_top_tokens and rel.payloads:
            r["top_k_tokens"] = torch.stack([p["top_tokens"] for p in rel.payloads]).unsqueeze(0)
            r["top_k_probs"] = torch.stack([p["top_probs"] for p in rel.payloads]).unsqueeze(0)
        if self.return_logits and rel.payloads:
            r["logits"] = torch.stack([p["logits"] for p in rel.payloads]).unsqueeze(0)
        if rel.eos:
            self.finished = True
            self.add_final_fields(r, rel.eos_reason or "", rel.trigger, rel)
        return r

    def base_result(self, stage: str) -> dict[str, Any]:
        r: dict[str, Any] = {"job": self, "stage": stage, "eos": False, "serial": self.serial}
        if self.identifier is not None:
            r["identifier"] = self.identifier
        return r

    def add_final_fields(self, r: dict[str, Any], reason: str, trigger: Any = None,
                         rel: Released | None = None) -> None:
        now = time.time()
        r["eos_reason"] = reason
        if reason == "stop_token":
            r["eos_triggering_token_id"] = trigger
        elif reason == "stop_string":
            r["eos_triggering_string"] = trigger
        r["full_completion"] = self.full_completion
        r["new_tokens"] = self.new_tokens
        r["prompt_tokens"] = self.prompt_len
        r["time_enqueued"] = self.time_start - self.time_enqueue
        r["time_prefill"] = (self.time_first_token or now) - self.time_start
        r["time_generate"] = now - (self.time_first_token or now)
        if self.generator is not None and self.generator.spec is not None:  # exllamav2: only when drafting
            r["accepted_draft_tokens"] = self.accepted_draft_tokens
            r["rejected_draft_tokens"] = self.drafted_tokens - self.accepted_draft_tokens
        # What was held back and never emitted: after a stop string, the stop string (and any text after it).
        r["held"] = {"text": rel.held_text if rel else "",
                     "token_ids": torch.tensor([rel.held_tokens if rel else []], dtype=torch.long)}
        r["cached_pages"] = self.cached_pages
        r["cached_tokens"] = min(self.cached_pages * (self.seqs[0].page_size if self.seqs else PAGE_SIZE),
                                 self.prompt_len)
