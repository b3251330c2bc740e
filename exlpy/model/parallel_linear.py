"""Tensor-parallel linear layers that own their collective, and the residual-closing call every block uses.

Under tensor parallelism every GPU runs the same blocks on its own shard of the weights (in lock step, see
exlpy/engine/lockstep.py). The projections that open a block (q|k|v, gate|up) are split by output columns and
need no communication: they are ordinary (fused) linears over this GPU's heads or intermediate slice. The
projection that closes a block must sum over the GPUs, and that is all the blocks see of parallelism:

- `RowParallel` (dense weights, Megatron): the input features are this GPU's heads / intermediate slice; each
  GPU computes a partial product, the partials are all-reduced. The first GPU adds the residual (and the
  bias) inside its GEMM, so the reduced sum is the next residual: one collective per block.
- `ColumnParallel` (EXL2 weights, whose row split would need group-aligned ranges and the permutation; spec
  §7.4): the input slice is all-gathered to full width, each GPU computes its output columns, the columns are
  all-gathered: two collectives per block. It also serves the head, whose vocabulary columns are gathered to
  the first GPU only.

All-gathers are all-reduces of zero-padded buffers: uneven splits need no special case, and decode-sized
messages are latency-bound anyway.

`extra(h, y)` (LoRA adapters, exlpy/lora/block.py) runs between a projection's GEMM and its collective: it may
add to this GPU's output y, given the input h as the projection saw it, and returns the tensor to use.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

import torch

from exlpy.model.batch import ForwardBatch
from exlpy.model.fusion import add_linear, dense_matmul
from exlpy.model.linear import DenseLinear, Linear

Extra = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
FUSED_NORM_ROWS = 64  # kernels/host_allreduce.py NORM_ROWS: rows whose all-reduce may carry the next norm
# Fewest rows of one overlapped chunk: below this a GEMM's tiles stop filling an H100 and the collective of a
# chunk is latency-bound, so splitting would cost more than the overlap saves.
OVERLAP_MIN_ROWS = 512


class Collective(Protocol):
    """The meeting point of the GPUs of one tensor-parallel forward."""

    def all_reduce(self, t: torch.Tensor) -> Awaitable[None]:
        """Sum `t` over the GPUs, in place."""
        ...

    def all_reduce_norm(self, t: torch.Tensor, weight: torch.Tensor, eps: float) -> Awaitable[torch.Tensor]:
        """Sum `t` over the GPUs in place; return rms_norm(sum, weight, eps) (fused where the backend can)."""
        ...

    def gather_first(self, part: torch.Tensor, offset: int, total: int) -> Awaitable[torch.Tensor | None]:
        """Join every GPU's column slice (at `offset`, `total` wide) on the first GPU; None on the others."""
        ...

    def prefills(self, t: torch.Tensor) -> bool:
        """Whether an all-reduce of `t` goes to the prefill collective (which can norm the sum in its last pass)."""
        ...

    overlap_chunks: int  # row chunks of a prefill-sized projection (1: none)

    def overlaps(self, t: torch.Tensor) -> bool:
        """Whether all-reduces of `t`'s row chunks can run beside the next chunk's GEMM (all_reduce_start/join)."""
        ...

    def all_reduce_start(self, t: torch.Tensor) -> Awaitable[None]:
        """Begin summing `t` in place beside the work that follows; complete after `all_reduce_join`."""
        ...

    def all_reduce_join(self, t: torch.Tensor) -> Awaitable[None]:
        """Wait (on the device) for every sum begun with `all_reduce_start`; `t`: the whole result, for the lane's
        device."""
        ...


def place(part: torch.Tensor | None, offset: int, total: int, like: torch.Tensor) -> torch.Tensor:
    """`part` written at column `offset` of a zeroed `total`-wide tensor (an all-gather by all-reduce)."""
    out = torch.zeros(*like.shape[:-1], total, dtype=like.dtype, device=like.device)
    if part is not None:
        out[..., offset:offset + part.shape[-1]] = part
    return out


