"""`GeneratorBridge`: one asyncio task owns the dynamic generator and multiplexes every request's job.

Only the owner task touches the generator. Requests do not call `enqueue()`/`cancel()` themselves: they post to
an inbox and a cancel list that the owner applies between `iterate()` steps, so the event loop never blocks on
the generator's lock while a step runs in the worker thread, and the generator is never used from two threads.
Each request reads its results from its own `asyncio.Queue` (through `JobHandle.next()`).

Faults stay local where the generator allows it: a job that fails inside `iterate()` comes back as an error
result and only its request sees it. When a whole step raises (e.g. out of memory in a batched decode), the
jobs that were running are cancelled (their pages freed) and failed, queued jobs stay queued, and the loop goes
on serving.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from exlpy.errors import ConfigError, ExlpyError

log = logging.getLogger("exlpy.server")

_END = object()  # queue sentinel: the job was cancelled or the bridge stopped


class ServerBusyError(ExlpyError, RuntimeError):
    """Admission control refused a request: too many requests are already waiting to start."""


class JobFailedError(ExlpyError, RuntimeError):
    """A job failed while running; `cause` is the exception the generator reported."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"generation failed: {type(cause).__name__}: {cause}")
        self.cause = cause


class JobHandle:
    """One request's view of its job: whether it started, and its results in order."""

    def __init__(self, job: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.job = job
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.accepted: asyncio.Future[None] = loop.create_future()
        self.started = False
        self.finished = False  # the bridge will put nothing more on the queue
        self.cancel_requested = False
        self._ended = False  # next() has returned the last item

    async def next(self) -> dict[str, Any] | None:
        """The next streaming result; None once the job has ended (after its eos result) or was cancelled.
        Raises JobFailedError when the job failed."""
        if self._ended:
            return None
        item = await self.queue.get()
        if item is _END:
            self._ended = True
            return None
        if isinstance(item, BaseException):
            self._ended = True
            raise JobFailedError(item)
        if item["eos"]:
            self._ended = True
        return item

    def _close(self, item: Any = _END) -> None:
        if not self.finished:
            self.finished = True
            self.queue.put_nowait(item)


class GeneratorBridge:
    """Owns an `ExLlamaV2DynamicGenerator`; `submit()` jobs from request handlers, `cancel()` them on disconnect.

    Admission control: `submit()` raises ServerBusyError when `max_queue` requests are already waiting to start
    (accepted but not yet running in the generator's batch, because the batch or the cache is full).
    """

    def __init__(self, generator: Any, max_queue: int = 64) -> None:
        if max_queue < 1:
            raise ConfigError(f"max_queue must be >= 1, got {max_queue}")
        self.generator = generator
        self.max_queue = max_queue
        self._inbox: list[JobHandle] = []
        self._cancels: list[JobHandle] = []
        self._calls: list[tuple[Any, asyncio.Future[Any]]] = []  # run_exclusive() work, between steps
        self._handles: dict[Any, JobHandle] = {}  # jobs enqueued in the generator
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._abort: BaseException | None = None  # abort_all(): applied by the owner task between steps
        self.counters = {"completed": 0, "failed": 0, "cancelled": 0, "rejected": 0, "step_failures": 0,
                         "peak_running": 0}

    # --- lifecycle -----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the owner task on the running loop (idempotent; a new loop, e.g. a new test client, restarts it)."""
        loop = asyncio.get_running_loop()
        if self._task is not None and not self._task.done() and self._loop is loop:
            return
        self._loop = loop
        self._wake = asyncio.Event()
        self._task = loop.create_task(self._run(), name="exlpy-generator-bridge")

    async def stop(self) -> None:
        """Stop the owner task and end every request (their streams end without a finish)."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        # A step may still be finishing in the worker thread: clear_queue() waits for it on the generator lock.
        await asyncio.to_thread(self.generator.clear_queue)
        for _, fut in self._calls:
            if not fut.done():
                fut.cancel()
        self._calls.clear()
        for h in [*self._inbox, *self._handles.values()]:
            if not h.accepted.done():
                h.accepted.cancel()
            h._close()
        self._inbox.clear()
        self._handles.clear()
        self._cancels.clear()

    def abort_all(self, cause: BaseException) -> None:
        """End every job, running or waiting, with `cause` (bounded shutdown: their streams get an error event).
        The owner task applies it between two steps; with no owner task running it is applied at once."""
        self._abort = cause
        if self._task is None or self._task.done():
            self._apply_abort()
        elif self._wake is not None:
            self._wake.set()

    def _apply_abort(self) -> None:
        cause, self._abort = self._abort, None
        if cause is None:
            return
        inbox, self._inbox = self._inbox, []
        for h in inbox:
            h.finished = True
            if not h.accepted.done():
                h.accepted.set_exception(cause)
        for job, h in list(self._handles.items()):
            if not job.finished:
                try:
                    self.generator.cancel(job)
                except ExlpyError:
                    pass  # it ended during the last step
            self.counters["failed"] += 1
            h._close(cause)
        self._handles.clear()

    def alive(self) -> bool:
        return self._task is None or not self._task.done()  # not started yet counts as alive

    # --- requests ------------------------------------------------------------------------------------------
    def num_queued(self) -> int:
        """Requests accepted but not yet running in the batch."""
        return len(self._inbox) + sum(1 for h in self._handles.values() if not h.started)

    def num_running(self) -> int:
        return sum(1 for h in self._handles.values() if h.started)

    async def submit(self, job: Any) -> JobHandle:
        """Hand a job to the owner task and wait until the generator accepted it. Raises ServerBusyError when
        the queue is full, or the generator's own error (GeneratorError: e.g. prompt too long) at enqueue."""
        queued = self.num_queued()
        if queued >= self.max_queue:
            self.counters["rejected"] += 1
            raise ServerBusyError(self._busy_message(queued))
        self.start()
        assert self._loop is not None and self._wake is not None
        handle = JobHandle(job, self._loop)
        self._inbox.append(handle)
        self._wake.set()
        try:
            await handle.accepted
        except asyncio.CancelledError:
            self.cancel(handle)
            raise
        return handle

    async def run_exclusive(self, fn: Any) -> Any:
        """Run `fn()` in the worker thread between two generator steps, so it may use the model (e.g. score a
        prompt with a forward pass) without racing the generator. Returns its result or raises its error."""
        self.start()
        assert self._loop is not None and self._wake is not None
        fut: asyncio.Future[Any] = self._loop.create_future()
        self._calls.append((fn, fut))
        self._wake.set()
        return await fut

    async def _run_calls(self) -> None:
        calls, self._calls = self._calls, []
        for fn, fut in calls:
            try:
                result = await asyncio.to_thread(fn)
            except Exception as e:  # the caller's error: it gets it, the loop goes on
                if not fut.done():
                    fut.set_exception(e)
                continue
            if not fut.done():
                fut.set_result(result)

    def cancel(self, handle: JobHandle) -> None:
        """Ask the owner task to cancel the job (frees its pages); a no-op for a job that already ended."""
        if handle.finished or handle.cancel_requested:
            return
        handle.cancel_requested = True
        self._cancels.append(handle)
        if self._wake is not None:
            self._wake.set()

    def stats(self) -> dict[str, Any]:
        g = self.generator
        extra = g.status() if hasattr(g, "status") else {}
        return {**extra, "running": self.num_running(), "queued": self.num_queued(), "max_queue": self.max_queue,
                "max_batch_size": g.max_batch_size, "cache_pages": g.num_pages,
                "cache_pages_free": g.page_table.num_unreferenced(), "max_seq_len": g.max_seq_len,
                **self.counters}

    def _busy_message(self, queued: int) -> str:
        reason = next((h.job.wait_reason for h in self._handles.values() if not h.started and h.job.wait_reason),
                      None)
        why = f"; the next one waits because: {reason}" if reason else ""
        return (f"server busy: {queued} request(s) already waiting to start (--max-queue {self.max_queue}), "
                f"{self.num_running()} running{why}. Retry later, or start the server with a larger "
                f"--cache-size / --max-queue.")

    # --- owner task ----------------------------------------------------------------------------------------
    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            try:
                self._apply_commands()
                if self._calls:
                    await self._run_calls()
                if not self.generator.num_remaining_jobs():
                    self._wake.clear()
                    if not self._inbox and not self._cancels and not self._calls:
                        await self._wake.wait()
                    continue
                try:
                    results = await asyncio.to_thread(self.generator.iterate)
                except Exception as e:
                    self._fail_running(e)
                    continue
                self._route(results)
                running = self.num_running()
                if running > self.counters["peak_running"]:
                    self.counters["peak_running"] = running
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in the bridge itself: log it and keep serving rather than hang every request
                log.exception("generator bridge: unexpected error")
                await asyncio.sleep(0.01)

    def _apply_commands(self) -> None:
        self._apply_abort()
        inbox, self._inbox = self._inbox, []
        for h in inbox:
            if h.cancel_requested:
                if not h.accepted.done():
                    h.accepted.cancel()
                h._close()
                continue
            try:
                self.generator.enqueue(h.job)
            except Exception as e:
                h.finished = True
                if not h.accepted.done():
                    h.accepted.set_exception(e)
                continue
            self._handles[h.job] = h
            if not h.accepted.done():
                h.accepted.set_result(None)
        cancels, self._cancels = self._cancels, []
        for h in cancels:
            if self._handles.pop(h.job, None) is None:
                continue  # still in the inbox (handled above) or already ended
            if not h.job.finished:
                try:
                    self.generator.cancel(h.job)
                except ExlpyError:
                    pass  # it ended during the last step
            self.counters["cancelled"] += 1
            h._close()

    def _route(self, results: list[dict[str, Any]]) -> None:
        for r in results:
            h = self._handles.get(r["job"])
            if h is None:
                continue
            if r["stage"] == "started":
                h.started = True
            elif r["stage"] == "streaming":
                h.started = True
                if "error" in r:
                    log.warning("job %s failed: %s", r.get("serial"), r.get("error_message"))
                    self._handles.pop(r["job"], None)
                    self.counters["failed"] += 1
                    h._close(r["error"])
                    continue
                h.queue.put_nowait(r)
                if r["eos"]:
                    self._handles.pop(r["job"], None)
                    self.counters["completed"] += 1
                    h.finished = True

    def _fail_running(self, e: Exception) -> None:
        """A whole step raised: the running jobs cannot be trusted to be consistent. Free them and fail their
        requests; queued jobs never ran and stay queued."""
        log.error("generator step failed (%s: %s); failing the %d running jobs", type(e).__name__, e,
                  len(self.generator.active))
        self.counters["step_failures"] += 1
        for job in list(self.generator.active):
            try:
                self.generator.cancel(job)
            except ExlpyError:
                pass
            h = self._handles.pop(job, None)
            if h is not None:
                self.counters["failed"] += 1
                h._close(e)
