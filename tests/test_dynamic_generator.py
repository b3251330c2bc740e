"""Dynamic generator on a real tiny model: exactness vs an argmax oracle, batching, prefix dedup, paging, errors."""

from __future__ import annotations

import pytest
import torch

from exlpy import ExLlamaV2Cache
from exlpy.errors import GeneratorError
from exlpy.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler
from tests.test_generator_helpers import PROMPTS, aidreams, argmax_tokens, drain

GREEDY = ExLlamaV2Sampler.Settings.greedy()


def make_gen(pages: int = 8, **kw: object) -> ExLlamaV2DynamicGenerator:
    model, tok = aidreams()
    return ExLlamaV2DynamicGenerator(model, ExLlamaV2Cache(model, max_seq_len=pages * 256), tok, **kw)


def job(ids: torch.Tensor, n: int, **kw: object) -> ExLlamaV2DynamicJob:
    kw.setdefault("gen_settings", GREEDY)
    kw.setdefault("stop_conditions", [])
    return ExLlamaV2DynamicJob(ids, n, **kw)  # type: ignore[arg-type]


def test_greedy_matches_argmax_oracle_and_batch_matches_single_runs() -> None:
    model, tok = aidreams()
    ids = [tok.encode(p, add_bos=True) for p in PROMPTS]
    n = 12
    solo = []
    for i in ids[:3]:
        g = make_gen()
        j = job(i, n)
        g.enqueue(j)
        solo.append(drain(g)[j]["tokens"])
    for i, s in zip(ids[:3], solo):
        assert s == argmax_tokens(model, i, n)
    g = make_gen()
    jobs = [job(i, n) for i in ids]
    g.enqueue(jobs)
    res = drain(g)
    for k, j in enumerate(jobs):
        expect = solo[k] if k < 3 else argmax_tokens(model, ids[k], n)
        assert res[j]["tokens"] == expect, PROMPTS[k]
        fin = res[j]["final"]
        assert fin["eos_reason"] == "max_new_tokens" and fin["new_tokens"] == n
        full, head = tok.decode(torch.cat([ids[k][0], torch.tensor(expect)])), tok.decode(ids[k][0])
        assert fin["full_completion"] == res[j]["text"] == full[len(head):]
        assert fin["prompt_tokens"] == ids[k].shape[1]
    assert g.decode_tokens == 8 * n


def test_long_prompt_chunked_prefill_matches_oracle() -> None:
    model, tok = aidreams()
    torch.manual_seed(0)
    ids = torch.cat([torch.tensor([[1]]), torch.randint(3, 500, (1, 700))], dim=1)
    g = make_gen(max_chunk_size=256)
    j = job(ids, 6)
    g.enqueue(j)
    res = drain(g)
    assert res[j]["tokens"] == argmax_tokens(model, ids, 6)
    assert res[j]["stages"].count("prefill") == 3  # 700 prompt tokens in 256-token chunks
    assert g.prefill_tokens == 700


def test_shared_prefix_is_computed_once() -> None:
    model, tok = aidreams()
    torch.manual_seed(1)
    prefix = torch.cat([torch.tensor([[1]]), torch.randint(3, 500, (1, 599))], dim=1)  # 600 tokens
    suffixes = [tok.encode(p) for p in PROMPTS[:4]]
    prompts = [torch.cat([prefix, s], dim=1) for s in suffixes]
    g = make_gen(pages=16)
    jobs = [job(p, 5) for p in prompts]
    g.enqueue(jobs)
    res = drain(g)
    # Pages 0-1 (512 tokens) are full prefix pages: computed by the first job, referenced by the others.
    expected = 512 + sum(p.shape[1] - 1 - 512 for p in prompts)
    assert g.prefill_tokens == expected
    assert g.cached_tokens == 3 * 512
    for p, j in zip(prompts, jobs):
        assert res[j]["tokens"] == argmax_tokens(model, p, 5)
    # The same prompt again after the jobs ended: its full pages are still cached (ref count 0, hash kept)...
    before = g.prefill_tokens
    j2 = job(prompts[0], 5)
    g.enqueue(j2)
    res2 = drain(g)
    assert res2[j2]["tokens"] == res[jobs[0]]["tokens"]
    assert res2[j2]["final"]["cached_pages"] == 2 and res2[j2]["final"]["cached_tokens"] == 512
    # ...and its last, partial page is copied from the freed page that held the same tokens: nothing to run.
    assert g.prefill_tokens == before


