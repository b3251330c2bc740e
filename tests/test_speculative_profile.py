"""The per-round time breakdown of speculative decoding (exlpy/generator/speculative/profile.py)."""

from __future__ import annotations

from exlpy.generator.speculative.profile import RoundProfile
from tests.test_generator_helpers import PROMPTS, aidreams, argmax_tokens, drain
from tests.test_speculative import job, spec_gen


def test_round_profile_records_every_round_and_changes_nothing() -> None:
    model, tok = aidreams()
    ids = tok.encode(PROMPTS[0], add_bos=True)
    g = spec_gen(use_ngram_draft=True, num_draft_tokens=3)
    g.ngram_preload(tok.decode(ids[0]))  # drafts from the prompt: some rounds accept
    assert g.spec is not None
    prof = g.spec.profile = RoundProfile()
    j = job(ids, 24)
    g.enqueue(j)
    res = drain(g)
    assert res[j]["tokens"] == argmax_tokens(model, ids, 24)
    assert len(prof.rounds) == g.spec.rounds > 2
    s = prof.summary(skip=0)
    assert s["rounds"] == len(prof.rounds) and 1 <= s["k"] <= 3
    phases = ("before", "prep", "launch", "wait", "after")
    assert all(s[p] >= 0.0 for p in phases) and s["launch"] > 0.0  # the target's forward runs there on a CPU
    assert abs(s["wall"] - sum(s[p] for p in phases)) < 1e-9
    assert "device draft" not in s  # CUDA events only on a GPU
    assert prof.describe(1.0).startswith(f"{len(prof.rounds) - 2} rounds")  # the first two: graph captures
    prof.reset()
    assert prof.summary() == {"rounds": 0.0}


def test_scripted_workload_is_followed_by_plain_and_ngram_decoding() -> None:
    """benchmarks/ngram_workloads.py: a random model's greedy text becomes the script (the answer quotes the
    prompt), with and without n-gram drafting; the drafts are accepted where they follow it."""
    import torch

    from benchmarks.ngram_workloads import Script, workloads

    model, tok = aidreams()
    prompt, answer = workloads(model.config.vocab_size, prompt_words=120, answer_words=40)["code edit"]
    script = Script(model, prompt, answer)
    out = {}
    with script.active():
        for name, kw in (("plain", {}), ("ngram", {"use_ngram_draft": True})):
            g = spec_gen(**kw)
            j = job(torch.tensor([prompt]), len(answer))
            g.enqueue(j)
            out[name] = drain(g)[j]["tokens"]
            if g.spec is not None:
                assert g.spec.accepted > 0.5 * len(answer)  # the edit copies most of the prompt
    assert out["plain"] == out["ngram"] == answer
    assert "forward_batch" not in vars(model)  # the model's own method again
