"""The vocabulary-parallel embedding lookup of one tensor-parallel GPU in one kernel.

Under tensor parallelism each GPU holds rows [start, start + n) of the embedding table; a token outside its
slice contributes a zero row, and the all-reduce after it completes every row. Written out in torch that is
six elementwise kernels (offset, two compares, and, clamp, the row gather, the mask cast and multiply) before
the all-reduce; here one program per (token, hidden tile) reads the token id and either copies its row or
writes zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _embed_slice_kernel(ids_ptr, w_ptr, out_ptr, start, n, hidden, w_stride, BLOCK: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < hidden
    local = tl.load(ids_ptr + tok) - start + tl.zeros([BLOCK], tl.int64)  # the token's row, per lane
    mine = (local >= 0) & (local < n)
    row = tl.where(mine, local, 0)
    w = tl.load(w_ptr + row * w_stride + cols, mask=cmask & mine, other=0.0)
    tl.store(out_ptr + tok * hidden + cols, w, mask=cmask)


def embed_slice(ids: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """Same contract as `reference.embed_slice`: rows of `weight` (table rows [start, start + n)) for `ids`,
    zero rows for ids outside the slice; [*ids.shape, hidden] in the table's dtype."""
    n, hidden = weight.shape
    out = torch.empty(*ids.shape, hidden, dtype=weight.dtype, device=weight.device)
    flat = ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if flat.numel() and hidden:
        block = min(2048, triton.next_power_of_2(hidden))
        w = weight if n else weight.new_zeros(1, hidden)  # an empty slice still needs a valid pointer
        _embed_slice_kernel[(flat.numel(), triton.cdiv(hidden, block))](
            flat, w, out, start, n, hidden, w.stride(0), BLOCK=block, num_warps=4)
    return out
