"""`ExLlamaV2StreamingGenerator`: one sequence, a contiguous cache, text streamed chunk by chunk.

The cache keeps the K/V of the previous sequence; a new prompt that shares a prefix with it only runs the
tokens after the common prefix. Invariant between streams: `cache.current_seq_len == len(sequence) - 1`; the
last token is fed at the next step, which yields the logits for the token after it.

While streaming, a step whose token depends only on its logits (no filters, banned strings, CFG, penalties or
per-token extras) is sampled on the device, and `stream_ex()` launches the following step, fed by that token
on the device, before it reads the token: the cache is then one token ahead (exlpy/generator/stream_steps.py).
A stream that ends (or a new `begin_stream_ex`) discards that step, so the outputs are the same as stepping
one token at a time.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import torch

from exlpy.arguments import refuse_unknown_arguments
from exlpy.engine.graphs import MAX_Q_LEN
from exlpy.errors import GeneratorError, NotSupportedError
from exlpy.generator import stream_steps
from exlpy.generator.base import ExLlamaV2BaseGenerator
from exlpy.generator.dynamic.stops import (
    Released,
    TextStream,
    heal_split,
    split_stop_conditions,
    token_payload,
    tokenizer_decode,
)
from exlpy.generator.filters.base import drop_background, feed_token, schedule_background
from exlpy.generator.filters.device import collect, device_maskable, mask_rows
from exlpy.generator.sampling import graphed
from exlpy.generator.sampling.graphed import GraphSampler
from exlpy.generator.speculative.checks import check_draft
from exlpy.generator.speculative.ngram import NgramIndex
from exlpy.generator.speculative.streaming import StreamSpeculation, speculative_round
from exlpy.generator.speculative.verify import speculation_capable
from exlpy.generator.stream_output import stream_result, unpad_rows
from exlpy.lora.slots import adapter_rows
from exlpy.model.batch import cache_rows_batch


class ExLlamaV2StreamingGenerator(ExLlamaV2BaseGenerator):
    """Streams one sequence; also the base generator's `generate_simple()`, `warmup()` and `full()`."""

    @refuse_unknown_arguments
    def __init__(self, model: Any, cache: Any, tokenizer: Any, draft_model: Any = None, draft_cache: Any = None,
                 num_speculative_tokens: int | None = None) -> None:
        """exllamav2's arguments. `num_speculative_tokens` None (exlpy's default) adapts the draft length to the
        acceptance rate; a number fixes it. N-gram drafting: set `speculative_ngram = True`."""
        check_draft(model, cache, tokenizer, draft_model, draft_cache, num_speculative_tokens, False, MAX_Q_LEN,
                    paged=False)
        super().__init__(model, cache, tokenizer)
        # exllamav2's speculative-decoding settings (exlpy/generator/speculative/streaming.py).
        self.draft_model, self.draft_cache = draft_model, draft_cache
        self.num_speculative_tokens = num_speculative_tokens
        self.speculative_prob_threshold = 0.25
        self.speculative_ngram = False
        self.speculative_ngram_min, self.speculative_ngram_max = 1, 5
        self.speculative_ngram_max_inf, self.speculative_ngram_threshold = 3, 1
        self.ngram_preloaded: list[int] | None = None
        self.total_draft_tokens = self.accepted_draft_tokens = 0
        self.token_budget: int | None = None  # exlpy: most tokens the next stream_ex() may return (speculation)
        self.pieces: list[str] = tokenizer.get_id_to_piece_list(True)
        self.spec = StreamSpeculation(model, cache, draft_model, draft_cache, num_speculative_tokens, MAX_Q_LEN - 1,
                                      len(self.pieces))
        self.special_ids = set(getattr(tokenizer, "extended_id_to_piece", {}) or {})
        self.stop_tokens: set[int] = {tokenizer.eos_token_id}
        self.stop_strings: list[str] = []
        self.prefill_tokens = 0  # prompt tokens actually run through the model (prefix reuse skips the rest)
        self.total_tokens = 0  # tokens sampled over all streams (exllamav2's get_sd_stats counter)
        self.active = False
        self.reusable = True
        self.negative = None
        self.embeddings: list[Any] = []  # this stream's ExLlamaV2MMEmbeddings (input_embeddings)
        self.rope_delta = 0  # M-RoPE position shift after its images (exlpy/vision/mm.py)
        self.pending: stream_steps.Pending | None = None  # a launched step whose token is not read yet
        self.rng: torch.Generator | None = None
        # Sample through the captured sampler (exlpy/generator/sampling/graphed.py): None = where decode steps
        # are CUDA graphs; True / False force it (tests compare both paths on the CPU).
        self.graph_sampling: bool | None = None
        self.graphed: GraphSampler | None = None
        self._counted = -1  # tokens the captured sampler's penalty counts hold (-1: rebuild them)
        self.default_loras: Any = None  # set_loras (exlpy/lora/): adapters of streams begun without loras=
        self.loras: tuple[Any, ...] = ()  # this stream's adapters
        self._cached_loras: tuple[Any, ...] = ()  # the adapters that computed the cached K/V

    def set_loras(self, loras: Any) -> None:
        """LoRA adapters for streams begun later without `loras=` (None or [] for none)."""
        from exlpy.lora.slots import normalize

        self.default_loras = normalize(loras, self.model)

    def set_stop_conditions(self, stop_conditions: Iterable[int | str]) -> None:
        self.stop_tokens, self.stop_strings = split_stop_conditions(stop_conditions)

    # --- begin ---------------------------------------------------------------------------------------------
    @refuse_unknown_arguments
    def begin_stream(self, input_ids: torch.Tensor, gen_settings: Any, token_healing: bool = False,
                     loras: Any = None, input_mask: torch.Tensor | None = None,
                     position_offsets: torch.Tensor | None = None, **kwargs: Any) -> None:
        self.begin_stream_ex(input_ids, gen_settings, token_healing, loras, input_mask, position_offsets,
                             **kwargs)

    @refuse_unknown_arguments
    def begin_stream_ex(self, input_ids: torch.Tensor, gen_settings: Any, token_healing: bool = False,
                        loras: Any = None, input_mask: torch.Tensor | None = None,
                        position_offsets: torch.Tensor | None = None, return_probabilities: bool = False,
                        return_top_tokens: int = 0, return_logits: bool = False,
                        abort_event: threading.Event | None = None, input_embeddings: Any = None,
                        decode_special_tokens: bool = False, banned_strings: list[str] | None = None,
                        filters: list[Any] | None = None, filter_prefer_eos: bool = False,
                        min_new_tokens: int = 0) -> None:
        from exlpy.lora.slots import normalize

        self.loras = normalize(loras if loras is not None else self.default_loras, self.model)
        from exlpy.vision.embedding import check_embeddings

        embeddings = check_embeddings(input_embeddings, self.model, "input_embeddings")
        if embeddings and (self.draft_model is not None or self.speculative_ngram):
            raise NotSupportedError("input_embeddings cannot be combined with speculative decoding (as in "
                                    "exllamav2)")
        filters = [f for f in (filters or []) if f is not None]  # None entries: no filter
        if filters and banned_strings:
            raise GeneratorError("banned_strings cannot be combined with filters")
        self._discard()
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        cfg = getattr(gen_settings, "cfg_scale", None) is not None
        if input_ids.dim() != 2 or input_ids.shape[0] != (2 if cfg else 1) or input_ids.shape[1] < 1:
            raise GeneratorError(f"input_ids must be a non-empty [1, n] tensor, or [2, n] (positive, negative) "
                                 f"with gen_settings.cfg_scale; got shape {tuple(input_ids.shape)} and cfg_scale "
                                 f"{getattr(gen_settings, 'cfg_scale', None)}")
        if cfg and token_healing:
            raise GeneratorError("token_healing cannot be combined with CFG")
        if cfg and self.cache.batch_size < 2:
            raise GeneratorError(f"CFG needs a cache with batch_size >= 2, got {self.cache.batch_size}")
        if embeddings and cfg:
            raise NotSupportedError("input_embeddings cannot be combined with CFG in the streaming generator")
        rows = unpad_rows(input_ids.detach().to("cpu", torch.long), input_mask)
        if embeddings:
            from exlpy.vision.mm import check_mm_ids

            check_mm_ids(rows[0], self.model.config.vocab_size, embeddings, "input_ids")
        self.embeddings = embeddings
        if max(r.numel() for r in rows) >= self.cache.max_seq_len:
            raise GeneratorError(f"prompt of {max(r.numel() for r in rows)} tokens does not fit the cache "
                                 f"(max_seq_len {self.cache.max_seq_len}) with room for a new token")
        ids = rows[0].unsqueeze(0)
        self.settings = gen_settings
        self.return_probabilities = return_probabilities
        self.return_top_tokens = return_top_tokens
        self.return_logits = return_logits
        self.abort_event = abort_event
        self.filters = list(filters or [])
        self.filter_prefer_eos = filter_prefer_eos
        self.min_new_tokens = min_new_tokens
        # Padding is stripped (rows sit unpadded in their cache rows), so masks and offsets are not needed.
        self.negative: torch.Tensor | None = rows[1] if cfg else None
        row, self.prefix_token, strip = heal_split(ids[0], self.pieces, token_healing)
        ids = row.unsqueeze(0)
        self.text_stream = TextStream(self.pieces, lambda t: tokenizer_decode(self.tokenizer, t, decode_special_tokens),
                                 self.stop_tokens, self.stop_strings, banned_strings, self.special_ids,
                                 decode_special_tokens, strip)
        self._prefill(ids)
        self.new_tokens = 0
        self.ban_pos, self.ban_set = -1, set()
        self.rng = None  # global torch RNG (torch.manual_seed) unless set_seed()
        self._counted = -1  # a new sequence: the captured sampler's penalty counts are rebuilt
        drop_background(self.filters)  # a result left from an earlier stream with the same filter objects
        for f in self.filters:
            if hasattr(f, "begin"):
                f.begin("")
        schedule_background(self.filters)
        self.premask_end: set[int] | None = None
        self.active = True

    def _prefill(self, ids: torch.Tensor) -> None:
        """Run ids[:-1] into the cache, reusing the cached prefix shared with the previous sequence."""
        if self.negative is not None:
            self._prefill_cfg(ids)
            return
        reuse = 0
        old = self.sequence_ids
        if old is not None and self.reusable and self._cached_loras == self.loras:  # K/V depends on adapters
            n = min(old.shape[1], ids.shape[1] - 1, self.cache.current_seq_len)
            diff = (old[0, :n] != ids[0, :n]).nonzero()
            reuse = int(diff[0, 0]) if diff.numel() else n
        self.cache.current_seq_len = reuse
        self.spec.reset_sequence(reuse)
        self._cached_loras = self.loras
        if self.embeddings:
            self._prefill_mm(ids, reuse)
        elif ids.shape[1] - 1 > reuse:
            self.model.forward(ids[:, reuse:-1], self.cache, preprocess_only=True, loras=self.loras)
            self.prefill_tokens += ids.shape[1] - 1 - reuse
        self.sequence_ids = ids
        self.reusable = True

    def _prefill_mm(self, ids: torch.Tensor, reuse: int) -> None:
        """Prefill a prompt that holds embeddings: chunks with their image rows and M-RoPE angles."""
        from exlpy.vision.mm import chunk_inputs, extend_to_image_end, rope_delta

        cfg, dev = self.model.config, self.model.strategy_for_forward().first_device
        self.rope_delta = rope_delta(cfg, ids[0], self.embeddings)
        pos, end = reuse, ids.shape[1] - 1
        while pos < end:
            n = extend_to_image_end(cfg, ids[0], pos + min(end - pos, cfg.max_input_len), end, self.embeddings) - pos
            with adapter_rows(self.model, self.loras) as (slot, _):
                batch = cache_rows_batch(self.cache, [0], [pos], n, dev, [slot])
                batch.mm = chunk_inputs(cfg, ids[0], pos, pos + n, self.embeddings)
                if batch.mm.rope is not None:
                    batch.rope_positions = torch.arange(n, device=dev).view(1, -1)
                self.model.forward_batch(ids[:, pos:pos + n], batch, preprocess_only=True)
            pos += n
            self.cache.current_seq_len = pos
        self.prefill_tokens += max(0, end - reuse)

    def _logits_mm(self, seq: torch.Tensor) -> torch.Tensor:
        """The next token's logits after a prompt with embeddings (the position shift of M-RoPE applied)."""
        from exlpy.vision.mm import MMInputs

        dev = self.model.strategy_for_forward().first_device
        past = seq.shape[1] - 1
        with adapter_rows(self.model, self.loras) as (slot, _):
            batch = cache_rows_batch(self.cache, [0], [past], 1, dev, [slot])
            batch.mm = MMInputs(self.embeddings)
            if self.rope_delta:
                batch.rope_positions = (batch.positions + self.rope_delta).clamp(min=0)
            out = self.model.forward_batch(seq[:, -1:], batch)
        self.cache.current_seq_len = past + 1
        return out.float().cpu()

    def _prefill_cfg(self, ids: torch.Tensor) -> None:
        """CFG: positive and negative prompt in cache rows 0 and 1, each from position 0."""
        assert self.negative is not None
        dev = self.model.strategy_for_forward().first_device
        for b, row in enumerate((ids[0], self.negative)):
            if row.numel() > 1:
                with adapter_rows(self.model, self.loras) as (slot, _):
                    self.model.forward_batch(row[:-1].unsqueeze(0), cache_rows_batch(self.cache, [b], [0],
                                             row.numel() - 1, dev, [slot]), preprocess_only=True)
                self.prefill_tokens += row.numel() - 1
        self.sequence_ids = ids
        self.spec.reset_sequence(0)
        self.reusable = False  # the cache no longer holds one plain sequence: the next prompt starts over
        self.cache.current_seq_len = 0

    def _logits(self) -> torch.Tensor:
        """Logits [rows, 1, V] (CPU) for the token after the current sequence (two rows for CFG)."""
        seq = self.sequence_ids
        assert seq is not None
        if self.negative is None and self.embeddings:
            return self._logits_mm(seq)
        if self.negative is None:
            out = self.model.forward(seq[:, -1:], self.cache, loras=self.loras)
            self.premask_end = None
            if device_maskable(self.filters, self.filter_prefer_eos):  # grammar filters: mask on the device
                mask, self.premask_end = collect(self.filters)
                out = mask_rows(out[:, -1], [0], [mask]).unsqueeze(1)
            return out.float().cpu()
        ids = torch.stack([seq[0, -1:], self.negative[-1:]])
        with adapter_rows(self.model, self.loras) as (slot, _):
            batch = cache_rows_batch(self.cache, [0, 1], [seq.shape[1] - 1, self.negative.numel() - 1], 1,
                                     self.model.strategy_for_forward().first_device, [slot, slot])
            return self.model.forward_batch(ids, batch).float().cpu()

    def set_seed(self, seed: int) -> None:
        """Make the following samples reproducible (exlpy extension; call after begin_stream_ex)."""
        from exlpy.generator.dynamic.validate import seeded_rng

        rng = seeded_rng(seed)  # checked before the launched step is dropped
        self._discard()
        self.rng = rng

    def _discard(self) -> None:
        """Drop the launched step whose token is not read yet (the cache goes back to the invariant)."""
        self._counted = -1  # the captured sampler counted that token: its counts are rebuilt on next use
        if self.pending is not None:
            stream_steps.discard(self.pending, self.cache, self.rng)
            self.pending = None

    def _device_plan(self) -> stream_steps.RowSample | None:
        """How to sample the next token on the device, or None when it needs the host sampler."""
        from exlpy.generator.sampling.batched import device_capable

        s = self.settings
        graph = (self._graph_device() is not None
                 and graphed.graph_capable(s, int(self.model.config.vocab_size)))
        if (self.negative is not None or self.embeddings or self.filters or self.text_stream.banned
                or not (device_capable(s) or graph)
                or self.return_top_tokens or self.return_logits or self.ban_pos >= 0
                or (self.prefix_token is not None and self.new_tokens == 0)):
            return None
        blocked = sorted(self.stop_tokens) if self.new_tokens < self.min_new_tokens else None
        return stream_steps.RowSample(s, blocked)

    def _graph_device(self) -> torch.device | None:
        """Where the captured sampler would run (the head's device), or None when the stream does not use it
        (`graph_sampling`: None = where decode steps are CUDA graphs; True / False force it)."""
        head = self.model.modules[self.model.head_layer_idx]
        device = torch.device(getattr(head, "device", None) or "cpu")
        if self.graphed is not None and self.graphed.failed:
            return None
        return device if graphed.wanted(self.model, device, self.graph_sampling) else None

    def _graph_sampler(self, logits: torch.Tensor, inflight: torch.Tensor | None
                       ) -> tuple[GraphSampler, int] | None:
        """The captured sampler for this stream's logits and the slot of its penalty counts (-1: no penalties),
        or None where the stream samples with `sample_rows`. The counts hold the sequence plus the token still
        in flight (`inflight`, on the device); rebuilt when they do not."""
        if not graphed.wanted(self.model, logits.device, self.graph_sampling) or \
                (self.graphed is not None and self.graphed.failed):
            return None
        g = self.graphed
        if g is None or g.device != logits.device or g.vocab != logits.shape[-1]:
            g = self.graphed = graphed.for_logits(logits, 1, self.tokenizer)
            self._counted = -1
        if not graphed.has_penalties(self.settings):
            return g, -1
        seq = self.sequence_ids
        assert seq is not None
        expected = seq.shape[1] + (inflight is not None)
        if self._counted != expected:
            ids = seq[0].to(g.device, non_blocking=True)
            g.bind_counts(0, ids if inflight is None else torch.cat([ids, inflight.view(-1)]))
        self._counted = expected + 1  # the step counts the token it samples
        return g, 0

    def _verify_sampler(self, logits: torch.Tensor) -> GraphSampler | None:
        """The captured sampler that verifies speculative rounds, or None (see `_graph_sampler`)."""
        use = self._graph_sampler(logits[:, -1], None) if not graphed.has_penalties(self.settings) else None
        return None if use is None else use[0]

    def _stream_device(self, plan: stream_steps.RowSample) -> dict[str, Any]:
        """One token through the overlapped path: launch the step after it, then read it."""
        seq = self.sequence_ids
        assert seq is not None
        if self.pending is None:
            self.pending = stream_steps.launch(self.model, self.cache, seq[:, -1:], plan, self.rng, self.tokenizer,
                                               self.loras, lambda lg: self._graph_sampler(lg, None))
        current = self.pending
        self.pending = None
        if seq.shape[1] + 1 < self.cache.max_seq_len:
            after = stream_steps.RowSample(plan.settings, sorted(self.stop_tokens)
                                           if self.new_tokens + 1 < self.min_new_tokens else None)
            self.pending = stream_steps.launch(self.model, self.cache, current.token.view(1, 1), after, self.rng,
                                               self.tokenizer, self.loras,
                                               lambda lg, t=current.token: self._graph_sampler(lg, t))
        token, prob = current.read()
        r = self._take(token, {"prob": prob}, False)
        if r["eos"]:
            self._discard()
        return r

    def get_sd_stats(self) -> tuple[float, float, int, int, int]:
        """(efficiency, accuracy, total tokens, drafted tokens, accepted drafts) of speculative decoding:
        efficiency = accepted drafts / tokens, accuracy = accepted / drafted (0 without drafts)."""
        t, d, a = self.total_tokens, self.total_draft_tokens, self.accepted_draft_tokens
        return (a / t if t else 0.0), (a / d if d else 0.0), t, d, a

    def reset_sd_stats(self) -> None:
        """Zero the counters get_sd_stats() reports."""
        self.total_tokens = self.total_draft_tokens = self.accepted_draft_tokens = 0

    def ngram_preload(self, input_ids: torch.Tensor | list[int] | str) -> None:
        """Index example token ids ([1, n] tensor or a list; exlpy also takes text) for n-gram drafting
        (`speculative_ngram = True`): the sequence's own n-grams are searched first, then these."""
        if isinstance(input_ids, str):
            input_ids = self.tokenizer.encode(input_ids)
        ids = input_ids.reshape(-1).tolist() if isinstance(input_ids, torch.Tensor) else [int(t) for t in input_ids]
        self.ngram_preloaded = ids
        self._preload = NgramIndex(self.speculative_ngram_max, self.speculative_ngram_min)
        self._preload.extend(ids)

    def generate_simple(self, *args: Any, **kwargs: Any) -> str | list[str]:
        """The base generator's generate_simple() on this generator's cache; any stream in progress ends (the
        cache now holds the batch)."""
        self._discard()
        self.active = False
        self.reusable = False
        return super().generate_simple(*args, **kwargs)

    def warmup(self) -> None:
        self._discard()
        self.active = False
        super().warmup()

    # --- stream --------------------------------------------------------------------------------------------
    def stream(self) -> tuple[str, bool, torch.Tensor]:
        """Legacy form: (chunk, eos, chunk_token_ids)."""
        r = self.stream_ex()
        return r["chunk"], r["eos"], r["chunk_token_ids"]

    def stream_ex(self, ban_tokens: list[int] | None = None) -> dict[str, Any]:
        """One step: {"chunk", "eos", "chunk_token_ids"} (+ probs/top_tokens/logits when asked, "suppressed"
        when a banned string was just removed). `ban_tokens` are disallowed for this step only."""
        if not self.active or self.sequence_ids is None:
            raise GeneratorError("stream_ex() called without an active stream: call begin_stream_ex() first")
        if self.abort_event is not None and self.abort_event.is_set():
            self._discard()
            return self._result(self.text_stream.end(Released(), "aborted"))
        longest = max(self.sequence_ids.shape[1], self.negative.numel() if self.negative is not None else 0)
        if longest >= self.cache.max_seq_len:
            self._discard()
            return self._result(self.text_stream.end(Released(), "max_seq_len"))
        plan = self._device_plan() if not ban_tokens else None  # a step launched earlier did not ban them
        if plan is not None and (self.draft_model is not None or self.speculative_ngram) \
                and not self.return_probabilities and not plan.blocked and speculation_capable(plan.settings):
            r = speculative_round(self, plan)
            if r is not None:
                return r
        if plan is not None:
            return self._stream_device(plan)
        self._discard()
        from exlpy.generator.sampler import ExLlamaV2Sampler

        seq = self.sequence_ids
        logits = self._logits()
        blocked: set[int] = set(self.stop_tokens) if self.new_tokens < self.min_new_tokens else set()
        if self.ban_pos == seq.shape[1]:
            blocked |= self.ban_set
        if ban_tokens:
            blocked |= {int(t) for t in ban_tokens}
        tok, top_tok, top_prob, prob, end_filter = ExLlamaV2Sampler.sample(
            logits[:, -1:], self.settings, seq, None, self.tokenizer,
            prefix_token=self.prefix_token if self.new_tokens == 0 else None,
            return_top_tokens=self.return_top_tokens, blocked_tokens=sorted(blocked) or None,
            filters=None if self.premask_end is not None else (self.filters or None),
            filter_prefer_eos=self.filter_prefer_eos, generator=self.rng)
        token = int(tok.view(-1)[0])
        if self.premask_end is not None:
            end_filter = torch.tensor(token in self.premask_end)
        # CFG: the positive row's logits
        payload = token_payload(prob, top_tok, top_prob, logits[0, -1], True, self.return_top_tokens,
                                self.return_logits)
        return self._take(token, payload, bool(end_filter))

    def end_stream(self, reason: str = "max_new_tokens") -> dict[str, Any]:
        """exlpy: end the stream now (a token budget is spent) and release the text still held back, e.g. the
        first bytes of a character whose last byte was never sampled. Nothing more is sampled: the result's
        `chunk_token_ids` are tokens already generated."""
        if not self.active:
            raise GeneratorError("end_stream() called without an active stream")
        self._discard()
        return self._result(self.text_stream.end(Released(), reason))

    def _feed(self, token: int, payload: dict[str, Any]) -> Released:
        """Append one token (no filters or banned strings: speculation runs without them) and release text."""
        seq = self.sequence_ids
        assert seq is not None
        self.sequence_ids = torch.cat([seq, torch.tensor([[token]])], dim=1)
        self.new_tokens += 1
        self.total_tokens += 1
        return self.text_stream.add(token, payload)

    def _take(self, token: int, payload: dict[str, Any], end_filter: bool) -> dict[str, Any]:
        """Append a sampled token and turn it into this call's result."""
        seq = self.sequence_ids
        assert seq is not None
        self.sequence_ids = torch.cat([seq, torch.tensor([[token]])], dim=1)
        if self.negative is not None:
            self.negative = torch.cat([self.negative, torch.tensor([token])])
        self.new_tokens += 1
        self.total_tokens += 1
        feed_token(self.filters, token)
        rel = self.text_stream.add(token, payload)
        if not rel.eos and not end_filter:
            schedule_background(self.filters)
        if rel.rewind:
            self._rewind(rel)
            out = self._result(Released())
            out["suppressed"] = rel.suppressed_text  # as exllamav2: the banned text that was taken back
            return out
        if not rel.eos and end_filter:
            rel = self.text_stream.end(rel, "end_filter")
        return self._result(rel)

    def _rewind(self, rel: Released) -> None:
        """A banned string matched: drop its tokens and ban the first of them at that position."""
        assert self.sequence_ids is not None and rel.ban is not None
        self.sequence_ids = self.sequence_ids[:, :-rel.rewind]
        if self.negative is not None:
            self.negative = self.negative[:-rel.rewind]
        self.new_tokens -= rel.rewind
        self.cache.current_seq_len = self.sequence_ids.shape[1] - 1
        pos = self.sequence_ids.shape[1]
        if self.ban_pos != pos:
            self.ban_pos, self.ban_set = pos, set()
        self.ban_set.add(rel.ban)

    def _result(self, rel: Released) -> dict[str, Any]:
        if rel.eos:
            self.active = False
        return stream_result(rel, self.return_probabilities, self.return_top_tokens, self.return_logits,
                             len(self.pieces))
