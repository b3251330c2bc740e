"""Index of every tensor in a model directory, built from safetensors headers alone.

Headers are parsed by hand so that a truncated or corrupt file yields an error naming the file, and so the
planner can size a model without touching tensor data. Tensor data is read lazily through memory-mapped
`safe_open` handles: only the tensors a module asks for are paged in.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from glob import glob
from typing import Any

import torch

from exlpy.errors import WeightsError

_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
}

# A header larger than this is not a safetensors header but garbage (the format caps it at 100 MB).
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype][0]


def read_header(path: str) -> dict[str, TensorInfo]:
    """Parse one safetensors header; raise WeightsError naming the file on any inconsistency."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise WeightsError("truncated safetensors file (no header length)", file=path)
            (hlen,) = struct.unpack("<Q", raw)
            if hlen > _MAX_HEADER or 8 + hlen > size:
                raise WeightsError(f"corrupt safetensors header (header length {hlen}, file size {size})",
                                   file=path)
            header_bytes = f.read(hlen)
    except OSError as e:
        raise WeightsError(f"cannot read safetensors file: {e}", file=path) from e
    try:
        header: dict[str, Any] = json.loads(header_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightsError(f"corrupt safetensors header (not JSON: {e})", file=path) from e
    if not isinstance(header, dict):
        raise WeightsError("corrupt safetensors header (not a JSON object)", file=path)
    header.pop("__metadata__", None)
    data_start = 8 + hlen
    out: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        try:
            dtype = meta["dtype"]
            shape = tuple(int(s) for s in meta["shape"])
            b, e = (int(x) for x in meta["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise WeightsError(f"corrupt header entry ({exc!r})", tensor=name, file=path) from exc
        if dtype not in _DTYPES:
            raise WeightsError(f"unsupported dtype {dtype}", tensor=name, file=path)
        numel = 1
        for s in shape:
            numel *= s
        if e - b != numel * _DTYPES[dtype][1] or b < 0 or data_start + e > size:
            raise WeightsError(
                f"tensor data out of bounds or size mismatch (shape {list(shape)}, {dtype}, "
                f"offsets [{b}, {e}), file size {size}); the file is truncated or corrupt",
                tensor=name, file=path)
        out[name] = TensorInfo(name, path, dtype, shape, data_start + b, data_start + e)
    return out


class SafetensorsIndex:
    """All tensors of a directory (`*.safetensors`, any sharding, index.json ignored)."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        # Shards are found by globbing: converters leave stale model.safetensors.index.json files behind.
        self.files = sorted(glob(os.path.join(model_dir, "*.safetensors")))
        if not self.files:
            raise WeightsError(f"No .safetensors files found in {model_dir}", file=model_dir)
        self.tensors: dict[str, TensorInfo] = {}
        for path in self.files:
            for name, info in read_header(path).items():
                if name in self.tensors:
                    raise WeightsError(f"tensor appears in two files (also in {self.tensors[name].file})",
                                       tensor=name, file=path)
                self.tensors[name] = info
        self._handles: dict[str, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise WeightsError(f"tensor not found in {self.model_dir}", tensor=name) from None

    def nbytes(self, name: str) -> int:
        return self.info(name).nbytes

    def prefix_bytes(self, prefix: str) -> int:
        return sum(t.nbytes for n, t in self.tensors.items() if n.startswith(prefix))

    def names_with_prefix(self, prefix: str) -> list[str]:
        return [n for n in self.tensors if n.startswith(prefix)]

    def get(self, name: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
            shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Read one tensor (memory-mapped), optionally checking its shape, then cast and move it."""
        info = self.info(name)
        if shape is not None and tuple(shape) != info.shape:
            raise WeightsError(f"wrong shape {list(info.shape)}, expected {list(shape)}", tensor=name,
                               file=info.file)
        handle = self._handles.get(info.file)
        if handle is None:
            from safetensors import safe_open

            handle = safe_open(info.file, framework="pt", device="cpu")
            self._handles[info.file] = handle
        t = handle.get_tensor(name)
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        return t.to(device) if str(device) != "cpu" else t

    def close(self) -> None:
        self._handles.clear()
