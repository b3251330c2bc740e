"""The dynamic generator's overlapped loop, on-demand pages and fault isolation, on the real aidreams260K model.

Oracles: greedy tokens from full forward passes (`argmax_tokens`) and, for seeded sampling, the host sampler
run on full-forward logits with a generator seeded like the job's: the overlapped loop (device sampling, tokens
read one step behind) must reproduce both token for token.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from exlpy import ExLlamaV2Cache
from exlpy.errors import GeneratorError
from exlpy.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler

# Exact seeded-sampling oracles need the fp32 CPU model (see aidreams_cpu); on a GPU machine too.
from tests.test_generator_helpers import PROMPTS, argmax_tokens, drain
from tests.test_generator_helpers import aidreams_cpu as aidreams

GREEDY = ExLlamaV2Sampler.Settings.greedy()
TOP_P = ExLlamaV2Sampler.Settings(temperature=1.3, top_k=0, top_p=0.9, token_repetition_penalty=1.0)
TOP_K = ExLlamaV2Sampler.Settings(temperature=0.9, top_k=20, top_p=1.0, min_p=0.02, token_repetition_penalty=1.0)
PENALTY = ExLlamaV2Sampler.Settings(temperature=1.0, top_k=0, top_p=0.95, token_repetition_penalty=1.3)


def make_gen(pages: int = 8, **kw: Any) -> ExLlamaV2DynamicGenerator:
    model, tok = aidreams()
    size = int(kw.get("page_size", 256))
    return ExLlamaV2DynamicGenerator(model, ExLlamaV2Cache(model, max_seq_len=pages * size), tok, **kw)


def job(ids: torch.Tensor, n: int, **kw: Any) -> ExLlamaV2DynamicJob:
    kw.setdefault("gen_settings", GREEDY)
    kw.setdefault("stop_conditions", [])
    return ExLlamaV2DynamicJob(ids, n, **kw)


def sampled_oracle(ids: torch.Tensor, n: int, settings: Any, seed: int, blocked: list[int] | None = None,
                   min_new: int = 0) -> list[int]:
    """What the host sampler draws, token by token, from full-forward logits with the job's seeded generator
    (`blocked` tokens refused for the first `min_new` tokens)."""
    model, tok = aidreams()
    rng = torch.Generator().manual_seed(seed)
    seq, out = ids.clone(), []
    for i in range(n):
        logits = model.forward(seq)[:, -1:].float()
        t = int(ExLlamaV2Sampler.sample(logits, settings, seq, None, tok, generator=rng,
                                        blocked_tokens=blocked if i < min_new else None)[0].view(-1)[0])
        out.append(t)
        seq = torch.cat([seq, torch.tensor([[t]])], dim=1)
    return out


def test_overlapped_loop_matches_oracles_for_device_and_host_sampled_rows() -> None:
    _, tok = aidreams()
    ids = [tok.encode(p, add_bos=True) for p in PROMPTS[:5]]
    n = 10
    g = make_gen()
    # One batch mixing rows sampled on the device (greedy, top-p, top-k/min-p) with rows the host samples
    # (a repetition penalty over the context; per-token probabilities asked for).
    bias = torch.zeros(512)
    bias[[5, 17, 300]] = torch.tensor([3.0, -2.0, 4.0])
    biased = ExLlamaV2Sampler.Settings(temperature=0.9, top_k=20, top_p=1.0, token_repetition_penalty=1.0,
                                       token_bias=bias)
    stops = argmax_tokens(aidreams()[0], ids[1], 3)  # tokens the model likes: blocked until min_new_tokens
    jobs = [job(ids[0], n), job(ids[1], n, gen_settings=TOP_P, seed=11), job(ids[2], n, gen_settings=TOP_K, seed=12),
            job(ids[3], n, gen_settings=PENALTY, seed=13), job(ids[4], n, gen_settings=TOP_P, seed=14,
                                                               return_probs=True),
            job(ids[1], n, gen_settings=biased, seed=15, stop_conditions=stops, min_new_tokens=n)]
    g.enqueue(jobs)
    assert [j.device_sampling() is not None for j in jobs] == [True, True, True, False, False, True]
    res = drain(g)
    model, _ = aidreams()
    assert res[jobs[0]]["tokens"] == argmax_tokens(model, ids[0], n)
    for k, s, seed in ((1, TOP_P, 11), (2, TOP_K, 12), (3, PENALTY, 13), (4, TOP_P, 14)):
        assert res[jobs[k]]["tokens"] == sampled_oracle(ids[k], n, s, seed), k
    assert res[jobs[5]]["tokens"] == sampled_oracle(ids[1], n, biased, 15, sorted(set(stops)), n)
    assert g.page_table.num_unreferenced() == g.num_pages


def test_stop_found_one_step_late_is_rolled_back() -> None:
    model, tok = aidreams()
    ids = tok.encode("Echoes of", add_bos=True)
    other = tok.encode("Once", add_bos=True)
    greedy = argmax_tokens(model, ids, 12)
    stop_at = 5
    g = make_gen()
    a = job(ids, 12, stop_conditions=[greedy[stop_at]])
    b = job(other, 12)
    g.enqueue([a, b])
    res = drain(g)
    first = greedy.index(greedy[stop_at])
    assert res[a]["tokens"] == greedy[:first + 1] and res[a]["final"]["eos_reason"] == "stop_token"
    assert res[b]["tokens"] == argmax_tokens(model, other, 12)
    # The step after the stop token was already running when the host saw it: one row more than tokens, whose
    # K/V and page were given back.
    assert g.decode_tokens == (first + 1) + 1 + 12
    assert g.page_table.num_unreferenced() == g.num_pages
    # The same prompt again reuses the freed partial page (only tokens whose K/V is valid) and matches.
    c = job(ids, 12)
    g.enqueue(c)
    assert drain(g)[c]["tokens"] == greedy


def test_stop_string_one_step_late_with_seeded_sampling() -> None:
    _, tok = aidreams()
    ids = tok.encode("The gentle hum of", add_bos=True)
    n = 24
    expect = sampled_oracle(ids, n, TOP_P, 5)
    text = tok.decode(torch.cat([ids[0], torch.tensor(expect)]))[len(tok.decode(ids[0])):]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop and stop in text
    g = make_gen()
    j = job(ids, n, gen_settings=TOP_P, seed=5, stop_conditions=[stop])
    plain = job(ids, n, gen_settings=TOP_P, seed=5)
    g.enqueue([j, plain])
    res = drain(g)
    assert res[plain]["tokens"] == expect
    assert res[j]["text"] == text[:text.index(stop)] and res[j]["final"]["eos_reason"] == "stop_string"
    assert g.page_table.num_unreferenced() == g.num_pages


def test_pages_on_demand_with_preemption_under_a_small_cache() -> None:
    model, tok = aidreams()
    ids = [tok.encode(p, add_bos=True) for p in PROMPTS[:5]]
    n = 18
    # 6 pages of 8 tokens for five jobs that each grow to 3 pages: they cannot all hold their pages at once.
    g = make_gen(pages=6, page_size=8)
    jobs = [job(i, n) for i in ids]
    g.enqueue(jobs)
    res = drain(g)
    assert g.preemptions > 0
    for i, j in zip(ids, jobs):
        assert res[j]["tokens"] == argmax_tokens(model, i, n)
        assert res[j]["final"]["eos_reason"] == "max_new_tokens" and res[j]["final"]["new_tokens"] == n
        assert res[j]["stages"].count("started") == 1  # a resumed job does not start twice
    assert g.page_table.num_unreferenced() == g.num_pages
    assert "preemptions" in g.status() and g.status()["cache_tokens"] == 48


class PoisonedModel:
    """The real model, except that a batched step holding `poison` raises (a job at fault inside a batch)."""

    def __init__(self, model: Any, poison: int) -> None:
        self._model, self.poison = model, poison

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def forward_batch(self, ids: torch.Tensor, batch: Any, **kw: Any) -> Any:
        if bool((ids == self.poison).any()):
            raise RuntimeError("poisoned row")
        return self._model.forward_batch(ids, batch, **kw)


def test_job_failing_inside_a_batched_step_fails_alone() -> None:
    model, tok = aidreams()
    ids = [tok.encode(p, add_bos=True) for p in PROMPTS[:3]]
    poison = 499
    bad = torch.cat([ids[1], torch.tensor([[poison]])], dim=1)  # its first decode step feeds the poison
    g = ExLlamaV2DynamicGenerator(PoisonedModel(model, poison), ExLlamaV2Cache(model, max_seq_len=2048), tok)
    jobs = [job(ids[0], 8), job(bad, 8), job(ids[2], 8, gen_settings=TOP_P, seed=3)]
    g.enqueue(jobs)
    res = drain(g)
    assert res[jobs[1]]["final"]["eos_reason"] == "error" and "poisoned" in res[jobs[1]]["final"]["error_message"]
    assert res[jobs[0]]["tokens"] == argmax_tokens(model, ids[0], 8)
    assert res[jobs[2]]["tokens"] == sampled_oracle(ids[2], 8, TOP_P, 3)
    assert g.page_table.num_unreferenced() == g.num_pages


def test_ids_outside_the_model_vocabulary_are_refused_at_enqueue() -> None:
    model, _ = aidreams()
    g = make_gen()
    with pytest.raises(GeneratorError, match=r"token id 512, outside the model's vocabulary \[0, 512\)"):
        g.enqueue(job(torch.tensor([[1, 5, 512]]), 4))
    with pytest.raises(GeneratorError, match="outside the model's vocabulary"):
        g.enqueue(job(torch.tensor([[1, -3]]), 4))
    assert g.num_remaining_jobs() == 0


def test_long_prompt_is_prefilled_in_small_chunks_next_to_running_decodes() -> None:
    model, tok = aidreams()
    torch.manual_seed(4)
    short = tok.encode("Once", add_bos=True)
    long = torch.cat([torch.tensor([[1]]), torch.randint(3, 500, (1, 599))], dim=1)
    g = make_gen(max_prefill_per_step=64)
    a = job(short, 40)
    g.enqueue(a)
    b = job(long, 4)
    res: dict[Any, list[int]] = {a: [], b: []}
    while not a.new_tokens:
        res[a] += [t for r in g.iterate() if r["stage"] == "streaming" for t in r["token_ids"][0].tolist()]
    g.enqueue(b)
    prefill_steps, stalled = 0, 0
    while g.num_remaining_jobs():
        out = g.iterate()
        prefilling = [r for r in out if r["job"] is b and r["stage"] == "prefill"]
        if prefilling:
            prefill_steps += 1
            stalled += not any(r["job"] is a and r["stage"] == "streaming" for r in out)
        for r in out:
            if r["stage"] == "streaming":
                res[r["job"]] += r["token_ids"][0].tolist()
    # 599 prompt tokens at most 64 per iteration (fewer deeper in): the running job streams all along.
    assert prefill_steps >= 599 // 64 and stalled == 0
    assert res[b] == argmax_tokens(model, long, 4)
    assert res[a] == argmax_tokens(model, short, 40)


def test_broken_distribution_on_the_device_path_fails_only_its_job() -> None:
    """A NaN token bias on a row sampled on the device: its flags come back with its token, so that job ends
    with a SamplerError while the rows beside it (same step) continue exactly."""
    from exlpy.errors import SamplerError
    from exlpy.generator import ExLlamaV2StreamingGenerator

    model, tok = aidreams()
    nan_bias = torch.zeros(512)
    nan_bias[7] = float("nan")
    broken = ExLlamaV2Sampler.Settings(temperature=1.0, top_k=0, top_p=0.9, token_repetition_penalty=1.0,
                                       token_bias=nan_bias)
    ids = [tok.encode(p, add_bos=True) for p in PROMPTS[:3]]
    g = make_gen()
    jobs = [job(ids[0], 6), job(ids[1], 6, gen_settings=broken, seed=1), job(ids[2], 6, gen_settings=TOP_P, seed=2)]
    g.enqueue(jobs)
    assert jobs[1].device_sampling() is not None
    res = drain(g)
    final = res[jobs[1]]["final"]
    assert final["eos_reason"] == "error" and isinstance(final["error"], SamplerError)
    assert res[jobs[0]]["tokens"] == argmax_tokens(model, ids[0], 6)
    assert res[jobs[2]]["tokens"] == sampled_oracle(ids[2], 6, TOP_P, 2)
    assert g.page_table.num_unreferenced() == g.num_pages
    sg = ExLlamaV2StreamingGenerator(model, ExLlamaV2Cache(model, max_seq_len=256), tok)
    sg.begin_stream_ex(ids[0], broken)
    with pytest.raises(SamplerError, match="NaN"):
        sg.stream_ex()
