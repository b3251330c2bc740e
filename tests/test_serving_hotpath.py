"""The server's per-token path made cheap (issue 29): the result hand-off of a JobHandle, the lock-free latency
histograms, the templated SSE text events and the lazy result reader must behave as the slower forms did."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest
import torch

from exlpy.server.bridge import _END, JobFailedError, JobHandle
from exlpy.server.format import ResultReader
from exlpy.server.serve import Run, _chunk, _sse, _text_event


def _result(ids: list[int], text: str = "x", eos: bool = False, reason: str = "") -> dict[str, Any]:
    r: dict[str, Any] = {"stage": "streaming", "eos": eos, "text": text,
                         "token_ids": torch.tensor([ids], dtype=torch.long)}
    if eos:
        r.update(eos_reason=reason, new_tokens=4)
    return r


def test_handle_drain_takes_what_arrived_wakes_a_waiting_reader_and_reports_failure() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        h = JobHandle(object(), loop)
        h.put(_result([1]))
        h.put(_result([2]))
        assert [r["token_ids"][0].tolist() for r in await h.drain()] == [[1], [2]]
        reader = asyncio.ensure_future(h.drain())
        await asyncio.sleep(0)
        assert not reader.done()  # parked on its waiter
        loop.call_soon(h.put, _result([3], eos=True))
        got = await asyncio.wait_for(reader, 1)
        assert [r["token_ids"][0].tolist() for r in got] == [[3]]
        assert await h.drain() == [] and await h.next() is None  # ended after eos

        cancelled = JobHandle(object(), loop)
        cancelled._close()  # _END: a cancelled job's stream ends without results
        assert cancelled.items[0] is _END and await cancelled.drain() == []

        failed = JobHandle(object(), loop)
        failed.put(_result([4]))
        failed._close(RuntimeError("boom"))
        with pytest.raises(JobFailedError, match="boom"):
            await failed.drain()

    asyncio.run(main())


def test_loop_histogram_exposes_buckets_count_and_sum_like_prometheus() -> None:
    from prometheus_client import CollectorRegistry, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from exlpy.server.metrics import ITL_BUCKETS, LoopHistogram

    mine_reg = CollectorRegistry()
    mine = LoopHistogram("a", "doc", ITL_BUCKETS, mine_reg)
    ref_reg = CollectorRegistry()
    ref = Histogram("a", "doc", buckets=ITL_BUCKETS, registry=ref_reg)
    rng = random.Random(0)
    values = [rng.choice(ITL_BUCKETS) for _ in range(20)] + [rng.uniform(0, 3) for _ in range(200)]
    for v in values:
        n = rng.randint(1, 3)
        mine.observe(v, n)
        for _ in range(n):
            ref.observe(v)

    def samples(reg: CollectorRegistry) -> dict[tuple[str, str], float]:
        text = generate_latest(reg).decode()
        return {(s.name, s.labels.get("le", "")): s.value for f in text_string_to_metric_families(text)
                for s in f.samples if not s.name.endswith("_created")}

    got, want = samples(mine_reg), samples(ref_reg)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k]), k


@pytest.mark.parametrize("chat", [False, True])
def test_text_event_template_writes_the_bytes_of_a_json_dumped_chunk(chat: bool) -> None:
    run = Run(state=None, plan=None, chat=chat, rid="cmpl-1", model_name='m "q"\\')  # type: ignore[arg-type]
    before, after = _text_event(run, 2)
    for text in ["plain", 'quote " back \\ slash', "naïve ☃ \U0001f600", "ctl \x00\x01\n\t", "\u2028"]:
        delta: dict[str, Any] = {"index": 2, "delta": {"content": text}} if chat else {"index": 2, "text": text}
        delta.update({"finish_reason": None, "logprobs": None})
        assert before + json.dumps(text, ensure_ascii=False) + after == _sse(_chunk(run, [delta]))


def test_reader_joins_text_and_ids_lazily_and_drops_the_stop_token() -> None:
    reader = ResultReader(["a"] * 10, None, False)
    assert reader.add(_result([5, 6], "ab")) == ("ab", [])
    reader.add(_result([], ""))
    reader.add(_result([7, 2], "c", eos=True, reason="stop_token"))
    assert reader.text == "abc" and reader.tokens == [5, 6, 7]
    assert reader.finish_reason == "stop" and reader.completion_tokens == 4
