"""Speculative rounds launched ahead (exlpy/generator/speculative/dynamic.py `Speculation._chain`): the next
round's drafts and verification are queued before the host accepts a round's tokens. Output must stay plain
greedy decoding token for token, and a round whose job ends (or changes) before it is read must be dropped
without leaving the draft cache behind."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.test_generator_helpers import PROMPTS, aidreams, argmax_tokens, drain
from tests.test_speculative import job, tiny
from tests.test_speculative import spec_gen as _spec_gen


def spec_gen(*args: Any, **kw: Any) -> Any:
    """tests.test_speculative's generator with rounds launched ahead (`Speculation.chain`: off by default)."""
    g = _spec_gen(*args, **kw)
    if g.spec is not None:
        g.spec.chain = True
    return g


def prompts() -> list[torch.Tensor]:
    _, tok = aidreams()
    torch.manual_seed(11)
    ids = [tok.encode(p, add_bos=True) for p in PROMPTS[:2]]
    ids.append(torch.cat([torch.tensor([[1]]), torch.randint(3, 500, (1, 90))], dim=1))
    return ids


@pytest.mark.parametrize("drafter,k", [("same", 3), ("tiny-llama-fp16", None), ("ngram", 3)])
def test_rounds_launched_ahead_keep_greedy_output(drafter: str, k: int | None) -> None:
    model, tok = aidreams()
    ids = prompts()
    n = [19, 12, 16]
    if drafter == "ngram":  # drafts from the jobs' own greedy text: most rounds propose something
        g = spec_gen(use_ngram_draft=True, num_draft_tokens=k)
        for i, m in zip(ids, n):
            g.ngram_preload(i[0].tolist() + argmax_tokens(model, i, m))
    else:
        g = spec_gen(model if drafter == "same" else tiny(drafter), num_draft_tokens=k)
    assert g.spec is not None
    if k is None:  # adaptive length: drafting on from the start whatever the CPU timings say
        g.spec.length.cost = 0.05
        g.spec.length.observe = lambda *a: None  # type: ignore[method-assign]
    jobs = [job(i, m) for i, m in zip(ids, n)]
    g.enqueue(jobs)
    res = drain(g)
    for i, m, j in zip(ids, n, jobs):
        assert res[j]["tokens"] == argmax_tokens(model, i, m)
    s = g.spec
    assert s.rounds_ahead > 0 and s.ahead_failed == 0 and s.ahead is None
    assert s.tokens == sum(n)
    if drafter == "same":  # a model agrees with itself: the draft cache stayed right through every chain
        assert s.accepted == s.drafted > 0
    assert g.page_table.num_unreferenced() == g.num_pages


def test_a_stop_inside_the_bookkeeping_voids_the_round_ahead() -> None:
    model, tok = aidreams()
    ids = tok.encode("Echoes of", add_bos=True)
    greedy = argmax_tokens(model, ids, 20)
    g = spec_gen(model, num_draft_tokens=3)
    assert g.spec is not None
    b = job(ids, 20, stop_conditions=[greedy[5]])  # ends in the second round, whose successor is queued
    c = job(ids, 20)
    g.enqueue([b, c])
    res = drain(g)
    assert res[b]["tokens"] == greedy[:greedy.index(greedy[5]) + 1]
    assert res[c]["tokens"] == greedy
    s = g.spec
    assert s.ahead_void >= 1 and s.rounds_ahead > 0
    assert s.accepted == s.drafted  # c's draft cache was restored when the round ahead was dropped
    assert g.page_table.num_unreferenced() == g.num_pages


def steps_until_ahead(g: Any, limit: int = 50) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for _ in range(limit):
        out += g.iterate()
        if g.spec.ahead is not None:
            return out
    raise AssertionError("no round was launched ahead")


def collect(acc: dict[Any, list[int]], results: list[dict[str, Any]]) -> None:
    for r in results:
        if r["stage"] == "streaming":
            acc.setdefault(r["job"], []).extend(r["token_ids"][0].tolist())


