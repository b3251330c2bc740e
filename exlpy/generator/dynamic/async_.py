"""asyncio wrappers: a background task drives `iterate()` and routes each result to its job's queue.

    gen = ExLlamaV2DynamicGeneratorAsync(model, cache, tokenizer)
    job = ExLlamaV2DynamicJobAsync(gen, input_ids=ids, max_new_tokens=50)
    async for result in job:
        print(result.get("text", ""), end="")

`iterate()` runs in a worker thread so the event loop stays responsive while the model computes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from exlpy.generator.dynamic.generator import ExLlamaV2DynamicGenerator
from exlpy.generator.dynamic.job import ExLlamaV2DynamicJob


class ExLlamaV2DynamicGeneratorAsync:
    def __init__(self, model: Any, cache: Any, tokenizer: Any, **kwargs: Any) -> None:
        self.generator = ExLlamaV2DynamicGenerator(model, cache, tokenizer, **kwargs)
        self.jobs: dict[ExLlamaV2DynamicJob, ExLlamaV2DynamicJobAsync] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    def _ensure_task(self) -> None:
        # Created lazily: the constructor may run before an event loop exists.
        if self._wake is None:
            self._wake = asyncio.Event()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            if not self.jobs:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                results = await asyncio.to_thread(self.generator.iterate)
            except Exception as e:  # the whole step failed: every waiting job gets the error
                for ajob in list(self.jobs.values()):
                    ajob.queue.put_nowait(e)
                self.jobs.clear()
                continue
            for r in results:
                ajob = self.jobs.get(r["job"])
                if ajob is None:
                    continue
                # A job that failed ends alone in exlpy's iterate(); exllamav2's async job raises the error from
                # its iteration instead of yielding a result, and callers (TabbyAPI) rely on that.
                ajob.queue.put_nowait(r["error"] if isinstance(r.get("error"), Exception) else r)
                if r["eos"]:
                    del self.jobs[r["job"]]
            await asyncio.sleep(0)

    def enqueue(self, ajob: ExLlamaV2DynamicJobAsync) -> None:
        self._ensure_task()
        self.generator.enqueue(ajob.job)
        self.jobs[ajob.job] = ajob
        assert self._wake is not None
        self._wake.set()

    async def cancel(self, ajob: ExLlamaV2DynamicJobAsync) -> None:
        if ajob.job in self.jobs:
            self.generator.cancel(ajob.job)
            del self.jobs[ajob.job]
        ajob.queue.put_nowait(None)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for ajob in list(self.jobs.values()):
            self.generator.cancel(ajob.job)
            ajob.queue.put_nowait(None)
        self.jobs.clear()


class ExLlamaV2DynamicJobAsync:
    """Creates an `ExLlamaV2DynamicJob` from the same arguments and enqueues it at once (needs a running loop)."""

    def __init__(self, generator: ExLlamaV2DynamicGeneratorAsync, *args: Any, **kwargs: Any) -> None:
        self.generator = generator
        self.job = ExLlamaV2DynamicJob(*args, **kwargs)
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        generator.enqueue(self)

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        while True:
            r = await self.queue.get()
            if r is None:  # cancelled
                return
            if isinstance(r, Exception):
                raise r
            yield r
            if r["eos"]:
                return

    async def cancel(self) -> None:
        await self.generator.cancel(self)
