"""Where the overlapped generator loop (pages on demand, preemption, device sampling, speculation) meets grammar
filters and LoRA adapters, on the bundled demo model (aidreams260K, CPU):

- a grammar-constrained job is masked on the device and then sampled there like any other row, next to
  unconstrained rows, giving exactly the tokens of the host-sampled path;
- constrained jobs never draft in a speculative generator (a filter cannot follow unverified drafts) and give
  the tokens they give without speculation;
- adapter jobs keep their adapters through speculative verification (a draft model without adapters only
  proposes), through preemption (the slot goes back while the job waits) and in shared prefix pages.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from exlpy import ExLlamaV2Cache
from exlpy.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler
from exlpy.lora.slots import registry_of
from tests.lora_util import demo_with_two_adapters
from tests.test_generator_helpers import PROMPTS, drain

pytest.importorskip("llguidance")
from exlpy.generator.filters.grammar import ExLlamaV2GrammarFilter  # noqa: E402

GREEDY = ExLlamaV2Sampler.Settings.greedy()
TOP_P = ExLlamaV2Sampler.Settings(temperature=1.2, top_k=0, top_p=0.95, token_repetition_penalty=1.0)
PATTERN = r"(the|a|one) [a-z]+ (cat|dog|bird)s? (is|was) [a-z]+\."


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return demo_with_two_adapters(tmp_path_factory.mktemp("interactions"), max_seq_len=2048)


def gen(demo: dict[str, Any], pages: int = 8, page_size: int = 256, **kw: Any) -> ExLlamaV2DynamicGenerator:
    m = demo["model"]
    return ExLlamaV2DynamicGenerator(m, ExLlamaV2Cache(m, max_seq_len=pages * page_size), demo["tok"],
                                     page_size=page_size, **kw)


def job(ids: torch.Tensor, n: int, **kw: Any) -> ExLlamaV2DynamicJob:
    kw.setdefault("gen_settings", GREEDY)
    kw.setdefault("stop_conditions", [])
    return ExLlamaV2DynamicJob(ids, n, **kw)


def oracle(model: Any, ids: torch.Tensor, n: int, loras: Any = None) -> list[int]:
    """n greedy tokens from full forward passes (no cache) with `loras`."""
    out, seq = [], ids.clone()
    for _ in range(n):
        t = int(model.forward(seq, loras=loras)[0, -1].argmax())
        out.append(t)
        seq = torch.cat([seq, torch.tensor([[t]])], dim=1)
    return out


def grammar(demo: dict[str, Any]) -> ExLlamaV2GrammarFilter:
    return ExLlamaV2GrammarFilter.regex(demo["model"], demo["tok"], PATTERN)


def constrained_batch(demo: dict[str, Any], g: ExLlamaV2DynamicGenerator, host: bool) -> list[dict[str, Any]]:
    """Two constrained jobs (greedy, seeded top-p) and two free ones (greedy, seeded top-p) in one batch;
    `host` forces the constrained jobs onto the host sampler (with the mask still applied on the device)."""
    tok = demo["tok"]
    ids = [tok.encode(p, add_bos=True) for p in PROMPTS[:4]]
    stop = [tok.eos_token_id]
    jobs = [job(ids[0], 40, filters=[grammar(demo)], stop_conditions=stop),
            job(ids[1], 40, filters=[grammar(demo)], gen_settings=TOP_P, seed=5, stop_conditions=stop),
            job(ids[2], 12), job(ids[3], 12, gen_settings=TOP_P, seed=9)]
    if host:
        for j in jobs[:2]:
            j.device_sampling = lambda: None  # type: ignore[method-assign]
    else:
        assert all(j.device_masked() for j in jobs[:2])
    g.enqueue(jobs)
    res = drain(g)
    return [res[j] for j in jobs]


def test_grammar_jobs_are_masked_and_sampled_on_the_device_next_to_free_jobs(demo: dict[str, Any]) -> None:
    g = gen(demo)
    device = constrained_batch(demo, g, host=False)
    host = constrained_batch(demo, g, host=True)
    for d, h in zip(device, host):
        assert d["tokens"] == h["tokens"] and d["text"] == h["text"]
    for r in device[:2]:
        assert re.fullmatch(PATTERN, r["text"]), r["text"]
        assert r["final"]["eos_reason"] in ("stop_token", "end_filter")
    assert device[2]["tokens"] == oracle(demo["model"], demo["tok"].encode(PROMPTS[2], add_bos=True), 12)
    assert g.page_table.num_unreferenced() == g.num_pages


def test_constrained_jobs_never_draft_and_match_decoding_without_speculation(demo: dict[str, Any]) -> None:
    plain = constrained_batch(demo, gen(demo), host=False)
    g = gen(demo, use_ngram_draft=True, num_draft_tokens=3)
    g.ngram_preload(" ".join(PROMPTS) * 4)
    spec = constrained_batch(demo, g, host=False)
    for k in range(3):  # (the sampled free job drafts: its random numbers are spent differently)
        assert plain[k]["tokens"] == spec[k]["tokens"], k
    assert all(s["final"]["accepted_draft_tokens"] == s["final"]["rejected_draft_tokens"] == 0 for s in spec[:2])
    assert g.get_sd_stats()[3] > 0  # the free greedy job did draft


@pytest.mark.parametrize("drafter", ["ngram", "base-model"])
def test_speculative_verification_keeps_each_jobs_adapter(demo: dict[str, Any], drafter: str) -> None:
    m, tok, a, b = demo["model"], demo["tok"], demo["a"], demo["b"]
    ids = [tok.encode(p, add_bos=True) for p in PROMPTS[4:8]]
    sets = [[a], [b], None, [a, b]]
    n = 12
    if drafter == "ngram":
        g = gen(demo, use_ngram_draft=True, num_draft_tokens=3)
        g.ngram_preload(tok.decode(torch.tensor(oracle(m, ids[0], n, [a]))) * 3)
    else:  # the same weights without adapters draft for adapted targets
        g = gen(demo, draft_model=m, draft_cache=ExLlamaV2Cache(m, max_seq_len=8 * 256), num_draft_tokens=3)
    jobs = [job(i, n, loras=s) for i, s in zip(ids, sets)]
    g.enqueue(jobs)
    res = drain(g)
    for i, s, j in zip(ids, sets, jobs):
        assert res[j]["tokens"] == oracle(m, i, n, s), (drafter, s)
    assert g.get_sd_stats()[3] > 0
    reg = registry_of(m)
    assert all(slot is None or slot.users == 0 for slot in reg.slots)  # every job gave its slot back


def test_preempted_adapter_jobs_resume_with_their_adapter(demo: dict[str, Any]) -> None:
    m, tok, a, b = demo["model"], demo["tok"], demo["a"], demo["b"]
    ids = [tok.encode(p, add_bos=True) for p in PROMPTS[:5]]
    sets = [[a], None, [b], [a], None]
    n = 18
    # 6 pages of 8 tokens for five jobs that each grow to 3 pages: the newest are preempted and resumed.
    g = gen(demo, pages=6, page_size=8)
    jobs = [job(i, n, loras=s) for i, s in zip(ids, sets)]
    g.enqueue(jobs)
    res = drain(g)
    assert g.preemptions > 0
    for i, s, j in zip(ids, sets, jobs):
        assert res[j]["tokens"] == oracle(m, i, n, s), s
        assert res[j]["stages"].count("started") == 1
    assert g.page_table.num_unreferenced() == g.num_pages
    assert all(slot is None or slot.users == 0 for slot in registry_of(m).slots)


def test_preempted_job_gives_its_slot_to_a_waiting_adapter_job(demo: dict[str, Any]) -> None:
    from exlpy.lora import configure

    m, tok, a, b = demo["model"], demo["tok"], demo["a"], demo["b"]
    configure(m, max_adapters=1)
    try:
        g = gen(demo, pages=6, page_size=8)
        ja = job(tok.encode(PROMPTS[0], add_bos=True), 30, loras=[a])
        g.enqueue(ja)
        g.iterate()
        assert ja.lora_slot >= 0
        from exlpy.generator.dynamic.scheduler import preempt

        preempt(g, ja, "preempted by the test")
        assert ja.lora_slot == -1 and ja in g.pending  # the slot went back with the pages
        jb = job(tok.encode(PROMPTS[1], add_bos=True), 6, loras=[b])
        g.enqueue(jb)
        res = drain(g)
        assert res[ja]["tokens"] == oracle(m, tok.encode(PROMPTS[0], add_bos=True), 30, [a])
        assert res[jb]["tokens"] == oracle(m, tok.encode(PROMPTS[1], add_bos=True), 6, [b])
    finally:
        configure(m, max_adapters=8)


# --- issue 15: a constrained stream keeps the overlapped loop's structure -------------------------------------
_EVENTS: list[str] = []
_READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero", "unique",
          "masked_select", "equal", "allclose"}


class _OnDevice(torch.Tensor):
    """Stands for what lives on the GPU in a CUDA run (the logits and everything computed from them, the sampled
    tokens included): reading such a tensor's values on the host is a wait on the device there, logged "sync"."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in _READS:
            _EVENTS.append("sync")
        return super().__torch_function__(func, types, args, kwargs or {})


