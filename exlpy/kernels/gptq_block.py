"""One block of GPTQ rows in one launch: the converter's inner loop (`reference.gptq_block`, same contract).

The torch loop issues ~25 small operations per row (quantize, dequantize, error, feed the error to the rows
below), so a GPU spends its time on launches: 4096 rows of an 8B's q/k/v cost ~100k launches per pass. Output
columns are independent in GPTQ (every column sees the same Hessian), so here one program holds a tile of
columns of one item for all R (<= 32) rows of the block in registers and walks the rows itself.

Bit-identical to the reference on CUDA: every step is the same IEEE fp32 operation in the same order (division
rounded to nearest with `div_rn`, not the approximate `/`; rounding half to even as torch.round; the launch
disables FMA contraction, so `w - u * e` rounds the product first as torch's two kernels do).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from exlpy.kernels import reference

R_PAD = 32  # rows per block: every group boundary of the option tables lies on a multiple of 32
BLOCK_N = 128
# (t + 1.5 * 2^23) - 1.5 * 2^23 rounds |t| < 2^22 to the nearest integer, ties to even, as torch.round does; t is
# clamped into [-z - 1, maxq - z + 1] first, which leaves the clamped code unchanged. Passed as an argument so
# no compiler folds the pair away.
_MAGIC = 12582912.0


@triton.jit
def _gptq_block_kernel(w_ptr, u_ptr, s_ptr, z_ptr, m_ptr, c_ptr, e_ptr, R, N, magic,
                       sw_o, sw_r, sw_n, su_r, su_c, ss_o, ss_n, sz_o, sm_o, sc_o, sc_r, sc_n, se_o, se_r, se_n,
                       RTN: tl.constexpr, R_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    o = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cm = cols < N
    rows = tl.arange(0, R_PAD)
    rm = rows < R
    w_tile = tl.load(w_ptr + o * sw_o + rows[:, None] * sw_r + cols[None, :] * sw_n,
                     mask=rm[:, None] & cm[None, :], other=0.0)
    s = tl.load(s_ptr + o * ss_o + cols * ss_n, mask=cm, other=1.0)
    z = tl.load(z_ptr + o * sz_o)
    mq = tl.load(m_ptr + o * sm_o)
    for j in range(R):
        # Row j of the tile (one value plus zeros: exact).
        x = tl.sum(tl.where(rows[:, None] == j, w_tile, 0.0), axis=0)
        t = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -z - 1.0), mq - z + 1.0)
        q = tl.minimum(tl.maximum(((t + magic) - magic) + z, 0.0), mq)
        dq = (q - z) * s
        tl.store(c_ptr + o * sc_o + j * sc_r + cols * sc_n, q.to(tl.uint8), mask=cm)
        tl.store(w_ptr + o * sw_o + j * sw_r + cols * sw_n, dq, mask=cm)
        if not RTN:
            e = tl.math.div_rn(x - dq, tl.load(u_ptr + j * su_r + j * su_c))
            tl.store(e_ptr + o * se_o + j * se_r + cols * se_n, e, mask=cm)
            # Rows above j get 0 * e: they were consumed already, their values no longer matter.
            uj = tl.load(u_ptr + j * su_r + rows * su_c, mask=(rows > j) & rm, other=0.0)
            w_tile = w_tile - uj[:, None] * e[None, :]


def gptq_block(w: torch.Tensor, u: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: torch.Tensor,
               codes: torch.Tensor, err: torch.Tensor, rtn: bool = False) -> None:
    """Same contract as `reference.gptq_block`."""
    o, r, n = w.shape
    if r > R_PAD or w.dtype != torch.float32:
        return reference.gptq_block(w, u, scale, zero, maxq, codes, err, rtn)
    grid = (o, triton.cdiv(n, BLOCK_N))
    _gptq_block_kernel[grid](w, u, scale, zero, maxq, codes, err, r, n, _MAGIC, *w.stride(), *u.stride(),
                             *scale.stride(), zero.stride(0), maxq.stride(0), *codes.stride(), *err.stride(),
                             RTN=rtn, R_PAD=R_PAD, BLOCK_N=BLOCK_N, enable_fp_fusion=False)
