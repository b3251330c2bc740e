"""exllamav2's `util` module: timing, a growable sequence tensor, GPU memory queries and debugging helpers that
example scripts import. GPU-only helpers do nothing (or report nothing) on a machine without CUDA."""

from __future__ import annotations

import gc
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from exlpy.errors import DeviceError
from exlpy.parallel.tp_split import integer_split

__all__ = [
    "SeqTensor", "Timer", "cuda_sync_active", "diff_snapshot", "get_all_gpu_memory", "get_amd_gpu_memory",
    "get_basic_progress", "get_nvidia_gpu_memory", "get_visible_devices", "integer_split", "list_live_tensors",
    "num_run_avg", "pack_4bit", "print_vram_usage", "print_vram_usage_peak", "set_snapshot", "timed", "timings",
    "unpack_4bit",
]

F = TypeVar("F", bound=Callable[..., Any])
MIB = 1024**2


class Timer:
    """`with Timer() as t: ...` then `t.interval` seconds (also `start_time`, `end_time`)."""

    def __enter__(self) -> Timer:
        self.start_time = time.time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.end_time = time.time()
        self.interval = self.end_time - self.start_time


timings: dict[str, deque[float]] = {}
num_run_avg = 10


def timed(func: F) -> F:
    """Decorator printing each call's time and the running average of the last `num_run_avg` calls."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.time()
        result = func(*args, **kwargs)
        elapsed = time.time() - start
        runs = timings.setdefault(func.__name__, deque())
        if len(runs) >= num_run_avg:
            runs.popleft()
        runs.append(elapsed)
        print(f"{func.__name__} executed in {elapsed:.4f} seconds, running avg. ({num_run_avg}): "
              f"{sum(runs) / len(runs):.4f}")
        return result

    return wrapper  # type: ignore[return-value]


class SeqTensor:
    """A tensor that grows along one dimension (`seq_dim`) without reallocating on every append: capacity
    grows in whole pages of PAGE_SIZE positions. `torch()` is a view of the filled part."""

    PAGE_SIZE = 256

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, seq_dim: int,
                 device: torch.device | str = "cpu", init_cap: int = -1) -> None:
        self.seq_dim = seq_dim if seq_dim >= 0 else len(shape) + seq_dim
        self.seq_len = 0
        self.seq_cap = self.PAGE_SIZE if init_cap == -1 else (init_cap // self.PAGE_SIZE + 1) * self.PAGE_SIZE
        full = list(shape)
        full[self.seq_dim] = self.seq_cap
        self.tensor = torch.empty(full, dtype=dtype, device=device)

    def __len__(self) -> int:
        return self.seq_len

    def __bool__(self) -> bool:
        return self.seq_len > 0

    @staticmethod
    def from_tensor(tensor: torch.Tensor, seq_dim: int) -> SeqTensor:
        s = SeqTensor(tensor.shape, tensor.dtype, seq_dim, tensor.device, init_cap=tensor.shape[seq_dim])
        s.append(tensor)
        return s

    def clone(self, drop: int | None = None) -> SeqTensor:
        """A copy, without the last `drop` positions when given."""
        if drop and drop <= self.seq_len:
            return SeqTensor.from_tensor(self.torch_slice(None, self.seq_len - drop), self.seq_dim)
        return SeqTensor.from_tensor(self.torch(), self.seq_dim)

    def clear(self) -> None:
        self.seq_len = 0

    def set(self, new_data: SeqTensor | torch.Tensor | None = None) -> None:
        self.clear()
        self.append(new_data)

    def append(self, new_data: SeqTensor | torch.Tensor | None) -> None:
        if new_data is None:
            return
        if isinstance(new_data, SeqTensor):
            new_data = new_data.torch()
        end = self.seq_len + new_data.shape[self.seq_dim]
        if end >= self.seq_cap:
            cap = (end // self.PAGE_SIZE + 1) * self.PAGE_SIZE
            grow = list(self.tensor.shape)
            grow[self.seq_dim] = cap - self.seq_cap
            extra = torch.empty(grow, dtype=self.tensor.dtype, device=self.tensor.device)
            self.tensor = torch.cat((self.tensor, extra), dim=self.seq_dim)
            self.seq_cap = cap
        self.tensor.narrow(self.seq_dim, self.seq_len, end - self.seq_len).copy_(new_data)
        self.seq_len = end

    def truncate(self, new_len: int) -> None:
        if not 0 <= new_len <= self.seq_len:
            raise ValueError(f"SeqTensor.truncate: new length {new_len} outside 0..{self.seq_len}")
        self.seq_len = new_len

    def torch(self) -> torch.Tensor:
        return self.tensor.narrow(self.seq_dim, 0, self.seq_len)

    def slice(self, a: int | None, b: int | None) -> SeqTensor:
        return SeqTensor.from_tensor(self.torch_slice(a, b), self.seq_dim)

    def torch_slice(self, a: int | None, b: int | None) -> torch.Tensor:
        start = 0 if a is None else a
        stop = self.seq_len if b is None else b
        return self.tensor.narrow(self.seq_dim, start, stop - start)


def cuda_sync_active() -> None:
    """Synchronize only the GPUs this process has allocated memory on (synchronizing every device would
    create a CUDA context on each of them)."""
    if not torch.cuda.is_available():
        return
    for i in range(torch.cuda.device_count()):
        if torch.cuda.memory_allocated(i) > 0:
            torch.cuda.synchronize(i)


def get_basic_progress() -> Progress:
    """The console progress bar exllamav2 scripts use (`with get_basic_progress() as p: p.add_task(...)`)."""
    return Progress(TextColumn("[progress.description]{task.description}"), BarColumn(bar_width=None),
                    "[progress.percentage]{task.percentage:>3.0f}%", TimeElapsedColumn(), TimeRemainingColumn())


def _live_tensors() -> dict[str, int]:
    """Count of live tensors per (shape, dtype, device)."""
    counts: dict[str, int] = {}
    for obj in gc.get_objects():
        try:
            t = obj if torch.is_tensor(obj) else getattr(obj, "data", None)
            if not torch.is_tensor(t):
                continue
        except Exception:  # noqa: BLE001, S112 - some objects raise on attribute access; they are not tensors
            continue
        key = f"{tuple(t.shape)}, {t.dtype}, {t.device}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def list_live_tensors() -> dict[str, int]:
    """Print (and return) the live tensors grouped by shape, dtype and device: a memory-leak hunting aid."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    counts = _live_tensors()
    print("-----------")
    for k, v in counts.items():
        print(f"{v} : {k}")
    return counts


