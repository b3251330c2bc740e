"""`ExLlamaV2BaseGenerator`: the simple batched generator (one unpadded cache row per prompt, ragged decode)."""

from __future__ import annotations

import threading
from typing import Any

import torch

from exlpy.arguments import refuse_unknown_arguments
from exlpy.errors import GeneratorError, NotSupportedError
from exlpy.generator.filters.base import feed_token
from exlpy.model.batch import cache_rows_batch


class ExLlamaV2BaseGenerator:
    def __init__(self, model: Any, cache: Any, tokenizer: Any) -> None:
        self.model, self.cache, self.tokenizer = model, cache, tokenizer
        self.sequence_ids: torch.Tensor | None = None
        self._slot = -1  # the LoRA adapter slot of the current generate_simple call's rows (exlpy/lora/)
        self.abort_event: threading.Event | None = None

    def warmup(self) -> None:
        """One small forward pass through the cache, so first-call costs (allocation, kernel compilation) are
        paid before timing starts. The cache is left empty."""
        self.cache.current_seq_len = 0
        self.model.forward(torch.tensor([[self.tokenizer.bos_token_id or 1]]), self.cache, preprocess_only=True)
        self.cache.current_seq_len = 0
        self.sequence_ids = None

    def full(self) -> bool:
        """Whether the current sequence has reached the model's max_seq_len (or the cache's, if smaller)."""
        if self.sequence_ids is None:
            return False
        return self.sequence_ids.shape[-1] >= min(self.model.config.max_seq_len, self.cache.max_seq_len)

    @refuse_unknown_arguments
    def generate_simple(self, prompt: str | list[str], gen_settings: Any, num_tokens: int, seed: int | None = None,
                        token_healing: bool = False, encode_special_tokens: bool = False,
                        decode_special_tokens: bool = False, loras: Any = None, stop_token: int | None = -1,
                        add_bos: bool = False, abort_event: threading.Event | None = None,
                        input_embeddings: Any = None, completion_only: bool = False,
                        filters: list[Any] | None = None, filter_prefer_eos: bool = False) -> str | list[str]:
        """Generate `num_tokens` tokens for a prompt or a batch of prompts (left-padded).

        Every row stops at `stop_token` (-1: the tokenizer's EOS, None: never); the batch stops when all rows
        have. Returns prompt + completion per row (completion only with `completion_only`).
        """
        from exlpy.generator.sampler import ExLlamaV2Sampler

        if loras:  # every row uses `loras`: their adapter slot is held for the call
            from exlpy.lora.slots import adapter_rows

            with adapter_rows(self.model, loras) as (self._slot, _):
                try:
                    return self.generate_simple(prompt, gen_settings, num_tokens, seed, token_healing,
                                                encode_special_tokens, decode_special_tokens, None, stop_token,
                                                add_bos, abort_event, input_embeddings, completion_only, filters,
                                                filter_prefer_eos)
                finally:
                    self._slot = -1
        if input_embeddings is not None:
            raise NotSupportedError("input_embeddings (multimodal inputs) are not supported by exlpy's generators")
        self.abort_event = abort_event
        single = isinstance(prompt, str)
        prompts = [prompt] if single else list(prompt)
        if not prompts:
            raise GeneratorError("generate_simple() got an empty list of prompts")
        rows = [self.tokenizer.encode(p, add_bos=add_bos, encode_special_tokens=encode_special_tokens)[0]
                for p in prompts]
        B = len(rows)
        if B > self.cache.batch_size:
            raise GeneratorError(f"{B} prompts exceed the cache's batch_size {self.cache.batch_size}")
        if token_healing:
            heal = [int(r[-1]) if r.numel() > 1 else None for r in rows]
            rows = [r[:-1] if r.numel() > 1 else r for r in rows]
        else:
            heal = [None] * B
        if min(r.numel() for r in rows) < 1:
            raise GeneratorError("a prompt encodes to no tokens; pass add_bos=True or a non-empty prompt")
        L = max(r.numel() for r in rows)
        if L + num_tokens > self.cache.max_seq_len:
            raise GeneratorError(f"prompt ({L} tokens) + num_tokens ({num_tokens}) exceeds the cache's "
                                 f"max_seq_len {self.cache.max_seq_len}")
        lens = [r.numel() for r in rows]
        # Seeded: a private generator (reproducible whatever else draws random numbers); else the global RNG.
        from exlpy.generator.dynamic.validate import seeded_rng

        gen = seeded_rng(seed) if seed is not None else None
        stop = self.tokenizer.eos_token_id if stop_token == -1 else stop_token
        filters = list(filters or [])
        if filters and B > 1:
            raise GeneratorError("filters work with a single prompt only")
        for f in filters:
            if hasattr(f, "begin"):
                f.begin("")

        # Each row lives unpadded at the start of its own cache row, so positions equal cache indices and no
        # attention mask is needed: prompts are prefilled row by row, then all rows decode together with their
        # own lengths (ragged q_len-1 batch).
        dev = self.model.strategy_for_forward().first_device
        self.cache.current_seq_len = 0
        for b, r in enumerate(rows):
            if lens[b] > 1:
                self.model.forward_batch(r[:-1].unsqueeze(0), cache_rows_batch(self.cache, [b], [0], lens[b] - 1, dev,
                                                                                [self._slot]), preprocess_only=True)
        done = [False] * B
        new_tokens: list[list[int]] = [[] for _ in range(B)]
        seqs = [r.clone() for r in rows]
        for _ in range(num_tokens):
            if abort_event is not None and abort_event.is_set():
                break
            ids = torch.stack([q[-1:] for q in seqs])
            starts = [q.numel() - 1 for q in seqs]
            batch = cache_rows_batch(self.cache, list(range(B)), starts, 1, dev, [self._slot] * B)
            logits = self.model.forward_batch(ids, batch).float().cpu()
            nxt = torch.empty(B, 1, dtype=torch.long)
            for b in range(B):
                row_seq = seqs[b].unsqueeze(0)
                tok, _, _, _, end_filter = ExLlamaV2Sampler.sample(
                    logits[b:b + 1, -1:], gen_settings, row_seq, None, self.tokenizer,
                    prefix_token=heal[b] if not new_tokens[b] else None, filters=filters or None,
                    filter_prefer_eos=filter_prefer_eos, generator=gen)
                t = int(tok.view(-1)[0])
                nxt[b, 0] = t
                if not done[b]:
                    new_tokens[b].append(t)
                    feed_token(filters, t)
                    if t == stop or end_filter:
                        done[b] = True
            seqs = [torch.cat([q, nxt[b]]) for b, q in enumerate(seqs)]
            if all(done):
                break
        self.cache.current_seq_len = 0  # rows have different lengths: the contiguous fill is not meaningful
        width = max(q.numel() for q in seqs)
        pad = self.tokenizer.pad_token_id
        pad = pad if pad is not None and pad >= 0 else 0
        # As exllamav2: the prompts and what was sampled, left-padded into one [B, n] tensor.
        self.sequence_ids = torch.stack([torch.cat([q.new_full((width - q.numel(),), pad), q]) for q in seqs])

        out = []
        for b in range(B):
            toks = new_tokens[b]
            if stop is not None and toks and toks[-1] == stop:
                toks = toks[:-1]
            text = self._completion_text(rows[b].tolist(), toks, decode_special_tokens)
            if heal[b] is not None:
                text = text[len(self.tokenizer.get_id_to_piece_list(True)[heal[b]]):]  # type: ignore[index]
            out.append(text if completion_only else prompts[b] + text)
        return out[0] if single else out

    def _decode(self, toks: list[int], decode_special_tokens: bool) -> str:
        if not toks:
            return ""
        text = self.tokenizer.decode(torch.tensor(toks, dtype=torch.long), decode_special_tokens=decode_special_tokens)
        return text[0] if isinstance(text, list) else text

    def _completion_text(self, prompt: list[int], toks: list[int], decode_special_tokens: bool) -> str:
        # Decoded after the prompt, so tokenizers that strip a leading space at the start of a text do not
        # eat the completion's first space.
        head = self._decode(prompt, decode_special_tokens)
        full = self._decode(prompt + toks, decode_special_tokens)
        return full[len(head):] if full.startswith(head) else self._decode(toks, decode_special_tokens)


def __getattr__(name: str) -> Any:
    # exllamav2's base-generator module also exposes ExLlamaV2Filter (formatron imports it from there); the
    # class itself lives in exlpy.generator.filters, imported on first use.
    if name == "ExLlamaV2Filter":
        from exlpy.generator.filters import ExLlamaV2Filter

        return ExLlamaV2Filter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
