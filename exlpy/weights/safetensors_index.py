"""Index of every tensor in a model directory, built from safetensors headers alone.

Headers are parsed by hand (exlpy/weights/header.py) so that a truncated or corrupt file yields an error naming
the file, and so the planner can size a model without touching tensor data. Tensor data is read lazily through
memory-mapped `safe_open` handles: only the tensors a module asks for are paged in.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from exlpy.errors import WeightsError
from exlpy.weights.header import TensorInfo, check_regular_file, read_header
from exlpy.weights.views import TensorView

__all__ = ["SafetensorsIndex", "TensorInfo", "read_header", "shard_files"]


def shard_files(model_dir: str) -> list[str]:
    """Every `*.safetensors` file of `model_dir`, sorted. Listed, never globbed: a directory name such as
    `llama[v2]` is not a pattern. Hidden files (macOS `._*` resource forks) are skipped, as a glob would."""
    try:
        names = os.listdir(model_dir)
    except OSError as e:
        raise WeightsError(f"cannot list the model directory: {e.strerror or e}", file=model_dir) from e
    return sorted(os.path.join(model_dir, n) for n in names if n.endswith(".safetensors") and not n.startswith("."))


class SafetensorsIndex:
    """All tensors of a directory (`*.safetensors`, any sharding, index.json ignored).

    Names are canonical: `rename` (an architecture's key remapping, exlpy/config/arch.py) is applied to every
    header name, and `views` (exlpy/weights/views.py) adds names that read a slice of a fused or transposed
    tensor. `info(name).name` is always the name stored in the file."""

    def __init__(self, model_dir: str, rename: Callable[[str], str] | None = None) -> None:
        self.model_dir = model_dir
        # Shards are found by listing: converters leave stale model.safetensors.index.json files behind.
        self.files = shard_files(model_dir)
        if not self.files:
            raise WeightsError(f"No .safetensors files found in {model_dir}", file=model_dir)
        self.tensors: dict[str, TensorInfo] = {}
        for path in self.files:
            for stored, info in read_header(path).items():
                name = rename(stored) if rename is not None else stored
                if name in self.tensors:
                    raise WeightsError(f"tensor appears in two files (also in {self.tensors[name].file})",
                                       tensor=name, file=path)
                self.tensors[name] = info
        self._handles: dict[str, Any] = {}
        self.views: dict[str, TensorView] = {}
        self.stored = dict(self.tensors)  # every tensor as stored (canonical names), views excluded

    def hide(self, name: str) -> None:
        """Drop a stored tensor from the listing (a fused tensor now read through its parts' views)."""
        self.tensors.pop(name, None)

    def add_view(self, name: str, view: TensorView) -> None:
        """List `name`, read as `view` of a stored tensor. The source leaves the listing (`hide`) once all its
        parts are views, so byte counts see each stored byte once."""
        src = self.stored[view.source]
        rows = view.rows_of(src.shape)
        cols = src.shape[0] if view.transpose else (src.shape[1] if len(src.shape) > 1 else 1)
        width = int(src.torch_dtype.itemsize) * (cols if len(src.shape) > 1 else 1)
        shape = (rows, cols) if len(src.shape) > 1 else (rows,)
        if view.transpose_rows:  # the selected rows, transposed: same bytes, [cols, rows]
            shape = (cols, rows)
        # A view's byte range is its share of the source's (for byte accounting; reads go through the source).
        self.tensors[name] = TensorInfo(src.name, src.file, src.dtype, shape, src.begin, src.begin + rows * width)
        self.views[name] = view

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
        view = self.views.get(name)
        t = view.read(self._read(self.stored[view.source])) if view is not None else self._read(info)
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        return t.to(device) if str(device) != "cpu" else t

    def _read(self, info: TensorInfo) -> torch.Tensor:
        try:
            handle = self._handles.get(info.file)
            if handle is None:
                from safetensors import safe_open

                check_regular_file(info.file)  # it may have been replaced since the header was read
                handle = safe_open(info.file, framework="pt", device="cpu")
                self._handles[info.file] = handle
            t = handle.get_tensor(info.name)
        except WeightsError:
            raise
        except Exception as e:  # safetensors raises its own untyped SafetensorError (or OSError) here
            raise WeightsError(f"cannot read tensor data: {e}", tensor=info.name, file=info.file) from e
        return t

    def close(self) -> None:
        self._handles.clear()
