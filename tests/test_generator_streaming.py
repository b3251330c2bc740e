"""Streaming and base generators vs the argmax oracle and HF transformers; prefix reuse, healing, stops, async."""

from __future__ import annotations

import asyncio

import pytest
import torch

from exlpy import ExLlamaV2Cache
from exlpy.errors import GeneratorError
from exlpy.generator import (
    ExLlamaV2BaseGenerator,
    ExLlamaV2DynamicGenerator,
    ExLlamaV2DynamicGeneratorAsync,
    ExLlamaV2DynamicJob,
    ExLlamaV2DynamicJobAsync,
    ExLlamaV2Sampler,
    ExLlamaV2StreamingGenerator,
)
from tests.conftest import shared_path
from tests.test_generator_helpers import PROMPTS, aidreams, argmax_tokens

GREEDY = ExLlamaV2Sampler.Settings.greedy()


def stream_all(gen: ExLlamaV2StreamingGenerator, n: int) -> tuple[str, list[int], dict]:
    text, toks, r = "", [], {}
    for _ in range(n):
        r = gen.stream_ex()
        text += r["chunk"]
        toks += r["chunk_token_ids"][0].tolist()
        if r["eos"]:
            break
    return text, toks, r


def test_greedy_equals_hf_generate_for_all_generators() -> None:
    transformers = pytest.importorskip("transformers")
    model, tok = aidreams()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(shared_path("models", "aidreams260K"))).eval()
    n = 16
    prompts = PROMPTS[:3]
    ids = [tok.encode(p, add_bos=True) for p in prompts]
    ref = []
    for i in ids:
        with torch.no_grad():
            out = hf.generate(i, attention_mask=torch.ones_like(i), max_new_tokens=n, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        ref.append(out[0, i.shape[1]:].tolist())
        assert ref[-1] == argmax_tokens(model, i, n)

    sg = ExLlamaV2StreamingGenerator(model, ExLlamaV2Cache(model, max_seq_len=256), tok)
    sg.set_stop_conditions([])
    for i, r in zip(ids, ref):
        sg.begin_stream_ex(i, GREEDY)
        assert stream_all(sg, n)[1] == r

    dg = ExLlamaV2DynamicGenerator(model, ExLlamaV2Cache(model, max_seq_len=512), tok)
    jobs = [ExLlamaV2DynamicJob(i, n, gen_settings=GREEDY, stop_conditions=[]) for i in ids]
    dg.enqueue(jobs)
    got: dict = {j: [] for j in jobs}
    while dg.num_remaining_jobs():
        for res in dg.iterate():
            if res["stage"] == "streaming":
                got[res["job"]] += res["token_ids"][0].tolist()
    assert [got[j] for j in jobs] == ref

    bg = ExLlamaV2BaseGenerator(model, ExLlamaV2Cache(model, batch_size=3, max_seq_len=128), tok)
    texts = bg.generate_simple(prompts, GREEDY, n, add_bos=True, stop_token=None, completion_only=True)
    for p, t, r in zip(ids, texts, ref):
        full = tok.decode(torch.cat([p[0], torch.tensor(r)]))
        assert t == full[len(tok.decode(p[0])):]
    assert bg.generate_simple(prompts[1], GREEDY, n, add_bos=True, stop_token=None) == prompts[1] + texts[1]


def test_prefix_reuse_runs_only_new_tokens_and_matches_fresh() -> None:
    model, tok = aidreams()
    a = tok.encode("The gentle hum of precision", add_bos=True)
    b = torch.cat([a, tok.encode(" and vectors")], dim=1)
    sg = ExLlamaV2StreamingGenerator(model, ExLlamaV2Cache(model, max_seq_len=256), tok)
    sg.set_stop_conditions([])
    sg.begin_stream_ex(a, GREEDY)
    stream_all(sg, 5)
    before = sg.prefill_tokens
    sg.begin_stream_ex(b, GREEDY)
    assert sg.prefill_tokens - before == b.shape[1] - 1 - a.shape[1]  # the last token is fed by stream_ex
    reused = stream_all(sg, 8)[1]
    assert reused == argmax_tokens(model, b, 8)


def test_streaming_stop_string_held_and_token_healing() -> None:
    model, tok = aidreams()
    ids = tok.encode("Echoes of", add_bos=True)
    greedy = argmax_tokens(model, ids, 10)
    text = tok.decode(torch.cat([ids[0], torch.tensor(greedy)]))[len(tok.decode(ids[0])):]
    stop = text[6:11]
    sg = ExLlamaV2StreamingGenerator(model, ExLlamaV2Cache(model, max_seq_len=256), tok)
    sg.set_stop_conditions([stop, tok.eos_token_id])
    sg.begin_stream_ex(ids, GREEDY)
    out, _, last = stream_all(sg, 10)
    assert out == text[:6] and last["eos"] and last["eos_reason"] == "stop_string"

    # Healing: "Echoes of probab" ends mid-word; the continuation must extend its last token's text.
    prompt = "Echoes of" + text[:6]
    hid = tok.encode(prompt, add_bos=True)
    sg.set_stop_conditions([])
    sg.begin_stream_ex(hid, GREEDY, token_healing=True)
    healed, toks, _ = stream_all(sg, 6)
    pieces = tok.get_id_to_piece_list()
    assert pieces[toks[0]].startswith(pieces[int(hid[0, -1])])
    full = tok.decode(torch.cat([hid[0, :-1], torch.tensor(toks)]))
    assert full.endswith(healed) and full.startswith(tok.decode(hid[0]))


def test_streaming_errors_and_legacy_tuple() -> None:
    model, tok = aidreams()
    sg = ExLlamaV2StreamingGenerator(model, ExLlamaV2Cache(model, max_seq_len=256), tok)
    with pytest.raises(GeneratorError, match="begin_stream_ex"):
        sg.stream_ex()
    with pytest.raises(GeneratorError, match="does not fit the cache"):
        sg.begin_stream_ex(torch.ones(1, 300, dtype=torch.long), GREEDY)
    sg.begin_stream_ex(tok.encode("Once", add_bos=True), GREEDY, return_probabilities=True, return_top_tokens=3,
                       return_logits=True)
    chunk, eos, ids = sg.stream()
    assert isinstance(chunk, str) and isinstance(eos, bool) and ids.shape[0] == 1
    r = sg.stream_ex()
    n = r["chunk_token_ids"].shape[1]
    assert r["probs"].shape == (1, n) and r["top_tokens"].shape == (1, n, 3) and r["logits"].shape[:2] == (1, n)
    assert sg.get_sd_stats() == (0.0, 0.0, 2, 0, 0)  # two tokens sampled, none drafted


def test_async_generator_matches_sync() -> None:
    model, tok = aidreams()
    ids = [tok.encode(p, add_bos=True) for p in PROMPTS[:3]]

    async def run() -> list[list[int]]:
        gen = ExLlamaV2DynamicGeneratorAsync(model, ExLlamaV2Cache(model, max_seq_len=512), tok)
        jobs = [ExLlamaV2DynamicJobAsync(gen, input_ids=i, max_new_tokens=8, gen_settings=GREEDY,
                                         stop_conditions=[]) for i in ids]

        async def collect(job: ExLlamaV2DynamicJobAsync) -> list[int]:
            toks: list[int] = []
            async for r in job:
                if r["stage"] == "streaming":
                    toks += r["token_ids"][0].tolist()
            return toks

        out = await asyncio.gather(*(collect(j) for j in jobs))
        await gen.close()
        return list(out)

    got = asyncio.run(run())
    assert got == [argmax_tokens(model, i, 8) for i in ids]


def test_sampling_is_reproducible_with_torch_seed_or_set_seed() -> None:
    model, tok = aidreams()
    s = ExLlamaV2Sampler.Settings(temperature=1.0, top_k=0, top_p=1.0, token_repetition_penalty=1.0)
    sg = ExLlamaV2StreamingGenerator(model, ExLlamaV2Cache(model, max_seq_len=256), tok)
    sg.set_stop_conditions([])
    ids = tok.encode("Once", add_bos=True)
    runs = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)  # exllamav2 style: the global RNG
        sg.begin_stream_ex(ids, s)
        runs.append(stream_all(sg, 12)[1])
    sg.begin_stream_ex(ids, s)
    sg.set_seed(3)
    own = stream_all(sg, 12)[1]
    sg.begin_stream_ex(ids, s)
    sg.set_seed(3)
    assert runs[0] == runs[1] != runs[2] and stream_all(sg, 12)[1] == own
    bg = ExLlamaV2BaseGenerator(model, ExLlamaV2Cache(model, batch_size=2, max_seq_len=64), tok)
    one = bg.generate_simple(["Once", "Why"], s, 12, seed=9, add_bos=True, stop_token=None)
    assert one == bg.generate_simple(["Once", "Why"], s, 12, seed=9, add_bos=True, stop_token=None)


