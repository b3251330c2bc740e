"""The dynamic generator cannot be poisoned by one bad job: bad arguments are refused when the job is built or
enqueued (nothing stays queued), and a job that fails while running ends alone, its pages freed, while the
other jobs finish exactly as they would have."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from exlpy import ExLlamaV2Cache
from exlpy.errors import GeneratorError, SamplerError
from exlpy.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler
from tests.test_generator_helpers import PROMPTS, aidreams, argmax_tokens, drain

GREEDY = ExLlamaV2Sampler.Settings.greedy()


def make_gen(pages: int = 8) -> ExLlamaV2DynamicGenerator:
    model, tok = aidreams()
    return ExLlamaV2DynamicGenerator(model, ExLlamaV2Cache(model, max_seq_len=pages * 256), tok)


def ids_of(text: str) -> torch.Tensor:
    return aidreams()[1].encode(text, add_bos=True)


def _job(ids: torch.Tensor, n: Any = 6, **kw: Any) -> ExLlamaV2DynamicJob:
    kw.setdefault("gen_settings", GREEDY)
    kw.setdefault("stop_conditions", [])
    return ExLlamaV2DynamicJob(ids, n, **kw)


def _idle_and_clean(g: ExLlamaV2DynamicGenerator) -> None:
    assert g.num_remaining_jobs() == 0 and g.page_table.num_unreferenced() == g.num_pages


JOB_ARGS: dict[str, tuple[dict[str, Any], str]] = {
    "max_new_tokens_float": ({"max_new_tokens": 2.5}, "max_new_tokens"),
    "max_new_tokens_string": ({"max_new_tokens": "3"}, "max_new_tokens"),
    "max_new_tokens_bool": ({"max_new_tokens": True}, "max_new_tokens"),
    "max_new_tokens_zero": ({"max_new_tokens": 0}, "max_new_tokens"),
    "min_new_tokens_negative": ({"min_new_tokens": -1}, "min_new_tokens"),
    "min_new_tokens_float": ({"min_new_tokens": 1.5}, "min_new_tokens"),
    "max_skips_none": ({"max_skips": None}, "max_skips"),
    "seed_string": ({"seed": "42"}, "seed"),
    "seed_too_large": ({"seed": 2**70}, "seed must fit in 64 bits"),
    "seed_too_small": ({"seed": -(2**63) - 1}, "seed must fit in 64 bits"),
    "return_top_tokens_float": ({"return_top_tokens": 2.0}, "return_top_tokens"),
    "stop_conditions_string": ({"stop_conditions": "stop"}, "stop_conditions"),
    "stop_conditions_none_item": ({"stop_conditions": [None]}, "stop_conditions"),
    "stop_conditions_empty_string": ({"stop_conditions": [""]}, "stop_conditions"),
    "banned_strings_string": ({"banned_strings": "abc"}, "banned_strings"),
    "float_prompt": ({"input_ids": torch.tensor([[1.0, 2.0]])}, "integer token ids"),
}


@pytest.mark.parametrize("case", list(JOB_ARGS))
def test_bad_job_argument(case: str) -> None:
    changes, words = JOB_ARGS[case]
    kw = {"input_ids": ids_of("Echoes of"), "max_new_tokens": 4, "gen_settings": GREEDY, "stop_conditions": [],
          **changes}
    with pytest.raises(GeneratorError, match=words):
        ExLlamaV2DynamicJob(**kw)


def test_generate_with_fractional_max_new_tokens_leaves_generator_usable() -> None:
    g = make_gen()
    model, _ = aidreams()
    for _ in range(2):  # the second call must not fail the same way (nothing was left queued)
        with pytest.raises(GeneratorError, match="max_new_tokens must be an integer >= 1, got 2.5"):
            g.generate("Echoes of", max_new_tokens=2.5)
        _idle_and_clean(g)
    out = g.generate("Echoes of", max_new_tokens=5, gen_settings=GREEDY, stop_conditions=[], add_bos=True,
                     completion_only=True)
    assert aidreams()[1].encode(out)[0].numel() > 0
    _idle_and_clean(g)


@pytest.mark.parametrize("bad", [512, 10**6, -1])
def test_prompt_id_outside_vocabulary_refused_at_enqueue(bad: int) -> None:
    g = make_gen()
    prompt = torch.cat([ids_of("Echoes of"), torch.tensor([[bad]])], dim=1)
    with pytest.raises(GeneratorError, match=rf"token id {bad}, outside the model's vocabulary \[0, 512\)"):
        g.enqueue(_job(prompt))
    _idle_and_clean(g)
    good = _job(ids_of("Echoes of"))
    g.enqueue(good)
    assert drain(g)[good]["tokens"] == argmax_tokens(aidreams()[0], ids_of("Echoes of"), 6)


def test_enqueue_list_is_all_or_nothing() -> None:
    g = make_gen()
    jobs = [_job(ids_of("Echoes of")), _job(ids_of("Once")), _job(torch.tensor([[1, 999]]))]
    with pytest.raises(GeneratorError, match="token id 999"):
        g.enqueue(jobs)
    _idle_and_clean(g)
    assert all(j.finished for j in jobs[:2])


def test_job_failing_in_sampler_ends_alone() -> None:
    """A NaN token bias makes one job's sampler raise on its first token: that job ends with the error, its
    pages are freed, and the jobs batched with it produce the oracle's tokens."""
    model, _ = aidreams()
    nan_bias = torch.zeros(512)
    nan_bias[7] = math.nan
    broken = ExLlamaV2Sampler.Settings(token_bias=nan_bias)
    prompts = [ids_of(p) for p in PROMPTS[:3]]
    g = make_gen()
    jobs = [_job(prompts[0], 8), _job(prompts[1], 8, gen_settings=broken), _job(prompts[2], 8)]
    g.enqueue(jobs)
    res = drain(g)
    final = res[jobs[1]]["final"]
    assert final["eos_reason"] == "error" and isinstance(final["error"], SamplerError)
    for k in (0, 2):
        assert res[jobs[k]]["tokens"] == argmax_tokens(model, prompts[k], 8)
    _idle_and_clean(g)