class RowParallel:
    """Partial products over this GPU's input slice, summed over GPUs; `first` adds the residual.

    `next_norm` (weight, eps): the RMSNorm the next block applies to this sum, set at load when the backend
    fuses it into the all-reduce (exlpy/engine/tensor_parallel.py). For 2-64 rows (batched decode; one row
    has the norm inside the next GEMV already) the collective then also returns the normed sum, left in
    `batch.prenormed` for the next block: one kernel instead of all-reduce + norm. `prefill_norm`: the same
    norm, linked when the model has a prefill collective (EXLPY_TP_PREFILL_COMM=copy): the messages that take it
    end in one pass that adds the peer's partial and norms the sum (exlpy/parallel/tp_copy.py)."""

    def __init__(self, inner: DenseLinear | None, group: Collective, first: bool, out_features: int,
                 bias: torch.Tensor | None = None) -> None:
        self.inner = inner  # None: this GPU holds no share of the input features (it only joins the sum)
        self.group = group
        self.first = first
        self.out_features = out_features
        self.bias = bias  # the first GPU's bias when it holds no share of the input features
        self.next_norm: tuple[torch.Tensor, float] | None = None
        self.prefill_norm: tuple[torch.Tensor, float] | None = None

    async def forward_add(self, h: torch.Tensor | None, x: torch.Tensor, extra: Extra | None = None,
                          batch: ForwardBatch | None = None) -> torch.Tensor:
        chunks = self._chunks(h, x, extra, batch)
        if chunks > 1:
            return await self._overlapped(h, x, chunks)
        if self.inner is None or h is None:
            y = (x if self.bias is None else x.add_(self.bias)) if self.first else torch.zeros_like(x)
        else:
            y = add_linear(x, self.inner, h) if self.first else dense_matmul(self.inner, h)
            if extra is not None:
                y = extra(h, y)
        nn = self.next_norm
        if nn is not None and batch is not None and 1 < y.numel() // y.shape[-1] <= FUSED_NORM_ROWS \
                and y.dtype == nn[0].dtype:
            batch.prenormed = (y, await self.group.all_reduce_norm(y, nn[0], nn[1]))
            return y
        pn = self.prefill_norm
        if pn is not None and batch is not None and y.dtype == pn[0].dtype and self.group.prefills(y):
            batch.prenormed = (y, await self.group.all_reduce_norm(y, pn[0], pn[1]))
            return y
        await self.group.all_reduce(y)
        return y

    def _chunks(self, h: torch.Tensor | None, x: torch.Tensor, extra: Extra | None, batch: ForwardBatch | None
                ) -> int:
        """Row chunks for this call: >1 only for prefill-sized dense products where the group overlaps, and not
        where the prefill collective (its own norm pass) or an adapter's extra (sees the whole output) applies.
        Depends only on shapes and group state, so every lane decides the same."""
        n = getattr(self.group, "overlap_chunks", 1)
        rows = x.numel() // x.shape[-1]
        if n <= 1 or rows < 2 * OVERLAP_MIN_ROWS or extra is not None or not x.is_contiguous():
            return 1
        if not self.group.overlaps(x) or self.group.prefills(x):
            return 1
        if self.inner is not None and h is not None and (self.bias is not None or h.dtype != x.dtype):
            return 1
        return min(n, rows // OVERLAP_MIN_ROWS)

    async def _overlapped(self, h: torch.Tensor | None, x: torch.Tensor, chunks: int) -> torch.Tensor:
        """The closing product in `chunks` row ranges; each range's all-reduce begins as soon as its GEMM is issued
        and runs beside the next range's GEMM, and the lane's stream waits for all of them at the end. The first
        GPU accumulates into the residual x in place (cuBLAS beta=1), the others into a fresh buffer."""
        width = x.shape[-1]
        rows = x.numel() // width
        if self.inner is None or h is None:
            y = (x if self.bias is None else x.add_(self.bias)) if self.first else torch.zeros_like(x)
            flat = y.view(rows, width)
            hv = None
        else:
            y = x if self.first else torch.empty_like(x)
            flat = y.view(rows, width)
            hv = h.reshape(rows, h.shape[-1])
        bounds = [rows * i // chunks for i in range(chunks + 1)]
        for a, b in zip(bounds, bounds[1:]):
            part = flat[a:b]
            if hv is not None:
                assert self.inner is not None
                if self.first:
                    got = add_linear(part, self.inner, hv[a:b])
                elif part.is_cuda and self.inner.bias is None:
                    got = torch.mm(hv[a:b], self.inner.weight.t(), out=part)
                else:
                    got = dense_matmul(self.inner, hv[a:b])
                if got.data_ptr() != part.data_ptr():  # the reference (CPU) path returns a new tensor
                    part.copy_(got)
            await self.group.all_reduce_start(part)
        await self.group.all_reduce_join(y)
        return y


class ColumnParallel:
    """This GPU's output columns [out_offset, +width) of a projection, gathered to full width.

    `in_offset`/`in_total` set: the input is this GPU's slice of the features and is all-gathered first.
    `first_only`: the output is gathered on the first GPU only (the head: logits leave from there).
    """

    def __init__(self, inner: Linear | None, group: Collective, out_offset: int, out_total: int,
                 in_offset: int | None = None, in_total: int | None = None, first_only: bool = False) -> None:
        self.inner = inner
        self.group = group
        self.out_offset, self.out_total = out_offset, out_total
        self.in_offset, self.in_total = in_offset, in_total
        self.first_only = first_only
        self.out_features = out_total

    async def forward(self, h: torch.Tensor | None, like: torch.Tensor | None = None, extra: Extra | None = None
                      ) -> torch.Tensor | None:
        """`h` None: this GPU holds no input slice (it contributes zeros); `like` then gives rows and dtype."""
        if self.in_total is not None:
            assert self.in_offset is not None
            ref = h if h is not None else like
            assert ref is not None
            h = place(h, self.in_offset, self.in_total, ref)
            await self.group.all_reduce(h)
        assert h is not None
        y = self.inner.forward(h) if self.inner is not None else None
        if y is not None and extra is not None:
            y = extra(h, y)
        if self.first_only:
            empty = h.new_empty(*h.shape[:-1], 0)
            return await self.group.gather_first(y if y is not None else empty, self.out_offset, self.out_total)
        full = place(y, self.out_offset, self.out_total, h)
        await self.group.all_reduce(full)
        return full

    async def forward_add(self, h: torch.Tensor | None, x: torch.Tensor, extra: Extra | None = None,
                          batch: ForwardBatch | None = None) -> torch.Tensor:
        y = await self.forward(h, x, extra)
        assert y is not None
        return x.add_(y)


async def close_block(x: torch.Tensor, linear: Linear | RowParallel | ColumnParallel, h: torch.Tensor | None,
                      extra: Extra | None = None, batch: ForwardBatch | None = None) -> torch.Tensor:
    """x + linear(h): the projection that closes a block, adding into the residual stream. A tensor-parallel
    projection also sums over the GPUs here (its collective). `extra`: see the module docstring. `batch`: the
    pass's batch, given where the next block may take its normed input from the collective (RowParallel)."""
    if isinstance(linear, (RowParallel, ColumnParallel)):
        return await linear.forward_add(h, x, extra, batch)  # type: ignore[arg-type]
    assert h is not None
    y = add_linear(x, linear, h)
    return y if extra is None else extra(h, y)


async def project(linear: Linear | RowParallel | ColumnParallel, h: torch.Tensor | None, like: torch.Tensor,
                  extra: Extra | None = None) -> torch.Tensor:
    """linear(h) alone (summed over GPUs under tensor parallelism), for blocks that norm their output before
    the residual add (Gemma 2, GLM-4). `like`: the residual, for shape and dtype."""
    if isinstance(linear, (RowParallel, ColumnParallel)):
        return await linear.forward_add(h, torch.zeros(like.shape, dtype=_out_dtype(linear, like),
                                                       device=like.device), extra)  # type: ignore[arg-type]
    assert h is not None
    y = dense_matmul(linear, h) if type(linear) is DenseLinear else linear.forward(h)  # the decode GEMV kernel
    return y if extra is None else extra(h, y)


def _out_dtype(linear: RowParallel | ColumnParallel, like: torch.Tensor) -> torch.dtype:
    inner = linear.inner
    weight = getattr(inner, "weight", None)
    return weight.dtype if weight is not None else like.dtype