class Forced:
    """A filter that allows exactly one token per step: the generator must produce `ids` in order."""

    def __init__(self, ids: list[int]) -> None:
        self.ids, self.k = ids, 0

    def begin(self, prefix: str) -> None:
        self.k = 0

    def feed(self, token: int) -> None:
        self.k += 1

    def next(self) -> tuple[set[int], set[int]]:
        return {self.ids[min(self.k, len(self.ids) - 1)]}, set()


def test_partial_utf8_held_back_end_to_end() -> None:
    model, tok = aidreams()
    target = tok.encode(" caf\u00e9 \u2713 ok")[0].tolist()
    pieces = tok.get_id_to_piece_list()
    assert sum("\ufffd" in pieces[t] for t in target) >= 4  # byte-fallback tokens
    ids = tok.encode("Once", add_bos=True)
    expect = tok.decode(torch.cat([ids[0], torch.tensor(target)]))[len(tok.decode(ids[0])):]

    sg = ExLlamaV2StreamingGenerator(model, ExLlamaV2Cache(model, max_seq_len=256), tok)
    sg.set_stop_conditions([])
    sg.begin_stream_ex(ids, GREEDY, filters=[Forced(target)])
    chunks = [sg.stream_ex()["chunk"] for _ in target]
    assert all("\ufffd" not in c for c in chunks) and "".join(chunks) == expect
    assert "" in chunks  # something was held back while a character was incomplete

    dg = ExLlamaV2DynamicGenerator(model, ExLlamaV2Cache(model, max_seq_len=256), tok)
    job = ExLlamaV2DynamicJob(ids, len(target), gen_settings=GREEDY, stop_conditions=[], filters=[Forced(target)])
    dg.enqueue(job)
    texts = []
    while dg.num_remaining_jobs():
        texts += [r["text"] for r in dg.iterate() if r["stage"] == "streaming"]
    assert all("\ufffd" not in t for t in texts) and "".join(texts) == expect