def test_decode_step_failing_for_one_job_ends_only_that_job() -> None:
    """A batched decode step that fails whenever one job is in it (as a job that breaks the step would): the
    generator runs the jobs one by one, fails only that one and frees its pages."""
    model, _ = aidreams()
    prompts = [ids_of(p) for p in PROMPTS[:3]]
    g = make_gen()
    jobs = [_job(p, 5) for p in prompts]
    real = g.stepper.forward  # every decode step starts here (the batched one and each job's own)

    def step(js: list[ExLlamaV2DynamicJob], prev: Any) -> Any:
        if jobs[1] in js:
            raise RuntimeError("row 1 breaks the step")
        return real(js, prev)

    g.stepper.forward = step  # type: ignore[method-assign]
    g.enqueue(jobs)
    res = drain(g)
    assert res[jobs[1]]["final"]["eos_reason"] == "error"
    assert "row 1 breaks the step" in res[jobs[1]]["final"]["error_message"]
    for k in (0, 2):
        assert res[jobs[k]]["tokens"] == argmax_tokens(model, prompts[k], 5)
    _idle_and_clean(g)


def test_job_failing_at_start_is_removed() -> None:
    class BadFilter:
        def begin(self, prefix: str) -> None:
            raise RuntimeError("filter cannot begin")

        def feed(self, token: int) -> None:
            pass

        def next(self) -> tuple[set[int], set[int]]:
            return set(range(512)), set()

    g = make_gen()
    bad, good = _job(ids_of("Once"), 4, filters=[BadFilter()]), _job(ids_of("Echoes of"), 4)
    g.enqueue([bad, good])
    res = drain(g)
    assert res[bad]["final"]["eos_reason"] == "error" and "cannot begin" in res[bad]["final"]["error_message"]
    assert res[good]["tokens"] == argmax_tokens(aidreams()[0], ids_of("Echoes of"), 4)
    _idle_and_clean(g)