snapshot: dict[str, int] = {}


def set_snapshot() -> None:
    """Remember the live tensors, for `diff_snapshot()`."""
    global snapshot
    snapshot = _live_tensors()


def diff_snapshot() -> tuple[dict[str, int], dict[str, int]]:
    """Print (and return) the tensors created and freed since `set_snapshot()`."""
    now = _live_tensors()
    new = {k: n - snapshot.get(k, 0) for k, n in now.items() if n > snapshot.get(k, 0)}
    gone = {k: n - now.get(k, 0) for k, n in snapshot.items() if n > now.get(k, 0)}
    print("-----------\n-- New tensors")
    for k, v in new.items():
        print(f"{v} : {k}")
    print("-----------\n-- Removed tensors")
    for k, v in gone.items():
        print(f"{v} : {k}")
    return new, gone


def print_vram_usage() -> None:
    """Reset cuda:0's peak-memory counter and print it (0 without CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(0)
    print_vram_usage_peak()


def print_vram_usage_peak() -> None:
    peak = torch.cuda.max_memory_allocated(0) if torch.cuda.is_available() else 0
    print(f"Peak memory: {peak / MIB:,.2f} MB")


def get_visible_devices() -> list[int] | None:
    """CUDA_VISIBLE_DEVICES as integer indices (None when unset)."""
    from exlpy.parallel.memory import visible_entries

    entries = visible_entries()
    if entries is None:
        return None
    try:
        return [int(e) for e in entries]
    except ValueError:
        raise DeviceError(f"CUDA_VISIBLE_DEVICES holds a non-integer entry: {entries}") from None


def _as_mib(devs: list[Any]) -> dict[int, dict[str, int]]:
    return {d.ordinal: {"total": d.total // MIB, "used": (d.total - d.free) // MIB, "free": d.free // MIB}
            for d in devs}


def get_nvidia_gpu_memory(visible_devices: list[int] | None = None) -> dict[int, dict[str, int]]:
    """{device: {"total", "used", "free"}} in MiB for the visible NVIDIA GPUs (through NVML, numbered as torch
    numbers them). `visible_devices` is accepted for exllamav2's signature; CUDA_VISIBLE_DEVICES is applied."""
    from exlpy.parallel.memory import SOURCES

    return _as_mib(SOURCES["nvml"]())


def get_amd_gpu_memory() -> dict[int, dict[str, int]]:
    """{device: {"total", "used", "free"}} in MiB for AMD GPUs (rocm-smi)."""
    from exlpy.parallel.memory import SOURCES

    return _as_mib(SOURCES["rocm-smi"]())


def get_all_gpu_memory() -> dict[int, dict[str, int]]:
    """{device: {"total", "used", "free"}} in MiB for every visible GPU; DeviceError when none can be read."""
    from exlpy.parallel.memory import query_devices

    return _as_mib(query_devices())


def unpack_4bit(packed: torch.Tensor) -> torch.Tensor:
    """[m, n/8] int32 of packed nibbles (nibble i of a word = column 8j+i) -> [m, n] uint8."""
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"unpack_4bit expects a 2-D int32 tensor, got {packed.dtype} {tuple(packed.shape)}")
    m, n8 = packed.shape
    out = torch.empty((m, n8 * 8), dtype=torch.uint8, device=packed.device)
    for i in range(8):
        out[:, i::8] = (packed >> (i * 4)) & 0xF
    return out


def pack_4bit(unpacked: torch.Tensor) -> torch.Tensor:
    """[m, n] uint8 values 0..15 -> [m, n/8] int32, the inverse of unpack_4bit."""
    if unpacked.dtype != torch.uint8 or unpacked.dim() != 2 or unpacked.shape[1] % 8:
        raise ValueError(f"pack_4bit expects a 2-D uint8 tensor with a multiple of 8 columns, got "
                         f"{unpacked.dtype} {tuple(unpacked.shape)}")
    m, n = unpacked.shape
    packed = torch.zeros((m, n // 8), dtype=torch.int64, device=unpacked.device)
    for i in range(8):
        packed |= unpacked[:, i::8].to(torch.int64) << (i * 4)
    return packed.to(torch.int32)