def test_enqueue_and_cancel_while_a_round_is_ahead() -> None:
    model, _ = aidreams()
    ids = prompts()
    g = spec_gen(model, num_draft_tokens=2)
    assert g.spec is not None
    a, b = job(ids[0], 24), job(ids[1], 24)
    g.enqueue([a, b])
    acc: dict[Any, list[int]] = {}
    collect(acc, steps_until_ahead(g))
    c = job(ids[2], 10)  # joins while a round of a and b is queued: the round is read, c joins the next
    g.enqueue(c)
    collect(acc, g.iterate())
    collect(acc, steps_until_ahead(g))
    g.cancel(b)  # the queued round covers b: it is dropped, a and c go on
    while g.num_remaining_jobs():
        collect(acc, g.iterate())
    assert acc[a] == argmax_tokens(model, ids[0], 24)
    assert acc[c] == argmax_tokens(model, ids[2], 10)
    assert acc[b] == argmax_tokens(model, ids[1], len(acc[b]))[:len(acc[b])] and len(acc[b]) < 24
    assert g.spec.ahead_void >= 1 and g.spec.accepted == g.spec.drafted
    assert g.page_table.num_unreferenced() == g.num_pages


def test_no_round_ahead_where_the_host_samples_or_the_draft_length_is_off() -> None:
    """A job the host samples rides in the round: nothing is launched ahead. A draft length of 0 (speculation
    off at low acceptance) ends the chain: the generator decodes plainly until a probe."""
    from tests.test_dynamic_overlap import PENALTY

    model, _ = aidreams()
    ids = prompts()
    g = spec_gen(model, num_draft_tokens=3)
    assert g.spec is not None
    jobs = [job(ids[0], 12), job(ids[1], 8, gen_settings=PENALTY, seed=3)]
    g.enqueue(jobs)
    res = drain(g)
    assert res[jobs[0]]["tokens"] == argmax_tokens(model, ids[0], 12)
    assert g.spec.rounds > 0 and g.spec.rounds_ahead == 0
    g = spec_gen(model)
    assert g.spec is not None
    length = g.spec.length
    length.observe = lambda *a: None  # type: ignore[method-assign]
    length.accepted, length.rejected = 0.0, 1000.0  # acceptance ~0: no length pays
    j = job(ids[0], 20)
    g.enqueue(j)
    res = drain(g)
    assert res[j]["tokens"] == argmax_tokens(model, ids[0], 20)
    assert g.spec.rounds <= 2 and g.spec.rounds_ahead == 0  # at most a probe


def test_round_profile_of_rounds_launched_ahead_adds_up_to_the_elapsed_time() -> None:
    """A round launched ahead has its launch inside the previous round's finish: the previous round's `after`
    leaves it out, so the rounds' phases add up to at most the elapsed time (counting it twice would not)."""
    import time

    from exlpy.generator.speculative.profile import RoundProfile

    model, _ = aidreams()
    ids = prompts()
    g = spec_gen(model, num_draft_tokens=3)
    assert g.spec is not None
    prof = g.spec.profile = RoundProfile()
    j = job(ids[2], 30)
    g.enqueue(j)
    t0 = time.perf_counter()
    res = drain(g)
    elapsed = 1000.0 * (time.perf_counter() - t0)
    assert res[j]["tokens"] == argmax_tokens(model, ids[2], 30)
    s = prof.summary(skip=0)
    assert s["rounds"] == g.spec.rounds and s["chained"] > 0.5
    phases = ("before", "prep", "launch", "wait", "after")
    assert all(s[p] >= 0.0 for p in phases) and s["launch"] > 0.0
    assert s["wall"] * s["rounds"] <= elapsed
    assert "launched ahead" in prof.describe()


def test_seeded_sampled_jobs_draw_the_same_tokens_ahead_or_not() -> None:
    """A round launched ahead draws its verification points from each job's generator at launch, before the
    round before is accepted; nothing in between draws from it, so a seeded job's tokens do not change."""
    from tests.test_dynamic_overlap import TOP_P

    model, _ = aidreams()
    ids = prompts()
    outs = []
    for chain in (False, True):
        g = spec_gen(model, num_draft_tokens=3)
        assert g.spec is not None
        g.spec.chain = chain
        jobs = [job(ids[0], 20, gen_settings=TOP_P, seed=5), job(ids[2], 14, gen_settings=TOP_P, seed=6)]
        g.enqueue(jobs)
        res = drain(g)
        outs.append([res[j]["tokens"] for j in jobs])
        assert (g.spec.rounds_ahead > 0) == chain
    assert outs[0] == outs[1] and [len(t) for t in outs[0]] == [20, 14]