def test_streaming_cfg_matches_dynamic_cfg() -> None:
    model, tok = aidreams()
    s = ExLlamaV2Sampler.Settings.greedy(cfg_scale=3.0)
    pos, neg = tok.encode("Echoes of", add_bos=True), tok.encode("Once", add_bos=True)
    dg = ExLlamaV2DynamicGenerator(model, ExLlamaV2Cache(model, max_seq_len=512), tok)
    job = ExLlamaV2DynamicJob([pos, neg], 8, gen_settings=s, stop_conditions=[])
    dg.enqueue(job)
    expect: list[int] = []
    while dg.num_remaining_jobs():
        expect += [t for r in dg.iterate() if r["stage"] == "streaming" for t in r["token_ids"][0].tolist()]
    assert expect != argmax_tokens(model, pos, 8)

    ids, offsets = tok.encode(["Echoes of", "Once"], add_bos=True, return_offsets=True)
    sg = ExLlamaV2StreamingGenerator(model, ExLlamaV2Cache(model, batch_size=2, max_seq_len=128), tok)
    sg.set_stop_conditions([])
    sg.begin_stream_ex(ids, s, input_mask=tok.padding_mask(ids), position_offsets=offsets)
    assert stream_all(sg, 8)[1] == expect
    # Afterwards a plain prompt starts over (no prefix reuse from the CFG rows) and is still exact.
    sg.begin_stream_ex(pos, GREEDY)
    assert stream_all(sg, 8)[1] == argmax_tokens(model, pos, 8)
    with pytest.raises(GeneratorError, match="cfg_scale"):
        sg.begin_stream_ex(ids, GREEDY)
