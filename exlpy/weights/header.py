"""Strict parsing of one safetensors header.

Everything `safetensors.safe_open` would later refuse is refused here first, as a WeightsError that names the
file (and the tensor, where there is one), so that no damaged file reaches the library's own untyped
`SafetensorError` or a raw TypeError/RecursionError: the header must be a JSON object of well-formed entries
whose data offsets tile the data area exactly (no gap, no overlap, no trailing byte), as the format requires.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from dataclasses import dataclass
from typing import Any

import torch

from exlpy.errors import WeightsError

DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8),
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

# The format caps the header at 100 MB; a larger length is garbage, and reading it would be a huge allocation.
MAX_HEADER = 100 * 1024 * 1024


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
        return DTYPES[self.dtype][0]


def check_regular_file(path: str) -> int:
    """Size of `path`, which must be a regular file (or a link to one). Opening a FIFO would block forever and
    a directory cannot be read, so both are refused before any open()."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise WeightsError(f"cannot read safetensors file: {e.strerror or e}", file=path) from e
    if not stat.S_ISREG(st.st_mode):
        raise WeightsError("is not a regular file (a directory, FIFO or device named *.safetensors)", file=path)
    return st.st_size


def _read_raw(path: str) -> tuple[bytes, int, int]:
    """(header bytes, header length, file size)."""
    size = check_regular_file(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise WeightsError(f"truncated safetensors file (no header length, file size {size})", file=path)
            (hlen,) = struct.unpack("<Q", raw)
            if hlen > MAX_HEADER or 8 + hlen > size:
                shown = struct.unpack("<q", raw)[0] if hlen >= 2**63 else hlen
                raise WeightsError(f"corrupt safetensors header (header length {shown}, file size {size}, "
                                   f"limit {MAX_HEADER})", file=path)
            header_bytes = f.read(hlen)
    except OSError as e:
        raise WeightsError(f"cannot read safetensors file: {e}", file=path) from e
    if len(header_bytes) != hlen:
        raise WeightsError(f"truncated safetensors header ({len(header_bytes)} of {hlen} bytes)", file=path)
    return header_bytes, hlen, size


def _decode(header_bytes: bytes, path: str) -> dict[str, Any]:
    try:
        header = json.loads(header_bytes)
    except RecursionError:
        # Python's JSON decoder recurses once per nesting level; a deep header is garbage, not a model.
        raise WeightsError("corrupt safetensors header (JSON nested too deeply)", file=path) from None
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError, and ints past Python's digit limit
        raise WeightsError(f"corrupt safetensors header (not JSON: {e})", file=path) from e
    if not isinstance(header, dict):
        raise WeightsError(f"corrupt safetensors header (a JSON {type(header).__name__}, not an object)",
                           file=path)
    return header


def _check_metadata(meta: Any, path: str) -> None:
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise WeightsError("corrupt safetensors header (__metadata__ must map strings to strings, got "
                           f"{json.dumps(meta)[:80]})", file=path)


def _index(value: Any) -> bool:
    """A JSON non-negative integer (not a bool, not a float such as 2.0: the format's fields are usize)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry(name: str, meta: Any, path: str, data_start: int) -> TensorInfo:
    def bad(what: str) -> WeightsError:
        return WeightsError(f"corrupt header entry: {what}", tensor=name, file=path)

    if not isinstance(meta, dict):
        raise bad(f"expected an object, got {json.dumps(meta)[:80]}")
    missing = {"dtype", "shape", "data_offsets"} - set(meta)
    if missing:
        raise bad(f"missing {sorted(missing)}")
    dtype, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
    if not isinstance(dtype, str):
        raise bad(f"dtype must be a string, got {json.dumps(dtype)[:80]}")
    if dtype not in DTYPES:
        raise WeightsError(f"unsupported dtype {dtype[:40]!r} (supported: {', '.join(DTYPES)})", tensor=name,
                           file=path)
    if not isinstance(shape, list) or not all(_index(s) for s in shape):
        raise bad(f"shape must be a list of non-negative integers, got {json.dumps(shape)[:80]}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_index(o) for o in offsets):
        raise bad(f"data_offsets must be two non-negative integers, got {json.dumps(offsets)[:80]}")
    b, e = offsets
    numel = 1
    for s in shape:
        numel *= s
    if e < b or e - b != numel * DTYPES[dtype][1]:
        raise WeightsError(f"size mismatch: shape {shape} of {dtype} needs {numel * DTYPES[dtype][1]} bytes, "
                           f"data_offsets [{b}, {e}) hold {e - b}; the file is corrupt", tensor=name, file=path)
    return TensorInfo(name, path, dtype, tuple(shape), data_start + b, data_start + e)


def read_header(path: str) -> dict[str, TensorInfo]:
    """Parse and check one safetensors header; raise WeightsError naming the file on any inconsistency."""
    header_bytes, hlen, size = _read_raw(path)
    header = _decode(header_bytes, path)
    if "__metadata__" in header:
        _check_metadata(header.pop("__metadata__"), path)
    data_start = 8 + hlen
    infos = [_entry(name, meta, path, data_start) for name, meta in header.items()]
    # The data area must be tiled exactly: each tensor starts where the previous one ended, and the last one
    # ends at the end of the file (safetensors refuses gaps, overlaps and trailing bytes alike).
    pos = data_start
    for t in sorted(infos, key=lambda t: (t.begin, t.end)):
        if t.begin != pos:
            what = "overlaps the tensor before it" if t.begin < pos else f"leaves a gap of {t.begin - pos} bytes"
            raise WeightsError(f"data_offsets [{t.begin - data_start}, {t.end - data_start}) {what}; the file "
                               "is corrupt", tensor=t.name, file=path)
        pos = t.end
    if pos != size:
        if pos > size:
            raise WeightsError(f"tensor data runs past the end of the file ({pos} > {size} bytes); the file is "
                               "truncated or corrupt", file=path)
        raise WeightsError(f"{size - pos} trailing bytes after the last tensor's data (file size {size}); the "
                           "file is corrupt", file=path)
    return {t.name: t for t in infos}