def _traced_steps(demo: dict[str, Any], constrained: bool, settings: Any, n: int = 16
                  ) -> tuple[list[list[str]], list[int]]:
    """Run one job alone; per iterate(): what happened, in order ("forward" of a decode step, "sync", "feed"
    of a token to the grammar, "mask" collected, "sample" launched), and the job's tokens."""
    from exlpy.generator.dynamic import decode
    from exlpy.generator.filters import device

    model, tok = demo["model"], demo["tok"]
    forward, collect, sample_rows = model.forward_batch, device.collect, decode.sample_rows

    def traced_forward(ids: torch.Tensor, *a: Any, **k: Any) -> Any:
        if not k.get("preprocess_only"):
            _EVENTS.append("forward")
        out = forward(ids.as_subclass(torch.Tensor), *a, **k)
        return None if out is None else out.as_subclass(_OnDevice)

    def log(tag: str, fn: Any) -> Any:
        return lambda *a, **k: (_EVENTS.append(tag), fn(*a, **k))[1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model, "forward_batch", traced_forward)
        mp.setattr(device, "collect", log("mask", collect))
        mp.setattr(decode, "sample_rows", log("sample", sample_rows))
        filters = []
        if constrained:
            f = ExLlamaV2GrammarFilter.regex(model, tok, r"[a-z]+( [a-z]+){40,}")
            mp.setattr(f, "feed", log("feed", f.feed))
            filters = [f]
        g = gen(demo)
        g.enqueue(job(tok.encode(PROMPTS[1], add_bos=True), n, filters=filters, gen_settings=settings, seed=3))
        steps, tokens = [], []
        while g.num_remaining_jobs():
            _EVENTS.clear()
            for r in g.iterate():
                assert "error" not in r, r.get("error_message")
                if r["stage"] == "streaming":
                    tokens += r["token_ids"][0].tolist()
            steps.append(list(_EVENTS))
        _EVENTS.clear()
    return steps, tokens


