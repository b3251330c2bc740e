"""Non-finite weights (NaN, inf) are refused at load, naming the tensor.

One NaN in a weight would otherwise load fine and turn every logit into NaN (or, in an attention projection or
an EXL2 scale, into finite but wrong logits). The check runs where each floating tensor lands, on its device
and in its final dtype (so an fp32 value past fp16's range that became inf is caught too): one fp32 sum per
tensor, queued without a host sync. A finite sum proves the tensor finite; the sums of one module are read
in a single sync when the module is loaded (`module_checks`), and only a non-finite sum is looked at closely.

`EXLPY_SKIP_WEIGHT_CHECKS=1` turns the check off (what it costs: README, "Bad input").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from exlpy.errors import WeightsError


@dataclass
class _Pending:
    name: str
    file: str
    tensor: torch.Tensor
    total: torch.Tensor  # 0-dim fp32 sum on the tensor's device: non-finite iff a value is (or the sum overflows)
    stored: torch.dtype | None  # dtype in the checkpoint


_scope: ContextVar[list[_Pending] | None] = ContextVar("exlpy_weight_checks", default=None)


def enabled() -> bool:
    from exlpy.runtime import options

    return options().weight_checks


def stored_as_float(index: Any, name: str) -> None:
    """A floating-point weight must be stored with a floating dtype: an I16/I32 tensor where a float is expected
    would be value-cast into garbage (the checkpoint is damaged or was written wrongly). Header only, no data."""
    info = getattr(index, "tensors", {}).get(name)
    if info is not None and not info.torch_dtype.is_floating_point:
        raise WeightsError(f"stored as {info.dtype}, an integer type, but it is a floating-point weight (loading "
                           "would cast the integers to floats and give garbage); the file is damaged or was written "
                           "with the wrong dtype", tensor=name, file=info.file)


def landed(index: Any, name: str, t: torch.Tensor | None) -> Any:
    """Check floating tensor `t`, checkpoint tensor `name` of `index`, as it lands; returns `t`. Inside
    `module_checks()` the result is read when the module is done, else at once. Its stored dtype is always
    checked (`stored_as_float`); its values unless EXLPY_SKIP_WEIGHT_CHECKS=1."""
    if t is not None:
        stored_as_float(index, name)
    if t is None or not t.is_floating_point() or t.numel() == 0 or not enabled():
        return t
    info = getattr(index, "tensors", {}).get(name)
    pending = _Pending(name, info.file if info is not None else str(getattr(index, "model_dir", "")), t,
                       t.sum(dtype=torch.float32), info.torch_dtype if info is not None else None)
    scope = _scope.get()
    if scope is None:
        verify([pending])
    else:
        scope.append(pending)
    return t


@contextlib.contextmanager
def module_checks() -> Iterator[None]:
    """Collect the checks of the tensors loaded inside; verify them with one host sync per device at the end."""
    pending: list[_Pending] = []
    token = _scope.set(pending)
    try:
        yield
    finally:
        _scope.reset(token)
    verify(pending)


def verify(pending: list[_Pending]) -> None:
    by_device: dict[torch.device, list[_Pending]] = {}
    for p in pending:
        by_device.setdefault(p.total.device, []).append(p)
    for items in by_device.values():
        if bool(torch.isfinite(torch.stack([p.total for p in items])).all()):  # the one sync
            continue
        for p in items:
            if not bool(torch.isfinite(p.total)):
                _explain(p)


def _explain(p: _Pending) -> None:
    bad = ~torch.isfinite(p.tensor)
    count = int(bad.sum())
    if count == 0:
        return  # finite values whose fp32 sum overflowed (|w| near 1e38): nothing is wrong with the tensor
    first = tuple(int(i) for i in bad.nonzero()[0].tolist())
    value = p.tensor[first].item()
    if value in (float("inf"), float("-inf")) and p.stored not in (None, p.tensor.dtype):
        why = (f"a value in {p.stored} beyond {torch.finfo(p.tensor.dtype).max:g} became inf in "
               f"{p.tensor.dtype}: load the model in a wider dtype (config.dtype = torch.bfloat16 or float32), "
               "or the checkpoint is corrupt")
    else:
        why = "the checkpoint is corrupt"
    raise WeightsError(f"{count} non-finite value(s) (NaN or inf) in the weights, the first ({value}) at index "
                       f"{list(first)}; {why}", tensor=p.name, file=p.file)
