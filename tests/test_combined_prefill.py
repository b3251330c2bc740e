"""Prompt chunks of several sequences in shared passes (issue 29): an iteration with chunks of two or more sequences
runs them as one forward pass over all their tokens (model/batch.py `mixed_batch`, prefill.run_together) instead of
a pass each. Against the per-sequence passes on the fp32 CPU model: the same tokens, text and decode logits, the
same prefix pages reused between sequences planned in one iteration, fewer forward passes; LoRA jobs keep passes
of their own; a failing chunk fails its job alone. The scheduler's part (when to combine, how many chunks a pass
holds) is plain values, tested without a model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from exlpy import ExLlamaV2Cache
from exlpy.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler
from exlpy.generator.dynamic import scheduler
from exlpy.runtime import RuntimeOptions
from tests.test_dynamic_overlap import PoisonedModel
from tests.test_generator_helpers import aidreams_cpu as aidreams
from tests.test_generator_helpers import argmax_tokens
from tests.test_mixed_step import prompt, run

GREEDY = ExLlamaV2Sampler.Settings.greedy()
TOP_P = ExLlamaV2Sampler.Settings(temperature=1.1, top_k=0, top_p=0.9, token_repetition_penalty=1.0)


# --- the scheduler alone ------------------------------------------------------------------------------------------
def test_when_prompts_share_passes() -> None:
    """Without decoding jobs every chunk is an eager pass: two or more always share. Next to decoding jobs, only
    once the budget exceeds CAPTURED_MAX (a lone prompt, or a few, keep their captured pieces)."""
    big = scheduler.CAPTURED_MAX + 1
    assert scheduler.combines_prompts(2, 0, 64)
    assert not scheduler.combines_prompts(1, 0, 8192)
    assert not scheduler.combines_prompts(1, 32, 8192)  # a lone prompt next to the streams: captured pieces
    assert not scheduler.combines_prompts(4, 32, scheduler.CAPTURED_MAX)
    assert scheduler.combines_prompts(5, 32, big)


def test_the_budget_next_to_streams_combines_a_crowd_not_a_few() -> None:
    """What `prefill_budget` gives next to 32 decoding streams: two waiting prompts stay captured, a crowd shares."""
    gen = type("G", (), {"max_chunk_size": 2048, "max_prefill_per_step": 2048})()
    assert not scheduler.combines_prompts(2, 32, scheduler.prefill_budget(gen, 32, 2))
    assert scheduler.combines_prompts(8, 32, scheduler.prefill_budget(gen, 32, 8))


def test_pass_sizes() -> None:
    """Consecutive chunks up to the limit a pass; a chunk at the limit alone; order kept."""
    assert scheduler.pass_sizes([], 32) == []
    assert scheduler.pass_sizes([10, 10, 10], 32) == [3]
    assert scheduler.pass_sizes([10, 10, 13], 32) == [2, 1]
    assert scheduler.pass_sizes([32, 1, 31, 5], 32) == [1, 2, 1]
    assert scheduler.pass_sizes([5] * 7, 10) == [2, 2, 2, 1]


def test_runtime_switch() -> None:
    assert RuntimeOptions.from_env({}).combined_prefill is True
    assert RuntimeOptions.from_env({"EXLPY_COMBINED_PREFILL": "0"}).combined_prefill is False


# --- the generator: shared passes against a pass each, token for token ------------------------------------------
class CountingModel(PoisonedModel):
    """The real model, counting its prompt forward passes (preprocess_only), per iteration in `passes`."""

    def __init__(self, model: Any, poison: int = -1) -> None:
        super().__init__(model, poison)
        self.passes = [0]

    def forward_batch(self, ids: torch.Tensor, batch: Any, **kw: Any) -> Any:
        if kw.get("preprocess_only"):
            self.passes[-1] += 1
        return super().forward_batch(ids, batch, **kw)


def make_gen(combined: bool, pages: int = 96, poison: int = -1, **kw: Any) -> ExLlamaV2DynamicGenerator:
    model, tok = aidreams()
    kw.setdefault("page_size", 16)
    kw.setdefault("max_chunk_size", 128)
    gen = ExLlamaV2DynamicGenerator(CountingModel(model, poison), ExLlamaV2Cache(model, max_seq_len=pages * 16),
                                    tok, **kw)
    gen.combined_prefill = combined
    iterate = gen.iterate

    def counted() -> list[dict[str, Any]]:
        out = iterate()
        gen.model.passes.append(0)
        return out

    gen.iterate = counted  # type: ignore[method-assign]
    return gen


def compare(arrivals: list[tuple[int, dict[str, Any]]], **kw: Any) -> tuple[Any, Any, list[dict[str, Any]]]:
    """Both ways on the same arrivals: the same tokens, text and end reasons, decode logits within 1e-4, the same
    prompt tokens run and served from the cache; returns (per-sequence generator, combined one, results)."""
    alone, shared = make_gen(False, **kw), make_gen(True, **kw)
    a, a_logits = run(alone, arrivals)
    b, b_logits = run(shared, arrivals)
    assert [r["tokens"] for r in b] == [r["tokens"] for r in a]
    assert [r["text"] for r in b] == [r["text"] for r in a]
    assert [r["eos_reason"] for r in b] == [r["eos_reason"] for r in a]
    assert a_logits.keys() == b_logits.keys()
    worst = max(float((a_logits[k] - b_logits[k]).abs().max() / a_logits[k].abs().max()) for k in a_logits)
    assert worst < 1e-4, f"logits relative error {worst:.3g}"
    assert shared.prefill_tokens == alone.prefill_tokens and shared.cached_tokens == alone.cached_tokens
    return alone, shared, a


def test_arrivals_together_and_next_to_decoding_jobs_match_a_pass_each() -> None:
    """Prompts of 5 to 150 tokens arriving together (no job decoding yet), then a crowd of six next to decoding
    jobs (a budget above CAPTURED_MAX: they share passes there too), a CFG job (two sequences) and a seeded
    sampled one; every shared iteration runs fewer prompt passes, the greedy jobs match the full-forward oracle."""
    model, _ = aidreams()
    arrivals = [(0, {"input_ids": prompt(9, 1), "max_new_tokens": 30}),
                (0, {"input_ids": prompt(150, 2), "max_new_tokens": 10}),
                (0, {"input_ids": prompt(40, 3), "max_new_tokens": 6}),
                (0, {"input_ids": [prompt(60, 40), prompt(45, 41)], "max_new_tokens": 8,
                     "gen_settings": ExLlamaV2Sampler.Settings.greedy(cfg_scale=2.0)})]
    arrivals += [(3, {"input_ids": prompt(20 + 13 * k, 10 + k), "max_new_tokens": 8}) for k in range(5)]
    arrivals += [(3, {"input_ids": prompt(30, 20), "max_new_tokens": 8, "gen_settings": TOP_P, "seed": 7})]
    alone, shared, out = compare(arrivals)
    a, b = alone.model.passes, shared.model.passes
    assert sum(b) < sum(a)
    # chunks of 8, 128 (the 150-token prompt's first), 39, 59 and 44 tokens: passes of <= 128 tokens [8], [128],
    # [39, 59], [44]; the crowd's 19, 32, 45, 58, 71 and 29: [19, 32, 45], [58], [71, 29]
    assert (a[0], b[0]) == (5, 4)
    assert (a[3], b[3]) == (6, 3)
    assert all(y <= x for x, y in zip(a, b))
    for (_, kw), r in zip(arrivals, out):
        if "gen_settings" not in kw:
            assert r["tokens"] == argmax_tokens(model, kw["input_ids"], kw["max_new_tokens"])


def test_prefix_pages_written_in_the_same_iteration_are_reused() -> None:
    """Prompts sharing a 48-token prefix (three pages) arriving together: the first one's chunk writes those pages,
    the others skip them in the same iteration (their chunks run after it, not beside it), as with a pass each;
    likewise the second sequence of a CFG job whose two prompts share the prefix (the same pages, the same job)."""
    base = prompt(48, 7)
    cfg = ExLlamaV2Sampler.Settings.greedy(cfg_scale=2.0)
    arrivals = [(0, {"input_ids": prompt(60, 8, base), "max_new_tokens": 8}),
                (0, {"input_ids": prompt(20, 30), "max_new_tokens": 8}),
                (0, {"input_ids": prompt(75, 9, base), "max_new_tokens": 8}),
                (0, {"input_ids": prompt(52, 10, base), "max_new_tokens": 8}),
                (0, {"input_ids": [prompt(70, 12, prompt(64, 13)), prompt(66, 14, prompt(64, 13))],
                     "max_new_tokens": 6, "gen_settings": cfg}),
                (4, {"input_ids": prompt(70, 11, base), "max_new_tokens": 8})]  # later: the pages are cached
    alone, shared, _ = compare(arrivals)
    assert shared.cached_tokens == 3 * 48 + 64  # two sharers at once, one later, the CFG job's second prompt
    # a pass each: 6; shared: [first, unrelated], then [the two sharers, CFG first], then [CFG second]
    assert (alone.model.passes[0], shared.model.passes[0]) == (6, 3)


def test_lora_jobs_keep_passes_of_their_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Adapter jobs arriving with plain ones: the plain ones share a pass, each adapter job runs its own (mixed_batch
    carries no adapters); every job's tokens match the full forward with its adapters."""
    from tests.lora_util import demo_with_two_adapters
    from tests.test_generator_interactions import oracle

    demo = demo_with_two_adapters(tmp_path, max_seq_len=1024)
    m, tok, a, b = demo["model"], demo["tok"], demo["a"], demo["b"]
    ids = [prompt(n, 60 + n) for n in (12, 30, 21, 17)]
    sets = [[a], None, [b], None]
    counter = CountingModel(m)  # (the adapters belong to the model itself: its forward_batch is counted in place)
    original = m.forward_batch
    monkeypatch.setattr(counter, "_model", type("Model", (), {"forward_batch": staticmethod(original)})())
    monkeypatch.setattr(m, "forward_batch", counter.forward_batch)
    results = {}
    for combined in (False, True):
        gen = ExLlamaV2DynamicGenerator(m, ExLlamaV2Cache(m, max_seq_len=32 * 16), tok, page_size=16,
                                        max_chunk_size=64)
        gen.combined_prefill = combined
        jobs = [ExLlamaV2DynamicJob(i, 6, loras=s, gen_settings=GREEDY, stop_conditions=[]) for i, s in zip(ids, sets)]
        gen.enqueue(jobs)
        counter.passes = [0]
        gen.iterate()
        passes = counter.passes[0]
        out = {j: [] for j in jobs}
        while gen.num_remaining_jobs():
            for r in gen.iterate():
                if r["stage"] == "streaming":
                    out[r["job"]] += r["token_ids"][0].tolist()
        results[combined] = ([out[j] for j in jobs], passes)
    assert results[False][1] == 4 and results[True][1] == 3  # two adapter passes, one shared
    assert results[True][0] == results[False][0]
    for i, s, t in zip(ids, sets, results[True][0]):
        assert t == oracle(m, i, 6, s)


