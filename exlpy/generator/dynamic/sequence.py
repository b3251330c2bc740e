"""The token sequences of a dynamic-generator job: `SeqState` (ids, pages, prefill progress) and exllamav2's
read-only view of it, `JobSequence`."""

from __future__ import annotations

import torch

from exlpy.generator.dynamic.pages import PAGE_SIZE, CachePage, chain_hashes
from exlpy.util import SeqTensor


class SeqState:
    """One token sequence of a job (CFG jobs have two) and the cache pages that hold its K/V.

    Pages are taken as the sequence grows: its prompt's at admission, one more whenever a decode step writes
    past the last page. A preempted job gives all of them back and later recomputes its whole sequence so far
    as a new prompt (`restart`), sharing whatever full pages are still cached.
    """

    def __init__(self, ids: torch.Tensor, page_size: int = PAGE_SIZE, salt: bytes | None = None) -> None:
        self.ids = ids  # 1-D: prompt, then generated tokens
        self.page_size = page_size
        self.salt = salt  # starts the hash chain: pages computed under other LoRA adapters never match
        self.pages: list[CachePage] = []
        self.rope_delta = 0  # M-RoPE position shift of tokens after the prompt's images (exlpy/vision/mm.py)
        self.restart()

    def restart(self) -> None:
        """Prefill everything but the last token again (admission, and re-admission after preemption)."""
        self.prefill_target = self.ids.numel() - 1
        # Only pages that prefill writes are shareable before the job ends.
        self.hashes = chain_hashes(self.ids, self.prefill_target, self.page_size, self.salt)
        self.prefill_pos = 0  # tokens of `ids` whose K/V is in the cache (during prefill)
        self.draft_kv = 0  # positions whose K/V a draft model's cache holds (speculative decoding)

    def is_prefilled(self) -> bool:
        return self.prefill_pos >= self.prefill_target

    def kv_valid(self) -> int:
        """Tokens whose K/V is certainly in the cache (a token in flight is not counted)."""
        return self.ids.numel() - 1 if self.is_prefilled() else self.prefill_pos

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def truncate(self, n: int) -> None:
        """Drop the last n tokens (a banned string was rewound)."""
        self.ids = self.ids[:-n]
        self.prefill_target = min(self.prefill_target, self.ids.numel() - 1)
        self.prefill_pos = min(self.prefill_pos, self.prefill_target)
        self.draft_kv = min(self.draft_kv, self.ids.numel() - 1)

    def page_ids(self) -> list[int]:
        return [p.index for p in self.pages]


class JobSequence:
    """exllamav2's view of one sequence of a job (`job.sequences[i]`): `input_ids` (the prompt as given) and
    `sequence_ids` (prompt + generated so far) as SeqTensors of shape [1, n], and how far its K/V is cached."""

    def __init__(self, prompt: torch.Tensor, state: SeqState | None, live: bool) -> None:
        self._prompt = prompt
        self._state = state
        self.live = live

    @property
    def input_ids(self) -> SeqTensor:
        return SeqTensor.from_tensor(self._prompt, seq_dim=-1)

    @property
    def sequence_ids(self) -> SeqTensor:
        ids = self._prompt[0] if self._state is None else self._state.ids
        return SeqTensor.from_tensor(ids.unsqueeze(0), seq_dim=-1)

    @property
    def kv_position(self) -> int:
        return 0 if self._state is None else self._state.kv_valid()

    @property
    def prefill_complete(self) -> bool:
        return self._state is not None and self._state.is_prefilled()

    @property
    def allocated_pages(self) -> list[CachePage] | None:
        return None if self._state is None or not self._state.pages else list(self._state.pages)

    @property
    def page_hashes(self) -> list[bytes] | None:
        return None if self._state is None else list(self._state.hashes)