def test_generate_batch_with_failing_job_cancels_the_rest() -> None:
    nan_bias = torch.zeros(512)
    nan_bias[3] = math.nan
    g = make_gen()
    settings = [GREEDY, ExLlamaV2Sampler.Settings(token_bias=nan_bias), GREEDY]
    with pytest.raises(SamplerError):
        g.generate(PROMPTS[:3], max_new_tokens=50, gen_settings=settings, stop_conditions=[], add_bos=True)
    _idle_and_clean(g)  # the batch's other jobs do not run on for a caller that already got the error
    assert g.generate("Once", max_new_tokens=3, gen_settings=GREEDY, stop_conditions=[], add_bos=True)


def test_job_broken_after_its_checks_fails_in_scheduler_without_blocking_queue() -> None:
    """max_new_tokens changed to 2.5 after the job was built (past every check) reaches the scheduler, as in the
    original report: that job ends with an error result and the job behind it runs."""
    g = make_gen()
    bad, good = _job(ids_of("Once"), 4), _job(ids_of("Echoes of"), 4)
    bad.max_new_tokens = 2.5
    g.enqueue([bad, good])
    res = drain(g)
    assert res[bad]["final"]["eos_reason"] == "error"
    assert res[good]["tokens"] == argmax_tokens(aidreams()[0], ids_of("Echoes of"), 4)
    _idle_and_clean(g)


def test_generate_refuses_what_is_not_a_prompt() -> None:
    g = make_gen()
    for prompt in (None, 5, [], [None], ("a",), [b"bytes"]):
        with pytest.raises(GeneratorError, match="prompt must be a string"):
            g.generate(prompt, max_new_tokens=2)
    with pytest.raises(GeneratorError, match="seed must fit in 64 bits"):
        g.generate("Echoes of", max_new_tokens=2, seed=2**70)
    _idle_and_clean(g)
    # The edges torch takes are fine.
    assert g.generate("Echoes of", max_new_tokens=2, seed=2**64 - 1, completion_only=True) is not None
    assert g.generate("Echoes of", max_new_tokens=2, seed=-(2**63), completion_only=True) is not None


def test_unknown_keyword_arguments_are_named() -> None:
    from exlpy.errors import UnknownArgumentError
    from exlpy.generator import ExLlamaV2StreamingGenerator

    g = make_gen()
    model, tok = aidreams()
    calls = {"generate": lambda: g.generate("Echoes of", max_new_tokens=2, max_new_token=5),
             "Settings": lambda: ExLlamaV2Sampler.Settings(temprature=0.5),
             "greedy": lambda: ExLlamaV2Sampler.Settings.greedy(top_kk=3),
             "job": lambda: ExLlamaV2DynamicJob(ids_of("a"), 2, seeds=1),
             "generator": lambda: ExLlamaV2DynamicGenerator(model, g.cache, tok, max_qsize=4),
             "stream": lambda: ExLlamaV2StreamingGenerator(model, g.cache, tok).begin_stream_ex(ids_of("a"), GREEDY,
                                                                                                 loras_=[])}
    for name, call in calls.items():
        with pytest.raises(UnknownArgumentError, match="unexpected keyword argument") as e:
            call()
        assert isinstance(e.value, TypeError), name  # still a TypeError for code that catches one
    assert ExLlamaV2Sampler.Settings(temperature=0.5).temperature == 0.5
    _idle_and_clean(g)


@pytest.mark.parametrize("arg, value", [("max_q_size", 0), ("max_q_size", -1), ("max_q_size", 2.5),
                                        ("max_batch_size", 0), ("max_seq_len", -5), ("max_chunk_size", 0)])
def test_generator_sizes_are_checked(arg: str, value: Any) -> None:
    model, tok = aidreams()
    with pytest.raises(GeneratorError, match=f"{arg} must be an integer >= 1"):
        ExLlamaV2DynamicGenerator(model, ExLlamaV2Cache(model, max_seq_len=256), tok, **{arg: value})
