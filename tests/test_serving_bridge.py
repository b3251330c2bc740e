"""The bridge's generator thread (exlpy/server/bridge.py): it keeps stepping while the event loop is busy, and a
request that fell behind reads everything that arrived at once."""

from __future__ import annotations

import asyncio
import time

import torch

from exlpy.generator import ExLlamaV2DynamicJob, ExLlamaV2Sampler
from exlpy.server import GeneratorBridge
from tests.test_server_helpers import make_generator, single_torch_thread  # noqa: F401


def test_generator_steps_on_while_the_loop_is_blocked_and_the_stream_catches_up_at_once() -> None:
    gen = make_generator()
    bridge = GeneratorBridge(gen)
    job = ExLlamaV2DynamicJob(torch.tensor([[1, 5, 9]]), 40, stop_conditions=[],
                              gen_settings=ExLlamaV2Sampler.Settings.greedy())

    async def main() -> tuple[int, int, list[int]]:
        handle = await bridge.submit(job)
        first = await handle.drain()
        before = gen.decode_tokens
        time.sleep(0.5)  # the event loop is busy (e.g. writing many streams): the generator must not wait for it
        during = gen.decode_tokens - before
        batch = await handle.drain()  # everything produced meanwhile, in one read
        tokens = [t for r in first + batch for t in r["token_ids"][0].tolist()]
        while not batch[-1]["eos"]:
            batch = await handle.drain()
            tokens += [t for r in batch for t in r["token_ids"][0].tolist()]
        assert await handle.drain() == []  # ended
        await bridge.stop()
        return during, len(batch), tokens

    during, _, tokens = asyncio.run(main())
    assert during >= 5 and len(tokens) == 40
    assert bridge.counters["completed"] == 1 and gen.num_remaining_jobs() == 0


def test_one_wakeup_per_step_however_many_jobs() -> None:
    gen = make_generator()
    bridge = GeneratorBridge(gen)
    calls = {"n": 0}

    async def main() -> int:
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def counting(cb, *args, **kw):  # type: ignore[no-untyped-def]
            if getattr(cb, "__name__", "") == "_deliver":
                calls["n"] += 1
            return real(cb, *args, **kw)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        jobs = [ExLlamaV2DynamicJob(torch.tensor([[1, 5 + k, 9]]), 12, stop_conditions=[],
                                    gen_settings=ExLlamaV2Sampler.Settings.greedy()) for k in range(8)]
        handles = await asyncio.gather(*[bridge.submit(j) for j in jobs])

        async def read(h):  # type: ignore[no-untyped-def]
            n = 0
            while items := await h.drain():
                n += sum(r["token_ids"].shape[-1] for r in items)
            return n

        counts = await asyncio.gather(*[read(h) for h in handles])
        await bridge.stop()
        assert counts == [12] * 8
        return gen.decode_tokens

    rows = asyncio.run(main())
    # 8 jobs x 12 tokens in one batch: ~13 steps, so about as many deliveries, not one per token (96)
    assert calls["n"] <= 30 < rows