def test_cancel_frees_pages_and_waiting_jobs_get_them() -> None:
    _, tok = aidreams()
    g = make_gen(pages=2)
    ids = tok.encode("Echoes of", add_bos=True)
    a, b, c = job(ids, 300), job(ids, 10), job(ids, 10)  # a grows to 2 pages: the whole cache
    g.enqueue([a, b, c])
    g.iterate()
    # Pages are taken on demand: a holds one, the other is kept free for a running job to grow into.
    assert a in g.active and b.wait_reason is not None and "waiting for cache pages" in b.wait_reason
    assert "the cache holds 512 tokens (2 pages of 256)" in b.wait_reason
    assert g.page_table.num_unreferenced() == 1
    g.cancel(a)
    assert g.page_table.num_unreferenced() == 2 and a not in g.active
    res = drain(g)
    assert res[b]["tokens"] == res[c]["tokens"] and len(res[b]["tokens"]) == 10
    assert g.page_table.num_unreferenced() == 2
    with pytest.raises(GeneratorError, match="not queued or running"):
        g.cancel(a)


@pytest.mark.parametrize("where", ["cpu", "default"])
def test_same_seed_same_text_batched_or_alone(where: str) -> None:
    """A seed gives the same text run again, and batched with other prompts where the logits do not depend on
    the batch (the fp32 CPU model; in fp16 on a GPU a batched step's logits differ from a lone one's in the last
    bits, which moves a whole-vocabulary draw now and then: there, the same text run again)."""
    from tests.test_generator_helpers import aidreams_cpu

    model, tok = aidreams_cpu() if where == "cpu" else aidreams()
    s = ExLlamaV2Sampler.Settings(temperature=1.0, top_k=0, top_p=1.0, token_repetition_penalty=1.0)
    g = ExLlamaV2DynamicGenerator(model, ExLlamaV2Cache(model, max_seq_len=8 * 256), tok)
    one = g.generate(PROMPTS[0], 16, seed=7, gen_settings=s, stop_conditions=[], add_bos=True)
    again = g.generate(PROMPTS[0], 16, seed=7, gen_settings=s, stop_conditions=[], add_bos=True)
    batch = g.generate(PROMPTS[:3], 16, seed=7, gen_settings=s, stop_conditions=[], add_bos=True)
    other = [g.generate(PROMPTS[0], 16, seed=k, gen_settings=s, stop_conditions=[], add_bos=True)
             for k in (8, 9, 10)]
    assert one == again
    if where == "cpu" or not torch.cuda.is_available():
        assert one == batch[0]
    assert any(o != one for o in other)


def test_stop_string_across_tokens_is_held_and_not_emitted() -> None:
    model, tok = aidreams()
    ids = tok.encode("Echoes of", add_bos=True)
    greedy = argmax_tokens(model, ids, 12)
    pieces = tok.get_id_to_piece_list()
    text = tok.decode(torch.cat([ids[0], torch.tensor(greedy)]))[len(tok.decode(ids[0])):]
    assert text == "".join(pieces[t] for t in greedy)
    # A stop string made of the last 2 chars of token k and the first 2 of token k + 1.
    k = next(i for i in range(1, 10) if len(pieces[greedy[i]]) >= 3 and len(pieces[greedy[i + 1]]) >= 2)
    at = len("".join(pieces[t] for t in greedy[:k + 1])) - 2
    stop = text[at:at + 4]
    assert stop not in text[:at + 3]
    g = make_gen()
    j = job(ids, 12, stop_conditions=[stop])
    g.enqueue(j)
    chunks = []
    while g.num_remaining_jobs():
        chunks += [r for r in g.iterate() if r["stage"] == "streaming"]
    assert "".join(r["text"] for r in chunks) == text[:at]
    assert all(stop[:2] not in r["text"] for r in chunks)
    assert chunks[-1]["eos_reason"] == "stop_string" and chunks[-1]["eos_triggering_string"] == stop