@pytest.mark.parametrize("settings", [GREEDY, TOP_P], ids=["greedy", "top_p"])
def test_constrained_step_launches_the_next_forward_before_reading_the_token(demo: dict[str, Any],
                                                                           settings: Any) -> None:
    """The forward pass of step t+1 needs token t on the device, not the mask: it is launched before the host
    waits for token t; the host then feeds the token to the grammar and collects the next mask while the GPU
    runs that forward pass, and the masked sampling follows it on the stream. One wait on the device per step,
    as without a constraint; the same tokens as the host-sampled path."""
    n = 16
    free, _ = _traced_steps(demo, False, settings, n)
    steps, tokens = _traced_steps(demo, True, settings, n)
    assert len(tokens) == n and re.fullmatch(r"[a-z]+( [a-z]+)*", demo["tok"].decode(torch.tensor(tokens)).strip())
    # Steady state: every iterate() that launches a step and reads the one before it (not the first or last).
    middle = [s for s in steps if "forward" in s and "sync" in s]
    free_middle = [s for s in free if "forward" in s and "sync" in s]
    assert len(middle) >= n - 3 and len(free_middle) >= n - 3
    assert all(s == ["forward", "sample", "sync"] for s in free_middle), free_middle
    assert all(s == ["forward", "sync", "feed", "mask", "sample"] for s in middle), middle
    total = lambda ss: sum(s.count("sync") for s in ss)  # noqa: E731
    assert total(steps) <= total(free) + 1
    model, tok = demo["model"], demo["tok"]
    host = job(tok.encode(PROMPTS[1], add_bos=True), n, gen_settings=settings, seed=3,
               filters=[ExLlamaV2GrammarFilter.regex(model, tok, r"[a-z]+( [a-z]+){40,}")])
    host.device_sampling = lambda: None  # type: ignore[method-assign]
    g = gen(demo)
    g.enqueue(host)
    assert drain(g)[host]["tokens"] == tokens


def test_grammar_failing_between_forward_and_sampling_fails_its_job_alone(demo: dict[str, Any]) -> None:
    """A filter whose mask computation fails after a few tokens: the error comes out when the step's rows are
    masked, after its forward pass was launched and the previous tokens were fed. Only that job ends (with the
    error); the constrained and free jobs beside it give exactly the tokens they give without it."""
    from exlpy.errors import GrammarError

    tok = demo["tok"]
    ids = [tok.encode(p, add_bos=True) for p in PROMPTS[:3]]
    stop = [tok.eos_token_id]

    def batch(fail_at: int | None) -> list[dict[str, Any]]:
        bad = grammar(demo)
        if fail_at is not None:
            calls, compute = [0], bad.prepare_logit_mask

            def failing() -> bool:
                calls[0] += 1
                if calls[0] >= fail_at:
                    raise GrammarError("regex: the test's mask failure")
                return compute()

            bad.prepare_logit_mask = failing  # type: ignore[method-assign]
        jobs = [job(ids[0], 40, filters=[bad], stop_conditions=stop),
                job(ids[1], 40, filters=[grammar(demo)], gen_settings=TOP_P, seed=5, stop_conditions=stop),
                job(ids[2], 12)]
        g = gen(demo)
        g.enqueue(jobs)
        res = drain(g)
        assert g.page_table.num_unreferenced() == g.num_pages
        return [res[j] for j in jobs]

    clean, failed = batch(None), batch(4)
    assert failed[0]["final"]["eos_reason"] == "error" and "mask failure" in failed[0]["final"]["error_message"]
    assert len(clean[0]["tokens"]) > 3 and failed[0]["tokens"] == clean[0]["tokens"][:3]  # masks 1-3 came
    for c, f in zip(clean[1:], failed[1:]):
        assert c["tokens"] == f["tokens"] and c["final"]["eos_reason"] == f["final"]["eos_reason"]
