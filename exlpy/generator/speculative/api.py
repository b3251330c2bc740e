"""The dynamic generator's speculative-decoding methods: exllamav2's get_sd_stats / reset_sd_stats /
ngram_preload, the round inside iterate(), and what /health shows."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from exlpy.errors import GeneratorError
from exlpy.generator.dynamic import scheduler

if TYPE_CHECKING:
    from exlpy.generator.dynamic.job import ExLlamaV2DynamicJob


class SpeculativeAPI:
    """Mixed into ExLlamaV2DynamicGenerator (which sets `spec`, `stepper`, `tokenizer`, ...)."""

    spec: Any
    stepper: Any
    tokenizer: Any
    active: list[Any]

    def _sd_status(self) -> dict[str, Any]:
        if self.spec is None:
            return {}
        eff, acc, tokens, drafted, accepted = self.spec.stats()
        return {"speculative": {"drafter": "model" if self.spec.drafter else "ngram", "acceptance": round(acc, 4),
                                "efficiency": round(eff, 4), "drafted": drafted, "accepted": accepted,
                                "tokens": tokens, "draft_length": self.spec.length.choose(),
                                "acceptance_per_token": round(self.spec.acceptance_per_token(), 4),
                                "draft_length_mean": round(self.spec.mean_draft_length(), 3),
                                "acceptance_recent": round(self.spec.length.rate, 4),
                                "draft_step_cost": round(self.spec.length.step_cost, 4)}}

    # --- speculative decoding ------------------------------------------------------------------------------
    def get_sd_stats(self) -> tuple[float, float, int, int, int]:
        """(efficiency, accuracy, total tokens, drafted tokens, accepted drafts) of speculative decoding
        (exllamav2's streaming-generator figures; zeros without a drafter)."""
        return self.spec.stats() if self.spec is not None else (0.0, 0.0, 0, 0, 0)

    def reset_sd_stats(self) -> None:
        if self.spec is not None:
            self.spec.reset_stats()

    def ngram_preload(self, text_or_ids: str | torch.Tensor | list[int]) -> None:
        """Index example text (or token ids) for n-gram drafting: a job's own context is searched first."""
        if self.spec is None or self.spec.drafter is not None:
            raise GeneratorError("ngram_preload() needs a generator created with use_ngram_draft=True")
        self.spec.preloaded.extend(_ids_of(self.tokenizer, text_or_ids))

    def _speculate(self, jobs: list[ExLlamaV2DynamicJob], results: list[dict[str, Any]]) -> bool:
        """One speculative round over `jobs`; False when there is nothing to draft (decode normally)."""
        assert self.spec is not None
        self.stepper.drain(results)  # drafts continue the latest tokens
        if self.spec.resume(results):  # the round the last one launched ahead (Speculation._chain)
            return True
        jobs = [j for j in jobs if j in self.active and self._continues(j)]
        planned = self.spec.plan(jobs) if jobs else None
        if planned is None:
            return False
        k, spec = planned
        jobs = scheduler.decode_pages(self, jobs, k + 1, lambda: self.stepper.drain(results))
        if not jobs:
            return True
        try:
            self.spec.run(jobs, k, {j: v for j, v in spec.items() if j in jobs}, results)
        except Exception as e:
            for j in jobs:
                for q in j.seqs:
                    q.draft_kv = min(q.draft_kv, q.ids.numel() - 2)
            self._isolate(jobs, e, results)
        return True


def _ids_of(tokenizer: Any, text_or_ids: str | torch.Tensor | list[int]) -> list[int]:
    if isinstance(text_or_ids, str):
        return tokenizer.encode(text_or_ids).view(-1).tolist()
    if isinstance(text_or_ids, torch.Tensor):
        return text_or_ids.view(-1).tolist()
    return [int(t) for t in text_or_ids]
