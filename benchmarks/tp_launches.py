"""Kernels each tensor-parallel GPU launches per module of a decode step, counted on the CPU (fake devices).

    PYTHONPATH=. python benchmarks/tp_launches.py            # a tiny Llama, TP over 2 CPU "devices"

What a GPU would launch is read from the same code path the GPU runs: every `exlpy.kernels.ops` call counts as
the kernels its CUDA implementation launches for those shapes (`CUDA_LAUNCHES`: the decode GEMV is one kernel
at one row, two more rows take cuBLAS plus the separate norm / activation kernels, the split-K decode attention
is two), every other aten op issued by model code that launches a kernel counts one (views and allocations
count nothing), and each collective counts one kernel per GPU (NCCL's, or the peer / host-memory kernel;
on the CPU the `local` backend's copies are not counted). Host reads of device values inside a module
(`.item()`, `.tolist()`, a bool of a tensor) are counted apart: a captured step must have none.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from exlpy.kernels import ops  # noqa: E402

_FREE = {  # aten ops that launch no kernel: views, metadata, allocations
    "view", "_unsafe_view", "reshape", "slice", "select", "split", "split_with_sizes", "unbind", "chunk", "t",
    "transpose", "permute", "unsqueeze", "squeeze", "expand", "as_strided", "detach", "alias", "empty",
    "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "narrow", "view_as",
    "_reshape_alias", "unflatten", "flatten", "resolve_conj", "resolve_neg", "dim", "size", "stride", "sym_size",
}
_SYNCS = {"_local_scalar_dense", "is_nonzero", "equal", "item", "tolist"}


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1]


def _gemv_rows(x: torch.Tensor, w: torch.Tensor) -> bool:
    return x.numel() == w.shape[1]


# ops name -> kernels its CUDA implementation launches for these arguments (exlpy/kernels/triton_ops.py)
CUDA_LAUNCHES: dict[str, Callable[..., int]] = {
    "linear_add": lambda x, w, r=None: 1,  # the GEMV at one row; cuBLAS (addmm_ into the residual) beyond
    "norm_linear": lambda x, nw, eps, w: 1 if _gemv_rows(x, w) else 2,  # else rms_norm + cuBLAS
    "norm_linear_swiglu": lambda x, nw, eps, w: 1 if _gemv_rows(x, w) else 3,  # else + silu_mul
    "paged_attention": lambda q, *a, **k: 2 if q.shape[1] == 1 else 1,  # split-K decode + combine; flash
    "quant_attention": lambda q, *a, **k: 1,
}


class LaunchCount(TorchDispatchMode):
    """Counts per (lane, module label): kernels, collectives, host syncs."""

    def __init__(self) -> None:
        super().__init__()
        self.where: tuple[int, str] | None = None  # set while a lane's module code runs
        self.depth = 0  # inside an ops call or a collective: its own kernels are counted by rule
        self.kernels: Counter[tuple[int, str]] = Counter()
        self.collectives: Counter[tuple[int, str]] = Counter()
        self.syncs: Counter[tuple[int, str]] = Counter()
        self.lane_at: dict[int, str] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        if self.where is not None and self.depth == 0:
            if name in _SYNCS:
                self.syncs[self.where] += 1
            elif name not in _FREE and not (name in ("to", "contiguous") and out is args[0]):  # no-op casts
                self.kernels[self.where] += 1
        return out


class _Labeled:
    """A module's forward coroutine that tells the counter whose code runs each time it is resumed."""

    def __init__(self, coro: Any, lane: int, label: str, counter: LaunchCount) -> None:
        self.coro, self.lane, self.label, self.counter = coro, lane, label, counter

    def __await__(self) -> Generator[Any, Any, Any]:
        value = None
        while True:
            self.counter.where = (self.lane, self.label)
            self.counter.lane_at[self.lane] = self.label
            try:
                op = self.coro.send(value)
            except StopIteration as done:
                self.counter.where = None
                return done.value
            self.counter.where = None
            value = yield op


def _patch_ops(counter: LaunchCount) -> list[tuple[str, Any]]:
    saved = []
    for name in dir(ops):
        fn = getattr(ops, name)
        if name.startswith("_") or not callable(fn) or getattr(fn, "__module__", "") != ops.__name__:
            continue
        if name in ("register", "register_features", "has_cuda_kernels"):
            continue

        def wrapped(*args: Any, _fn: Any = fn, _name: str = name, **kwargs: Any) -> Any:
            if counter.where is not None and counter.depth == 0:
                rule = CUDA_LAUNCHES.get(_name)
                counter.kernels[counter.where] += rule(*args, **kwargs) if rule else 1
            counter.depth += 1
            try:
                return _fn(*args, **kwargs)
            finally:
                counter.depth -= 1
        saved.append((name, fn))
        setattr(ops, name, wrapped)
    return saved


