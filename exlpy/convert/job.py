"""The job: settings, stage and progress in WORK/job.json, plus its checkpoint files, all written atomically.

A checkpoint first writes its tensors under a new name, then job.json (replaced in one rename), then removes
what the previous checkpoint pointed at; so whenever the process dies, job.json names files that exist and the
job resumes from the last finished layer with exactly the state it had.

The pipeline's per-layer files (hidden-state checkpoints, quantized tensors) are written by one background
thread, in order, while the device works on the next layer: the tensors are copied to pinned host memory on the
device's stream (no wait), the thread writes them once the copy is done, and the checkpoint that needs them is
recorded in job.json only after every write before it has finished (`poll` between modules, `flush` at the end
of a stage). A write error is raised in the main thread, typed as before.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from exlpy.errors import ConvertIOError, JobConflictError

JOB_FILE = "job.json"
_UMASK = os.umask(0)
os.umask(_UMASK)
FORMAT = "exlpy-convert-job"
VERSION = 1
# Entries a job writes in its work dir; -nr removes these and nothing else.
OWNED = (JOB_FILE, "cal_measure.safetensors", "cal_quant.safetensors", "out_tensor", "states", "measurement.json")


def _errno_of(e: BaseException) -> int | None:
    """The OS error number of an OSError, or of safetensors' SafetensorError, which only carries it in its text
    ("... (os error 28)" or "Os { code: 28, ... }")."""
    if isinstance(e, OSError):
        return e.errno
    m = re.search(r"os error (\d+)|code: (\d+)", str(e))
    return int(m.group(1) or m.group(2)) if m else None


def _io_error(path: str, e: BaseException, what: str = "cannot write") -> ConvertIOError:
    code = _errno_of(e)
    if code in (errno.ENOSPC, errno.EDQUOT):
        why = "the disk is full"
    elif code in (errno.EROFS, errno.EACCES, errno.EPERM):
        why = f"the folder is not writable ({os.strerror(code)})"
    elif code is not None:
        why = os.strerror(code)
    else:
        why = str(e)
    return ConvertIOError(f"{what} {path}: {why}. Free space or fix permissions, then run the same "
                          "command again: the job resumes from its last checkpoint")


@contextlib.contextmanager
def writing(path: str) -> Iterator[None]:
    """File-system errors inside the block (those not already typed where they happen) become a ConvertIOError
    naming the file (or `path`)."""
    try:
        yield
    except ConvertIOError:
        raise
    except (OSError, SafetensorError) as e:
        raise _io_error(getattr(e, "filename", None) or path, e, "file system error at") from e


def atomic_write(path: str, write: Callable[[str], None]) -> None:
    tmp = path + ".tmp"
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)  # safetensors creates files owner-only; outputs are ordinary files
        os.replace(tmp, path)
    except (OSError, SafetensorError) as e:
        try:
            if os.path.exists(tmp):
                os.remove(tmp)
        except OSError:
            pass
        raise _io_error(path, e) from e


def write_json(path: str, data: Any) -> None:
    def w(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)

    atomic_write(path, w)


def write_tensors(path: str, tensors: dict[str, torch.Tensor]) -> None:
    atomic_write(path, lambda tmp: save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, tmp))


def _to_host(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.cuda.Event | None]:
    """Host copies of `tensors` queued on the current stream (pinned memory, no wait), and an event that is done
    when they are complete; host tensors are taken as they are (the pipeline never writes into them)."""
    out: dict[str, torch.Tensor] = {}
    event = None
    for k, v in tensors.items():
        if v.is_cuda:
            host = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
            host.copy_(v, non_blocking=True)
            out[k] = host
            if event is None:
                event = torch.cuda.Event()
        else:
            out[k] = v.contiguous()
    if event is not None:
        event.record()
    return out, event


def _write_when_ready(path: str, tensors: dict[str, torch.Tensor], event: torch.cuda.Event | None) -> None:
    if event is not None:
        event.synchronize()
    write_tensors(path, tensors)


class Job:
    """State of one conversion, persisted in `work_dir`."""

    def __init__(self, work_dir: str, data: dict[str, Any]) -> None:
        self.work_dir = work_dir
        self.data = data
        self._writer: ThreadPoolExecutor | None = None
        self._writes: list[Future[None]] = []
        self._pending: tuple[str, int, str] | None = None  # a checkpoint waiting for its writes

    @staticmethod
    def open(work_dir: str, settings: dict[str, Any], no_resume: bool, keep: str | None = None
             ) -> tuple[Job, bool]:
        """(job, resumed). Refuses a work dir that holds another job or foreign files. -nr removes the job's own
        files only, never `keep` (a measurement given with -m that lives in the same dir)."""
        path = os.path.join(work_dir, JOB_FILE)
        try:
            os.makedirs(work_dir, exist_ok=True)
        except OSError as e:
            raise _io_error(work_dir, e) from e
        if no_resume:
            for name in OWNED:
                p = os.path.join(work_dir, name)
                if keep is not None and os.path.abspath(p) == os.path.abspath(keep):
                    continue
                try:
                    shutil.rmtree(p) if os.path.isdir(p) else os.remove(p) if os.path.exists(p) else None
                except OSError as e:
                    raise _io_error(p, e) from e
        if os.path.exists(path):
            try:
                with open(path, encoding="utf-8") as f:
                    data = json.load(f)
            except (OSError, json.JSONDecodeError) as e:
                raise JobConflictError(f"{path} is unreadable ({e}); run with -nr to start the job over") from e
            if data.get("format") != FORMAT:
                raise JobConflictError(f"{path} is not an exlpy conversion job; use another -o or -nr")
            old = data.get("settings", {})
            diff = [f"{k}: {old.get(k)!r} -> {v!r}" for k, v in settings.items() if old.get(k) != v]
            if diff:
                raise JobConflictError(f"{work_dir} holds a different job ({'; '.join(diff)}); run with -nr to "
                                       "discard it and start over, or use another -o")
            return Job(work_dir, data), True
        foreign = [n for n in os.listdir(work_dir) if n not in OWNED and not n.startswith("output")]
        if foreign:
            raise JobConflictError(f"work dir {work_dir} is not empty and holds no exlpy job ({', '.join(foreign[:3])}"
                                   f"{', ...' if len(foreign) > 3 else ''}); give an empty or new directory")
        job = Job(work_dir, {"format": FORMAT, "version": VERSION, "settings": settings, "stage": "begin",
                             "times": {}})
        job.save()
        return job, False

    def path(self, *parts: str) -> str:
        return os.path.join(self.work_dir, *parts)

    def save(self) -> None:
        write_json(self.path(JOB_FILE), self.data)

    @property
    def stage(self) -> str:
        return self.data["stage"]

    def set_stage(self, stage: str) -> None:
        self.data["stage"] = stage
        self.save()

    def add_time(self, stage: str, seconds: float) -> None:
        t = self.data.setdefault("times", {})
        t[stage] = t.get(stage, 0.0) + seconds

    def save_states(self, stage: str, idx: int, tensors: dict[str, torch.Tensor]) -> str:
        os.makedirs(self.path("states"), exist_ok=True)
        name = f"{stage}_{idx:04d}.safetensors"
        write_tensors(self.path("states", name), tensors)
        return name

    def load_states(self, name: str) -> dict[str, torch.Tensor]:
        return load_file(self.path("states", name))

    def drop_states(self, name: str | None) -> None:
        if name and os.path.exists(self.path("states", name)):
            os.remove(self.path("states", name))

    def write_async(self, path: str, tensors: dict[str, torch.Tensor]) -> None:
        """Write `tensors` to `path` in the background (after the writes submitted before it)."""
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="exlpy-convert-writer")
        host, event = _to_host(tensors)
        self._writes.append(self._writer.submit(_write_when_ready, path, host, event))

    def checkpoint_async(self, stage: str, idx: int, tensors: dict[str, torch.Tensor]) -> None:
        """`save_states` + `checkpoint`, the file written in the background; the checkpoint is recorded once it
        and every earlier write are on disk. One checkpoint in flight at a time (bounds host memory)."""
        self.flush()
        os.makedirs(self.path("states"), exist_ok=True)
        name = f"{stage}_{idx:04d}.safetensors"
        self.write_async(self.path("states", name), tensors)
        self._pending = (stage, idx, name)

    def poll(self) -> None:
        """Record a pending checkpoint whose writes have finished, without waiting."""
        if self._pending is not None and all(f.done() for f in self._writes):
            self.flush()

    def flush(self) -> None:
        """Wait for every background write, raise the first error, then record the pending checkpoint."""
        writes, self._writes = self._writes, []
        wait(writes)
        pending, self._pending = self._pending, None
        for f in writes:
            f.result()
        if pending is not None:
            self.checkpoint(*pending)

    def close(self) -> None:
        """Wait for the writes (errors ignored: the caller is already failing) and stop the writer thread."""
        wait(self._writes)
        self._writes, self._pending = [], None
        if self._writer is not None:
            self._writer.shutdown()
            self._writer = None

    def checkpoint(self, stage: str, idx: int, states_name: str) -> None:
        """Record that module `idx` of `stage` is done and its outputs are in `states_name`."""
        sd = self.data[stage]
        old = sd.get("states")
        sd["next"] = idx + 1
        sd["states"] = states_name
        self.save()
        if old != states_name:
            self.drop_states(old)