def test_min_new_tokens_suppresses_stop_token() -> None:
    model, tok = aidreams()
    ids = tok.encode("Echoes of", add_bos=True)
    first = argmax_tokens(model, ids, 1)[0]
    g = make_gen()
    a, b = job(ids, 8, stop_conditions=[first]), job(ids, 8, stop_conditions=[first], min_new_tokens=3)
    g.enqueue([a, b])
    res = drain(g)
    assert res[a]["final"]["eos_reason"] == "stop_token" and res[a]["tokens"] == [first]
    assert res[b]["tokens"][0] != first and res[b]["final"]["new_tokens"] >= 3


def test_banned_string_is_avoided() -> None:
    model, tok = aidreams()
    ids = tok.encode("Echoes of", add_bos=True)
    plain = tok.decode(torch.cat([ids[0], torch.tensor(argmax_tokens(model, ids, 12))]))
    word = plain.split()[2]  # a word the model would produce
    g = make_gen()
    j = job(ids, 12, banned_strings=[word.upper()])
    g.enqueue(j)
    res = drain(g)
    assert word.lower() not in res[j]["text"].lower()
    assert res[j]["final"]["new_tokens"] == 12


def test_failing_job_does_not_take_down_the_others() -> None:
    model, tok = aidreams()

    class Broken:
        def begin(self, prefix: str) -> None:
            pass

        def feed(self, token: int) -> None:
            raise RuntimeError("filter exploded")

        def next(self) -> tuple[set[int], set[int]]:
            return set(range(512)), set()

    ids = [tok.encode(p, add_bos=True) for p in PROMPTS[:3]]
    g = make_gen()
    jobs = [job(ids[0], 6), job(ids[1], 6, filters=[Broken()]), job(ids[2], 6)]
    g.enqueue(jobs)
    res = drain(g)
    assert res[jobs[1]]["final"]["eos_reason"] == "error"
    assert "filter exploded" in res[jobs[1]]["final"]["error_message"]
    assert res[jobs[0]]["tokens"] == argmax_tokens(model, ids[0], 6)
    assert res[jobs[2]]["tokens"] == argmax_tokens(model, ids[2], 6)
    assert g.page_table.num_unreferenced() == g.num_pages


def test_bad_input_errors() -> None:
    _, tok = aidreams()
    g = make_gen(pages=2)
    ids = tok.encode("Echoes of", add_bos=True)
    # Pages are taken as sequences grow, but a job that could never fit (here two 300-token CFG sequences
    # each growing to 2 pages) is refused up front.
    with pytest.raises(GeneratorError, match=r"Job requires 4 pages \(only 2 available\)"):
        g.enqueue(job([torch.ones(1, 300, dtype=torch.long)] * 2, 200,
                      gen_settings=ExLlamaV2Sampler.Settings.greedy(cfg_scale=2.0)))
    with pytest.raises(GeneratorError, match="does not fit max_seq_len"):
        make_gen(pages=2, max_seq_len=256).enqueue(job(torch.ones(1, 300, dtype=torch.long), 10))
    j = job(ids, 4)
    g.enqueue(j)
    with pytest.raises(GeneratorError, match="already enqueued"):
        g.enqueue(j)
    with pytest.raises(GeneratorError, match="not queued or running"):
        g.cancel(job(ids, 4))
    with pytest.raises(GeneratorError, match=r"\[1, n\]"):
        job(torch.ones(2, 3, dtype=torch.long), 4)
    with pytest.raises(GeneratorError, match="CFG"):
        job([ids, ids], 4)
    with pytest.raises(GeneratorError, match="multiple of the page size"):
        model, _ = aidreams()
        ExLlamaV2DynamicGenerator(model, ExLlamaV2Cache(model, max_seq_len=300), tok)
    g.clear_queue()
    assert g.num_remaining_jobs() == 0 and g.page_table.num_unreferenced() == 2