def count_launches(model: Any, run: Callable[[], Any]) -> dict[str, Any]:
    """Per lane and module (labels `embed`, `attn{layer}`, `mlp{layer}`, `norm`, `head`): kernels, collectives
    and host syncs of `run()` (one forward of a model loaded with load_tp)."""
    counter = LaunchCount()
    stage = model.strategy.stages[0]
    saved_fwd: list[tuple[Any, Any]] = []
    for k, lane in enumerate(stage.lanes):
        layer = 0
        for m in lane.modules:
            kind = type(m).__name__
            label = {"Embedding": "embed", "RMSNorm": "norm", "Head": "head"}.get(kind)
            if label is None:
                label = f"{'attn' if kind == 'Attention' else 'mlp'}{layer}"
                layer += kind != "Attention"
            fwd = m.forward
            saved_fwd.append((m, fwd))
            m.forward = (lambda x, batch, _f=fwd, _k=k, _l=label: _Labeled(_f(x, batch), _k, _l, counter))
    group = stage.group
    run_group = group.run

    def counted_run(op_list: list[Any]) -> Any:
        for k, op in enumerate(op_list):
            where = (k, counter.lane_at.get(k, "?"))
            counter.collectives[where] += 1
            if op.kind == "gather_first" and group.capturing:
                counter.kernels[where] += 2  # captured: the zero-padded buffer's fill and the slice copy
        counter.depth += 1
        try:
            return run_group(op_list)
        finally:
            counter.depth -= 1

    group.run = counted_run
    capturing, group.capturing = group.capturing, True  # the head's gather as a captured step makes it
    saved_ops = _patch_ops(counter)
    try:
        with counter:
            run()
    finally:
        for name, fn in saved_ops:
            setattr(ops, name, fn)
        for m, fwd in saved_fwd:
            m.forward = fwd
        group.run = run_group
        group.capturing = capturing
    labels = sorted({lab for _, lab in list(counter.kernels) + list(counter.collectives)},
                    key=lambda s: (s[0] != "e", s.rstrip("0123456789") == "norm", s == "head",
                                   int("".join(c for c in s if c.isdigit()) or 0), s))
    out: dict[str, Any] = {}
    for k in range(len(stage.lanes)):
        out[f"lane{k}"] = {lab: {"kernels": counter.kernels[(k, lab)] + counter.collectives[(k, lab)],
                                 "collectives": counter.collectives[(k, lab)], "syncs": counter.syncs[(k, lab)]}
                           for lab in labels}
    return out


def per_layer(counts: dict[str, Any], lane: str = "lane0", layer: int = 0) -> dict[str, int]:
    """Kernels (collectives included) of one layer's attention and MLP blocks on one lane."""
    c = counts[lane]
    return {"attn": c[f"attn{layer}"]["kernels"], "mlp": c[f"mlp{layer}"]["kernels"],
            "collectives": c[f"attn{layer}"]["collectives"] + c[f"mlp{layer}"]["collectives"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,32", help="decode batch sizes")
    args = ap.parse_args()
    import tempfile

    from exlpy import ExLlamaV2, ExLlamaV2Config
    from exlpy.cache.tp import ExLlamaV2Cache_TP
    from tests.tp_util import make_model_dir

    d = make_model_dir(Path(tempfile.mkdtemp()) / "m", hidden=256, heads=8, kv_heads=2, vocab=640,
                       intermediate=512, layers=2, seed=5)
    m = ExLlamaV2(ExLlamaV2Config(str(d)))
    m.load_tp([1, 1], devices=["cpu", "cpu"])
    report = {}
    for rows in (int(r) for r in args.rows.split(",")):
        cache = ExLlamaV2Cache_TP(m, batch_size=rows, max_seq_len=64)
        ids = torch.randint(3, 640, (rows, 9), generator=torch.Generator().manual_seed(0))
        m.forward(ids[:, :-1], cache, preprocess_only=True)
        with torch.inference_mode():
            counts = count_launches(m, lambda c=cache, i=ids: m.forward(i[:, -1:], c))
        report[f"b{rows}"] = {"per_layer_lane0": per_layer(counts), "per_layer_lane1": per_layer(counts, "lane1"),
                              "modules": counts}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
