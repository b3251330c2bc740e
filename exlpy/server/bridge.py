"""`GeneratorBridge`: one thread owns the dynamic generator and multiplexes every request's job onto it.

The generator runs in its own thread (`exlpy-generator`), step after step, never waiting for the event loop:
requests post jobs, cancellations and exclusive calls to an inbox the thread takes between two `iterate()`
calls, and the thread hands each step's results back to the event loop in one batch (one
`call_soon_threadsafe` per step, merged with the previous batch while the loop has not run it yet), where they
are routed to the requests' queues. So a busy event loop (many streams to write) delays token delivery but not
the next step, and the loop pays one wake-up per step instead of one per token. Only the owner thread touches
the generator.

Each request reads its results from its handle (`JobHandle.next()`, or `JobHandle.drain()` for everything that
arrived since the last read: a stream that fell behind sends those tokens in one chunk).

Faults stay local where the generator allows it: a job that fails inside `iterate()` comes back as an error
result and only its request sees it. When a whole step raises (e.g. out of memory in a batched decode), the
jobs that were running are cancelled (their pages freed) and failed, queued jobs stay queued, and the loop goes
on serving.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from exlpy.errors import ConfigError, ExlpyError

log = logging.getLogger("exlpy.server")

_END = object()  # queue sentinel: the job was cancelled or the bridge stopped


def _name_os_thread(name: str) -> None:
    """Give the calling thread its name in the OS too (Linux: /proc/PID/task/*/comm, top -H, py-spy), so the
    generator thread's CPU shows apart from the event loop's."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass  # not Linux: the name is cosmetic


class ServerBusyError(ExlpyError, RuntimeError):
    """Admission control refused a request: too many requests are already waiting to start."""


class JobFailedError(ExlpyError, RuntimeError):
    """A job failed while running; `cause` is the exception the generator reported."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"generation failed: {type(cause).__name__}: {cause}")
        self.cause = cause


class JobHandle:
    """One request's view of its job: whether it started, and its results in order.

    Results wait in a plain list and the reader parks on one future while it is empty: routing a result costs
    an append (and, for a reader that waits, one future completion), reading a step's worth of results costs one
    wake-up. An asyncio.Queue per request cost several Python calls per token on both sides."""

    def __init__(self, job: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.job = job
        self.submitted = time.perf_counter()
        self.loop = loop
        self.items: deque[Any] = deque()  # routed, not yet read: result dicts, then _END or an exception
        self._waiter: asyncio.Future[None] | None = None
        self.accepted: asyncio.Future[None] = loop.create_future()
        self.started = False
        self.finished = False  # the bridge will put nothing more on the queue
        self.cancel_requested = False
        self._ended = False  # next() has returned the last item

    def put(self, item: Any) -> None:
        """Append a result (event loop side) and wake the reader if it waits."""
        self.items.append(item)
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    def _take(self) -> dict[str, Any] | None:
        item = self.items.popleft()
        if item is _END:
            self._ended = True
            return None
        if isinstance(item, BaseException):
            self._ended = True
            raise JobFailedError(item)
        if item["eos"]:
            self._ended = True
        return item

    async def next(self) -> dict[str, Any] | None:
        """The next streaming result; None once the job has ended (after its eos result) or was cancelled.
        Raises JobFailedError when the job failed."""
        if self._ended:
            return None
        while not self.items:
            w = self._waiter = self.loop.create_future()
            await w
        return self._take()

    async def drain(self) -> list[dict[str, Any]]:
        """Every result that arrived since the last read (waits for at least one); [] once the job has ended
        or was cancelled. Raises JobFailedError when the job failed (results before the failure are lost: a
        failed job's response is an error)."""
        if self._ended:
            return []
        while not self.items:
            w = self._waiter = self.loop.create_future()
            await w
        out = []
        while self.items and not self._ended:
            item = self._take()
            if item is None:
                break
            out.append(item)
        return out

    def _close(self, item: Any = _END) -> None:
        if not self.finished:
            self.finished = True
            self.put(item)


def _prime_cublas(gen: Any) -> None:
    """Create this thread's cuBLAS handle on each of the model's GPUs now. cuBLAS handles are per thread; the
    warm-up ran on another one, so the first request's matmul would create this thread's handle with a plain
    cudaMalloc, outside torch's allocator, after the cache and the graphs have taken the memory: on a full GPU
    that failed every job (CUBLAS_STATUS_ALLOC_FAILED, H100, 2026-11-26). Now it happens right after the warm-up
    released its cached blocks."""
    model = getattr(gen, "model", None)
    devices = {d for d in (getattr(m, "device", None) for m in getattr(model, "modules", []))
               if isinstance(d, torch.device) and d.type == "cuda"}
    for dev in devices:
        try:
            with torch.cuda.device(dev):
                a = torch.ones(8, 8, device=dev, dtype=torch.float16)
                (a @ a).sum().item()
        except Exception as e:  # noqa: BLE001 - the first request meets the same fault and fails with its error
            log.warning("could not prepare cuBLAS on %s for the generator thread: %s", dev, e)


class GeneratorBridge:
    """Owns an `ExLlamaV2DynamicGenerator`; `submit()` jobs from request handlers, `cancel()` them on disconnect.

    Admission control: `submit()` raises ServerBusyError when `max_queue` requests are already waiting to start
    (accepted but not yet running in the generator's batch, because the batch or the cache is full).
    `observer` (exlpy/server/metrics.py) is told of every step and of each step's routed results in one call.
    """

    def __init__(self, generator: Any, max_queue: int = 64, observer: Any = None) -> None:
        if max_queue < 1:
            raise ConfigError(f"max_queue must be >= 1, got {max_queue}")
        self.generator = generator
        self.max_queue = max_queue
        self.observer = observer
        # Shared with the owner thread, under `_cv`: what the loop posts, and the thread's batch not yet delivered.
        self._cv = threading.Condition()
        self._inbox: list[JobHandle] = []
        self._cancels: list[JobHandle] = []
        self._calls: list[tuple[Callable[[], Any], asyncio.Future[Any]]] = []
        self._outbox: list[tuple[str, Any, Any]] = []
        self._delivery_pending = False
        self._stopping = False
        self._abort: BaseException | None = None  # abort_all(): applied by the owner thread between steps
        # Loop side only.
        self._handles: dict[Any, JobHandle] = {}  # jobs enqueued in the generator, not ended
        self._waiting = 0  # submitted, not yet accepted or refused
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.counters = {"completed": 0, "failed": 0, "cancelled": 0, "rejected": 0, "step_failures": 0,
                         "peak_running": 0}

    # --- lifecycle -----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the owner thread for the running loop (idempotent; a new loop, e.g. a new test client,
        restarts it)."""
        loop = asyncio.get_running_loop()
        if self._thread is not None and self._thread.is_alive() and self._loop is loop:
            return
        self._join_thread()
        self._loop = loop
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="exlpy-generator", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the owner thread and end every request (their streams end without a finish)."""
        await asyncio.to_thread(self._join_thread)
        self.generator.clear_queue()
        with self._cv:
            inbox, self._inbox = self._inbox, []
            calls, self._calls = self._calls, []
            self._cancels.clear()
            self._outbox.clear()
        for _, fut in calls:
            if not fut.done():
                fut.cancel()
        for h in [*inbox, *self._handles.values()]:
            if not h.accepted.done():
                h.accepted.cancel()
            h._close()
        self._handles.clear()

    def _join_thread(self) -> None:
        thread = self._thread
        if thread is None:
            return
        with self._cv:
            self._stopping = True
            self._cv.notify()
        thread.join()
        self._thread = None

    def abort_all(self, cause: BaseException) -> None:
        """End every job, running or waiting, with `cause` (bounded shutdown: their streams get an error event).
        The owner thread applies it between two steps; with no owner thread running it is applied at once."""
        if self._thread is None or not self._thread.is_alive():
            with self._cv:
                inbox, self._inbox = self._inbox, []
            out: list[tuple[str, Any, Any]] = [("refused", h, cause) for h in inbox]
            self._cancel_all(out, cause)
            self._outbox += out
            self._deliver()
            return
        with self._cv:
            self._abort = cause
            self._cv.notify()

    def _cancel_all(self, out: list[tuple[str, Any, Any]], cause: BaseException) -> None:
        """Cancel every job the generator holds (owner thread, or no thread running) and say so to the loop."""
        gen = self.generator
        for job in [*gen.active, *gen.pending]:
            try:
                gen.cancel(job)
            except ExlpyError:
                pass  # it ended during the last step
        out.append(("aborted", cause, None))

    def alive(self) -> bool:
        return self._thread is None or self._thread.is_alive()  # not started yet counts as alive

    # --- requests (event loop) -----------------------------------------------------------------------------
    def num_queued(self) -> int:
        """Requests accepted but not yet running in the batch."""
        return self._waiting + sum(1 for h in self._handles.values() if not h.started)

    def num_running(self) -> int:
        return sum(1 for h in self._handles.values() if h.started)

    async def submit(self, job: Any) -> JobHandle:
        """Hand a job to the owner thread and wait until the generator accepted it. Raises ServerBusyError when
        the queue is full, or the generator's own error (GeneratorError: e.g. prompt too long) at enqueue."""
        queued = self.num_queued()
        if queued >= self.max_queue:
            self.counters["rejected"] += 1
            raise ServerBusyError(self._busy_message(queued))
        self.start()
        assert self._loop is not None
        handle = JobHandle(job, self._loop)
        self._waiting += 1
        with self._cv:
            self._inbox.append(handle)
            self._cv.notify()
        try:
            await handle.accepted
        except asyncio.CancelledError:
            self.cancel(handle)
            raise
        return handle

    async def run_exclusive(self, fn: Any) -> Any:
        """Run `fn()` in the owner thread between two generator steps, so it may use the model (e.g. score a
        prompt with a forward pass) without racing the generator. Returns its result or raises its error."""
        self.start()
        assert self._loop is not None
        fut: asyncio.Future[Any] = self._loop.create_future()
        with self._cv:
            self._calls.append((fn, fut))
            self._cv.notify()
        return await fut

    def cancel(self, handle: JobHandle) -> None:
        """Ask the owner thread to cancel the job (frees its pages); a no-op for a job that already ended."""
        if handle.finished or handle.cancel_requested:
            return
        handle.cancel_requested = True
        with self._cv:
            self._cancels.append(handle)
            self._cv.notify()

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

    # --- owner thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        _name_os_thread("exlpy-generator")
        gen = self.generator
        _prime_cublas(gen)
        while True:
            with self._cv:
                while not (self._stopping or self._inbox or self._cancels or self._calls or self._abort
                           or gen.num_remaining_jobs()):
                    self._cv.wait()
                if self._stopping:
                    return
                abort, self._abort = self._abort, None
                inbox, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, []
                calls, self._calls = self._calls, []
            out: list[tuple[str, Any, Any]] = []
            try:
                if abort is not None:
                    out += [("refused", h, abort) for h in inbox]
                    inbox = []
                    self._cancel_all(out, abort)
                self._apply(inbox, cancels, out)
                for fn, fut in calls:
                    try:
                        out.append(("call", fut, fn()))
                    except Exception as e:  # the caller's error: it gets it, the thread goes on
                        out.append(("call_error", fut, e))
                if gen.num_remaining_jobs():
                    t0 = time.perf_counter()
                    try:
                        results = gen.iterate()
                    except Exception as e:
                        self._fail_running(e, out)
                    else:
                        out.append(("results", results, time.perf_counter() - t0))
            except Exception:  # a bug in the bridge itself: log it and keep serving rather than hang every request
                log.exception("generator bridge: unexpected error")
                time.sleep(0.01)
            if out:
                self._post(out)

    def _apply(self, inbox: list[JobHandle], cancels: list[JobHandle], out: list[tuple[str, Any, Any]]) -> None:
        gen = self.generator
        for h in inbox:
            if h.cancel_requested:
                out.append(("dropped", h, None))
                continue
            try:
                gen.enqueue(h.job)
            except Exception as e:
                out.append(("refused", h, e))
                continue
            out.append(("accepted", h, None))
        for h in cancels:
            if h.job.serial is None or h.job.finished:
                continue  # never enqueued (dropped above) or already ended: the loop side knows
            try:
                gen.cancel(h.job)
            except ExlpyError:
                continue  # it ended during the last step
            out.append(("cancelled", h, None))

    def _fail_running(self, e: Exception, out: list[tuple[str, Any, Any]]) -> None:
        """A whole step raised: the running jobs cannot be trusted to be consistent. Free them and fail their
        requests; queued jobs never ran and stay queued."""
        log.error("generator step failed (%s: %s); failing the %d running jobs", type(e).__name__, e,
                  len(self.generator.active))
        out.append(("step_failed", e, list(self.generator.active)))
        for job in list(self.generator.active):
            try:
                self.generator.cancel(job)
            except ExlpyError:
                pass

    def _post(self, out: list[tuple[str, Any, Any]]) -> None:
        """Hand a step's outcomes to the event loop: one wake-up, or none when the last one is still pending."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with self._cv:
            self._outbox += out
            if self._delivery_pending:
                return
            self._delivery_pending = True
        try:
            loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop closed meanwhile
            pass

    # --- delivery (event loop) -----------------------------------------------------------------------------
    def _deliver(self) -> None:
        with self._cv:
            out, self._outbox = self._outbox, []
            self._delivery_pending = False
        for kind, a, b in out:
            if kind == "results":
                self._route(a)
                if self.observer is not None:
                    self.observer.on_step(b, self)
            elif kind == "accepted":
                self._waiting -= 1
                self._handles[a.job] = a
                if self.observer is not None:
                    self.observer.on_accepted(a)
                if not a.accepted.done():  # else the request went away meanwhile; its cancel follows
                    a.accepted.set_result(None)
            elif kind in ("refused", "dropped"):
                self._waiting -= 1
                a.finished = True
                if not a.accepted.done():
                    if kind == "refused":
                        a.accepted.set_exception(b)
                    else:
                        a.accepted.cancel()
                a._close()
            elif kind == "cancelled":
                if self._handles.pop(a.job, None) is not None:
                    self.counters["cancelled"] += 1
                if self.observer is not None:
                    self.observer.on_closed(a)
                a._close()
            elif kind in ("call", "call_error"):
                if not a.done():
                    a.set_result(b) if kind == "call" else a.set_exception(b)
            elif kind == "aborted":
                for h in self._handles.values():
                    self.counters["failed"] += 1
                    if self.observer is not None:
                        self.observer.on_closed(h)
                    h._close(a)
                self._handles.clear()
            elif kind == "step_failed":
                self.counters["step_failures"] += 1
                for job in b:
                    h = self._handles.pop(job, None)
                    if h is not None:
                        self.counters["failed"] += 1
                        if self.observer is not None:
                            self.observer.on_closed(h)
                        h._close(a)
        running = self.num_running()
        if running > self.counters["peak_running"]:
            self.counters["peak_running"] = running

    def _route(self, results: list[dict[str, Any]]) -> None:
        handles = self._handles
        routed: list[tuple[JobHandle, dict[str, Any]]] = []
        for r in results:
            h = handles.get(r["job"])
            if h is None:
                continue
            stage = r["stage"]
            if stage == "started":
                h.started = True
            elif stage == "streaming":
                h.started = True
                routed.append((h, r))
                if "error" in r:
                    log.warning("job %s failed: %s", r.get("serial"), r.get("error_message"))
                    handles.pop(r["job"], None)
                    self.counters["failed"] += 1
                    h._close(r["error"])
                    continue
                h.put(r)
                if r["eos"]:
                    handles.pop(r["job"], None)
                    self.counters["completed"] += 1
                    h.finished = True
        if routed and self.observer is not None:
            self.observer.on_results(routed)  # one call per step: metrics cost per step, not per token