def test_cfg_job_matches_manual_guidance() -> None:
    model, tok = aidreams()
    pos, neg = tok.encode("Echoes of", add_bos=True), tok.encode("Once", add_bos=True)
    scale, n = 3.0, 8
    expect: list[int] = []
    a, b = pos.clone(), neg.clone()
    for _ in range(n):
        la = torch.log_softmax(model.forward(a)[0, -1], -1)
        lb = torch.log_softmax(model.forward(b)[0, -1], -1)
        t = int((scale * la + (1 - scale) * lb).argmax())
        expect.append(t)
        a, b = torch.cat([a, torch.tensor([[t]])], 1), torch.cat([b, torch.tensor([[t]])], 1)
    assert expect != argmax_tokens(model, pos, n)  # guidance changes the output
    g = make_gen()
    j = job([pos, neg], n, gen_settings=ExLlamaV2Sampler.Settings.greedy(cfg_scale=scale))
    plain = job(pos, n)
    g.enqueue([j, plain])
    res = drain(g)
    assert res[j]["tokens"] == expect
    assert res[plain]["tokens"] == argmax_tokens(model, pos, n)
    assert g.page_table.num_unreferenced() == g.num_pages
    text = g.generate(("Echoes of", "Once"), n, gen_settings=ExLlamaV2Sampler.Settings.greedy(
        cfg_scale=scale), add_bos=True, stop_conditions=[], completion_only=True)
    assert text == res[j]["text"]


def test_next_chat_turn_reuses_full_and_partial_pages() -> None:
    model, tok = aidreams()
    torch.manual_seed(2)
    first = torch.cat([torch.tensor([[1]]), torch.randint(3, 500, (1, 299))], dim=1)  # 300 tokens
    g = make_gen()
    a = job(first, 20)
    g.enqueue(a)
    turn1 = drain(g)[a]["tokens"]
    # Next turn: the whole previous conversation plus a new message. Page 0 comes back by hash; page 1 was
    # partial (tokens 256..318 have K/V) and is copied from the freed page; only the rest is computed.
    second = torch.cat([first, torch.tensor([turn1]), torch.randint(3, 500, (1, 40))], dim=1)
    before, cached_before = g.prefill_tokens, g.cached_tokens
    b = job(second, 6)
    g.enqueue(b)
    res = drain(g)
    valid_turn1 = first.shape[1] + len(turn1) - 1
    assert g.cached_tokens - cached_before == valid_turn1
    assert g.prefill_tokens - before == second.shape[1] - 1 - valid_turn1
    assert res[b]["tokens"] == argmax_tokens(model, second, 6)


def test_max_skips_stops_later_jobs_from_overtaking() -> None:
    _, tok = aidreams()
    ids = tok.encode("Once", add_bos=True)
    torch.manual_seed(3)
    long_a, long_b = torch.randint(3, 500, (1, 300)), torch.randint(3, 500, (1, 600))
    g = make_gen(pages=4)
    # Admission takes pages for the prompt (+1 kept free for running jobs to grow into once one runs).
    a, b = job(long_a, 30), job(long_b, 3, max_skips=1)  # 2 and 3 pages
    c, d = job(ids, 3), job(ids, 3)  # 1 page each
    g.enqueue([a, b, c, d])
    g.iterate()
    assert g.active == [a, c] and b.skips == 1  # c overtook b once
    while c in g.active:
        g.iterate()
    # Two pages are free and d would fit, but b has been skipped max_skips times: nobody may overtake it again.
    g.iterate()
    assert d not in g.active and "pages" in (b.wait_reason or "")
    order = []
    while g.num_remaining_jobs():
        order += [r["job"] for r in g.iterate() if r["stage"] == "started"]
    assert order == [b, d]


def test_result_fields_and_stages() -> None:
    _, tok = aidreams()
    g = make_gen()
    j = job(tok.encode("Once", add_bos=True), 5, return_probs=True, return_top_tokens=4, return_logits=True,
            identifier="x")
    g.enqueue(j)
    results = []
    while g.num_remaining_jobs():
        results += g.iterate()
    assert [r["stage"] for r in results][:2] == ["started", "prefill"]
    stream = [r for r in results if r["stage"] == "streaming"]
    assert all(r["identifier"] == "x" and r["serial"] == j.serial for r in results)
    n = sum(r["token_ids"].shape[1] for r in stream)
    assert n == 5
    for r in stream:
        k = r["token_ids"].shape[1]
        assert r["token_probs"].shape == (1, k) and r["top_k_tokens"].shape == (1, k, 4)
        assert r["logits"].shape[:2] == (1, k)
        assert torch.equal(r["top_k_tokens"][0, :, 0], r["token_ids"][0])  # greedy: the top token is drawn
    last = stream[-1]
    for key in ("eos_reason", "full_completion", "new_tokens", "prompt_tokens", "time_enqueued", "time_prefill",
                "time_generate", "cached_pages", "cached_tokens"):
        assert key in last
