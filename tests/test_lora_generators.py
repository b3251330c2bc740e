"""Adapters through the generators on the bundled demo model: the dynamic generator batches jobs with
different adapters (and none) in one step, keeps their cached prefixes apart and waits for a free slot; the
streaming and base generators take `loras=` / `set_loras`. Greedy tokens must equal an argmax oracle that runs
full forwards with the same adapters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Lora
from exlpy.demo import DEMO_MODEL_DIR
from exlpy.errors import ModelStateError
from exlpy.generator import (
    ExLlamaV2BaseGenerator,
    ExLlamaV2DynamicGenerator,
    ExLlamaV2DynamicJob,
    ExLlamaV2Sampler,
    ExLlamaV2StreamingGenerator,
)
from exlpy.lora import configure
from tests.lora_util import demo_with_two_adapters, write_adapter
from tests.test_generator_helpers import drain

GREEDY = ExLlamaV2Sampler.Settings.greedy()
N = 10


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return demo_with_two_adapters(tmp_path_factory.mktemp("lora_gen"), max_seq_len=1024)


def oracle(model: ExLlamaV2, ids: torch.Tensor, n: int, loras: list | None) -> list[int]:
    out, seq = [], ids.clone()
    for _ in range(n):
        t = int(model.forward(seq, loras=loras)[0, -1].argmax())
        out.append(t)
        seq = torch.cat([seq, torch.tensor([[t]])], dim=1)
    return out


def _gen(demo: dict, pages: int = 4, **kw: object) -> ExLlamaV2DynamicGenerator:
    m = demo["model"]
    return ExLlamaV2DynamicGenerator(m, ExLlamaV2Cache(m, max_seq_len=pages * 256), demo["tok"], **kw)


def _job(ids: torch.Tensor, **kw: object) -> ExLlamaV2DynamicJob:
    return ExLlamaV2DynamicJob(ids, N, gen_settings=GREEDY, stop_conditions=[], **kw)  # type: ignore[arg-type]


def test_dynamic_batches_jobs_with_different_adapters(demo: dict) -> None:
    m, tok, a, b = demo["model"], demo["tok"], demo["a"], demo["b"]
    ids = [tok.encode(p, add_bos=True) for p in ("Echoes of", "Once", "The gentle hum of", "Why")]
    sets = [[a], [b], None, [a, b]]
    g = _gen(demo)
    jobs = [_job(i, loras=s) for i, s in zip(ids, sets)]
    g.enqueue(jobs)
    res = drain(g)
    for i, s, j in zip(ids, sets, jobs):
        assert res[j]["tokens"] == oracle(m, i, N, s), s
    assert g.decode_tokens == 4 * N  # every step served all four jobs together
    plain = oracle(m, ids[0], N, None)
    assert res[jobs[0]]["tokens"] != plain  # the adapter changes the text
    g.set_loras([b])  # the default for jobs that name none; an explicit [] means none
    j1, j2 = _job(ids[0]), _job(ids[0], loras=[])
    g.enqueue([j1, j2])
    res = drain(g)
    assert res[j1]["tokens"] == oracle(m, ids[0], N, [b]) and res[j2]["tokens"] == plain


def test_prefix_cache_is_per_adapter(demo: dict) -> None:
    m, a, b = demo["model"], demo["a"], demo["b"]
    rnd = torch.randint(3, 500, (1, 300), generator=torch.Generator().manual_seed(0))
    prompt = torch.cat([torch.tensor([[1]]), rnd], dim=1)
    g = _gen(demo, pages=8)
    n = prompt.shape[1] - 1  # tokens a prefill computes: a full page and a partial one, both reusable
    for loras, cached in (([a], 0), ([b], 0), ([a], n), (None, 0), (None, n)):
        before = g.cached_tokens
        j = _job(prompt, loras=loras)
        g.enqueue(j)
        res = drain(g)
        assert g.cached_tokens - before == cached, loras  # pages are reused only under the same adapters
        assert res[j]["tokens"] == oracle(m, prompt, N, loras)


def test_jobs_wait_for_a_free_slot_and_unload_rules(demo: dict) -> None:
    m, tok = demo["model"], demo["tok"]
    ids = tok.encode("In the quiet", add_bos=True)
    path = write_adapter(demo["root"] / "c", Path(DEMO_MODEL_DIR), r=8, seed=3, std=0.3)
    c = ExLlamaV2Lora.from_directory(m, str(path))
    d = ExLlamaV2Lora.from_directory(m, str(path), lora_scaling=0.5)
    configure(m, max_adapters=1)
    try:
        g = _gen(demo)
        jc, jd = _job(ids, loras=[c]), _job(ids, loras=[d])
        g.enqueue([jc, jd])
        g.iterate()
        assert jc in g.active and jd in g.pending and "adapter slot" in (jd.wait_reason or "")
        with pytest.raises(ModelStateError, match="in use"):
            c.unload()
        drain(g)
        for j, lora in ((jc, c), (jd, d)):
            assert j.sequence[ids.shape[1]:].tolist() == oracle(m, ids, N, [lora])
        c.unload()  # nothing runs with it any more
        with pytest.raises(ModelStateError, match="unloaded"):
            g.enqueue(_job(ids, loras=[c]))
        je = _job(ids, loras=[d])
        g.enqueue(je)
        d.unload()  # while the job waits in the queue: it ends with an error, the generator goes on
        res = drain(g)
        assert res[je]["final"]["eos_reason"] == "error" and "unloaded" in res[je]["final"]["error_message"]
    finally:
        configure(m, max_adapters=8)


def test_streaming_and_base_generators(demo: dict) -> None:
    m, tok, a, b = demo["model"], demo["tok"], demo["a"], demo["b"]
    ids = tok.encode("Vectors align, and", add_bos=True)
    cache = ExLlamaV2Cache(m, max_seq_len=256)
    gen = ExLlamaV2StreamingGenerator(m, cache, tok)
    gen.set_stop_conditions([])

    def stream(**kw: object) -> list[int]:
        gen.begin_stream_ex(ids, GREEDY, **kw)
        out: list[int] = []
        while len(out) < N:
            out += gen.stream_ex()["chunk_token_ids"][0].tolist()
        return out[:N]

    assert stream(loras=[a]) == oracle(m, ids, N, [a])
    # Same prompt under another adapter: the cached prefix was computed with `a`, so it is not reused.
    before = gen.prefill_tokens
    assert stream(loras=[b]) == oracle(m, ids, N, [b]) and gen.prefill_tokens - before == ids.shape[1] - 1
    gen.set_loras([a])
    assert stream() == oracle(m, ids, N, [a])
    assert stream(loras=[]) == oracle(m, ids, N, None)
    base = ExLlamaV2BaseGenerator(m, ExLlamaV2Cache(m, batch_size=2, max_seq_len=256), tok)
    texts = base.generate_simple(["Vectors align, and", "Once"], GREEDY, N, loras=[b], stop_token=None,
                                 add_bos=True, completion_only=True)
    for p, t in zip(["Vectors align, and", "Once"], texts):
        pid = tok.encode(p, add_bos=True)
        full, head = tok.decode(torch.cat([pid[0], torch.tensor(oracle(m, pid, N, [b]))])), tok.decode(pid[0])
        assert t == full[len(head):]