def test_a_failing_chunk_in_a_shared_pass_fails_its_job_alone() -> None:
    """A prompt holding a token that makes any pass carrying it raise: the shared pass falls back to a pass per
    chunk, that job ends with the error, the others keep their exact tokens."""
    model, _ = aidreams()
    poison = 499
    bad = prompt(40, 30)
    bad[bad == poison] = 3
    bad[0, 20] = poison
    good = [prompt(25, 31), prompt(33, 32)]
    for g in good:
        g[g == poison] = 3
    gen = make_gen(True, poison=poison)
    arrivals = [(0, {"input_ids": good[0], "max_new_tokens": 6}), (0, {"input_ids": bad, "max_new_tokens": 6}),
                (0, {"input_ids": good[1], "max_new_tokens": 6})]
    out, _ = run(gen, arrivals)
    assert out[1]["eos_reason"] == "error" and "poisoned" in out[1]["error"]
    for k in (0, 2):
        assert out[k]["tokens"] == argmax_tokens(model, arrivals[k][1]["input_ids"], 6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_shared_prompt_passes_on_the_gpu() -> None:
    """The same arrivals on the GPU (fp16, the flash kernel per chunk on slices of one pass): every prompt's first
    token the same either way, and fewer prompt passes."""
    from tests.test_generator_helpers import aidreams as on_gpu

    model, tok = on_gpu()
    assert model.strategy_for_forward().first_device.type == "cuda"
    firsts = {}
    for combined in (False, True):
        gen = ExLlamaV2DynamicGenerator(CountingModel(model), ExLlamaV2Cache(model, max_seq_len=64 * 16), tok,
                                        page_size=16, max_chunk_size=64)
        gen.combined_prefill = combined
        jobs = [ExLlamaV2DynamicJob(prompt(n, n), 4, gen_settings=GREEDY, stop_conditions=[]) for n in (9, 40, 75, 30)]
        gen.enqueue(jobs)
        out: dict[Any, list[int]] = {j: [] for j in jobs}
        while gen.num_remaining_jobs():
            for r in gen.iterate():
                if r["stage"] == "streaming":
                    out[r["job"]] += r["token_ids"][0].tolist()
        firsts[combined] = ([out[j][0] for j in jobs], sum(gen.model.passes))
    assert firsts[True][0] == firsts[False][0]
    assert firsts[True][1] < firsts[False][1]


def test_a_burst_of_arrivals_is_prefilled_in_waves() -> None:
    """Without decoding jobs `prefill_limit` keeps to the budget (`prefill_budget`: BURST_CHUNKS chunks), so that
    the first jobs of a burst stream while later ones prefill (before, every prompt of a 64-stream burst was
    prefilled in the first iteration: its TTFT median was the whole burst's prefill)."""
    gen = type("G", (), {"max_chunk_size": 128, "max_prefill_per_step": 2048, "context_cost_tokens": 10_000})()
    seq = type("S", (), {"prefill_pos": 0})()
    budget = scheduler.prefill_budget(gen, 0, 10)
    assert budget == 128 * scheduler.BURST_CHUNKS
    assert scheduler.prefill_limit(gen, seq, 0, budget, 0) == 128
    assert scheduler.prefill_limit(gen, seq, 0, budget, budget - 40) == 40
    assert scheduler.prefill_limit(gen, seq, 0, budget, budget) == 0
    # On a model: ten 250-token prompts at once, chunks of 256: the first iteration prefills a wave, and the first
    # tokens come before the last prompt is prefilled.
    model, tok = aidreams()
    g = ExLlamaV2DynamicGenerator(model, ExLlamaV2Cache(model, max_seq_len=4096), tok, max_chunk_size=256)
    jobs = [ExLlamaV2DynamicJob(input_ids=prompt(250, 100 + k), max_new_tokens=4, gen_settings=GREEDY,
                                stop_conditions=[]) for k in range(10)]
    for j in jobs:
        g.enqueue(j)
    first = g.prefill_tokens
    first_token: dict[int, int] = {}
    step = 0
    while g.num_remaining_jobs():
        for r in g.iterate():
            if r.get("stage") == "streaming" and len(r.get("token_ids", ())) or r.get("eos"):
                first_token.setdefault(jobs.index(r["job"]), step)
        if step == 0:
            # the budget, 4 chunks' worth: four whole prompts (249 tokens each: a prompt's last token is its first
            # decode step's input) and the fifth's first 28 tokens; the other five wait for the next wave
            assert g.prefill_tokens - first == 256 * scheduler.BURST_CHUNKS
        step += 1
    assert sorted(first_token) == list(range(10))
    assert max(first_token[k] for k in range(4)) < first_token[9]
