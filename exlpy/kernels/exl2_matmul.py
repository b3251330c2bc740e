"""Triton matmuls on packed EXL2/GPTQ weights (spec §3.2-3.6), with `exl2_matmul_ref` as the torch twin.

Strategy (as in the reference library): up to 64 activation rows run a fused dequantize-and-multiply kernel that
reads every packed word once (exl2_gemv.py for one row, exl2_qmm.py for 2-64 rows, with `_qmv32`/`_qmv`/`_qmm`
here for layouts those do not take: 16-row 2-bit groups, act-order GPTQ); more rows (prefill) dequantize
the weight into an fp16 scratch matrix (column slices, bounded size) and let cuBLAS do the GEMM, unless
EXLPY_TC_MAX_ROWS sends 65 up to that many rows to the tensor-core kernel (exl2_tc.py, through exl2_qmm.qmm). Where
the fused kernels hand over is `exl2_qmm_plan.rows_kernel_takes` (a per-shape table, EXLPY_QUANT_ROWS and
EXLPY_TC_MAX_ROWS).

The packed matrix is processed one *segment* (all groups of one bit width) at a time so the width is a
compile-time constant; fused kernels split K across programs by whole groups and accumulate with fp32 atomics.
Per group, the zero point is folded out of the inner loop: sum_k x_k (q_k - z) s = s (sum_k x_k q_k - z sum_k x_k).
Every launch size derives from host-side layout ints: no device sync, safe inside CUDA graphs.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from exlpy.kernels import exl2_gemv, exl2_qmm, exl2_qmm_plan
from exlpy.quant.exl2_ref import exl2_matmul_ref as _dense_ref
from exlpy.quant.layout import QuantMatrix, Segment

MAX_FUSED_ROWS = 64  # the generic fused kernels below: rows of layouts exl2_qmm does not take
_SCRATCH_ELEMS = 1 << 26  # fp16 dequant scratch cap (128 MiB); wider matrices are done in column slices


@triton.jit
def _codes(qw_ptr, stride_qw, rows, r_mask, offs_n, n_mask, row0, word0, BITS: tl.constexpr):
    """Stored codes [CHUNK, BLOCK_N] (uint32) of sorted `rows` of a segment starting at (row0, word0)."""
    bit = (rows - row0) * BITS
    word = word0 + bit // 32
    off = (bit % 32).to(tl.uint32)
    m2 = r_mask[:, None] & n_mask[None, :]
    lo = tl.load(qw_ptr + word[:, None] * stride_qw + offs_n[None, :], mask=m2, other=0)
    v = lo.to(tl.uint32, bitcast=True) >> off[:, None]
    if BITS == 3 or BITS == 5 or BITS == 6:
        # Codes straddling a word boundary take their high bits from the next word (masked load: 0 otherwise).
        strad = (off + BITS) > 32
        hi = tl.load(qw_ptr + (word + 1)[:, None] * stride_qw + offs_n[None, :], mask=m2 & strad[:, None],
                     other=0)
        v = v | (hi.to(tl.uint32, bitcast=True) << (32 - off)[:, None])
    return v & ((1 << BITS) - 1)


@triton.jit
def _scale_zero(sc_ptr, sm_ptr, z_ptr, stride_sc, stride_z, g, offs_n, n_mask, BITS: tl.constexpr,
                GPTQ: tl.constexpr):
    """Scale and zero point [BLOCK_N] fp32 of group g."""
    if GPTQ:
        s = tl.load(sc_ptr + g * stride_sc + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * stride_z + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    else:
        w = tl.load(sc_ptr + g * stride_sc + offs_n // 8, mask=n_mask, other=0)
        c1 = (((w >> ((offs_n % 8) * 4)) & 15) + 1).to(tl.float32)
        s = c1 * c1 * tl.load(sm_ptr + g)
        z = tl.zeros_like(s) + (1 << (BITS - 1))
    return s, z


@triton.jit
def _qmv(x_ptr, perm_ptr, out_ptr, qw_ptr, sc_ptr, sm_ptr, z_ptr, grows_ptr, N, stride_qw, stride_sc, stride_z,
         g_lo, g_hi, gpp, row0, word0, BITS: tl.constexpr, GPTQ: tl.constexpr, HAS_PERM: tl.constexpr,
         BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    """One activation row: out[n] += sum over this program's groups of x[perm[r]] * W_sorted[r, n]."""
    pid_n = tl.program_id(0)
    ga = g_lo + tl.program_id(1) * gpp
    gb = tl.minimum(ga + gpp, g_hi)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for g in range(ga, gb):
        r_lo = tl.load(grows_ptr + g)
        r_hi = tl.load(grows_ptr + g + 1)
        s, z = _scale_zero(sc_ptr, sm_ptr, z_ptr, stride_sc, stride_z, g, offs_n, n_mask, BITS, GPTQ)
        part = tl.zeros((CHUNK, BLOCK_N), tl.float32)
        xs = tl.zeros((CHUNK,), tl.float32)
        for r0 in range(r_lo, r_hi, CHUNK):
            rows = r0 + tl.arange(0, CHUNK)
            r_mask = rows < r_hi
            if HAS_PERM:
                src = tl.load(perm_ptr + rows, mask=r_mask, other=0)
            else:
                src = rows
            xv = tl.load(x_ptr + src, mask=r_mask, other=0.0).to(tl.float32)
            q = _codes(qw_ptr, stride_qw, rows, r_mask, offs_n, n_mask, row0, word0, BITS)
            part += xv[:, None] * q.to(tl.float32)
            xs += xv
        acc += (tl.sum(part, axis=0) - tl.sum(xs, axis=0) * z) * s
    tl.atomic_add(out_ptr + offs_n, acc, mask=n_mask)


@triton.jit
def _qmv32(x_ptr, perm_ptr, out_ptr, qw_ptr, sc_ptr, sm_ptr, z_ptr, grows_ptr, N, stride_qw, stride_sc,
           stride_z, g_lo, g_hi, gpp, row0, word0, BITS: tl.constexpr, GPTQ: tl.constexpr,
           HAS_PERM: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    """_qmv for segments whose groups start on 32-row blocks: a block of 32 codes is BITS whole words, so each
    code's word and shift are compile-time constants (static unroll over the 32 positions of a block)."""
    NB: tl.constexpr = CHUNK // 32
    pid_n = tl.program_id(0)
    ga = g_lo + tl.program_id(1) * gpp
    gb = tl.minimum(ga + gpp, g_hi)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for g in range(ga, gb):
        r_lo = tl.load(grows_ptr + g)
        r_hi = tl.load(grows_ptr + g + 1)
        s, z = _scale_zero(sc_ptr, sm_ptr, z_ptr, stride_sc, stride_z, g, offs_n, n_mask, BITS, GPTQ)
        part = tl.zeros((NB, BLOCK_N), tl.float32)
        xs = tl.zeros((NB,), tl.float32)
        for r0 in range(r_lo, r_hi, CHUNK):
            brow = r0 + tl.arange(0, NB) * 32
            wptr = qw_ptr + (word0 + (brow - row0) // 32 * BITS)[:, None] * stride_qw + offs_n[None, :]
            for i in tl.static_range(32):
                rmask = (brow + i) < r_hi
                m2 = rmask[:, None] & n_mask[None, :]
                w = tl.load(wptr + ((i * BITS) // 32) * stride_qw, mask=m2, other=0).to(tl.uint32, bitcast=True)
                v = w >> ((i * BITS) % 32)
                if (i * BITS) % 32 + BITS > 32:
                    hi = tl.load(wptr + ((i * BITS) // 32 + 1) * stride_qw, mask=m2, other=0)
                    v = v | (hi.to(tl.uint32, bitcast=True) << (32 - (i * BITS) % 32))
                if HAS_PERM:
                    src = tl.load(perm_ptr + brow + i, mask=rmask, other=0)
                else:
                    src = brow + i
                xv = tl.load(x_ptr + src, mask=rmask, other=0.0).to(tl.float32)
                part += xv[:, None] * (v & ((1 << BITS) - 1)).to(tl.float32)
                xs += xv
        acc += (tl.sum(part, axis=0) - tl.sum(xs, axis=0) * z) * s
    tl.atomic_add(out_ptr + offs_n, acc, mask=n_mask)


@triton.jit
def _qmm(x_ptr, perm_ptr, out_ptr, qw_ptr, sc_ptr, sm_ptr, z_ptr, grows_ptr, M, N, stride_xm, stride_om,
         stride_qw, stride_sc, stride_z, g_lo, g_hi, gpp, row0, word0, BITS: tl.constexpr, GPTQ: tl.constexpr,
         HAS_PERM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    """2..32 activation rows (fp16 x): tensor-core dot of x with the raw codes, scaled per group."""
    pid_n = tl.program_id(0)
    ga = g_lo + tl.program_id(1) * gpp
    gb = tl.minimum(ga + gpp, g_hi)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for g in range(ga, gb):
        r_lo = tl.load(grows_ptr + g)
        r_hi = tl.load(grows_ptr + g + 1)
        s, z = _scale_zero(sc_ptr, sm_ptr, z_ptr, stride_sc, stride_z, g, offs_n, n_mask, BITS, GPTQ)
        part = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        xs = tl.zeros((BLOCK_M,), tl.float32)
        for r0 in range(r_lo, r_hi, CHUNK):
            rows = r0 + tl.arange(0, CHUNK)
            r_mask = rows < r_hi
            if HAS_PERM:
                src = tl.load(perm_ptr + rows, mask=r_mask, other=0)
            else:
                src = rows
            xt = tl.load(x_ptr + offs_m[:, None] * stride_xm + src[None, :],
                         mask=m_mask[:, None] & r_mask[None, :], other=0.0)
            q = _codes(qw_ptr, stride_qw, rows, r_mask, offs_n, n_mask, row0, word0, BITS)
            part = tl.dot(xt, q.to(tl.float16), part)  # codes <= 255 are exact in fp16
            xs += tl.sum(xt.to(tl.float32), axis=1)
        acc += (part - xs[:, None] * z[None, :]) * s[None, :]
    tl.atomic_add(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc,
                  mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _qdequant(out_ptr, qw_ptr, sc_ptr, sm_ptr, z_ptr, grows_ptr, perm_ptr, N, stride_o, stride_qw, stride_sc,
              stride_z, g_lo, row0, word0, BITS: tl.constexpr, GPTQ: tl.constexpr, SCATTER: tl.constexpr,
              BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    """W_sorted rows of group g_lo + program_id(1), columns of this block, as fp16; with SCATTER each sorted row
    r is written to row perm[r], i.e. W in input-feature order (x then needs no act-order gather)."""
    g = g_lo + tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    r_lo = tl.load(grows_ptr + g)
    r_hi = tl.load(grows_ptr + g + 1)
    s, z = _scale_zero(sc_ptr, sm_ptr, z_ptr, stride_sc, stride_z, g, offs_n, n_mask, BITS, GPTQ)
    for r0 in range(r_lo, r_hi, CHUNK):
        rows = r0 + tl.arange(0, CHUNK)
        r_mask = rows < r_hi
        q = _codes(qw_ptr, stride_qw, rows, r_mask, offs_n, n_mask, row0, word0, BITS).to(tl.float32)
        w = (q - z[None, :]) * s[None, :]
        dst = tl.load(perm_ptr + rows, mask=r_mask, other=0) if SCATTER else rows
        tl.store(out_ptr + dst[:, None] * stride_o + offs_n[None, :], w.to(tl.float16),
                 mask=r_mask[:, None] & n_mask[None, :])


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the CPU interpreter: a few programs are enough to exercise split-K
    return torch.cuda.get_device_properties(device).multi_processor_count


def _split(seg: Segment, programs_n: int, device: torch.device) -> tuple[int, int]:
    """(groups per program, number of K splits) so that the grid fills the device a few times over."""
    groups = seg.g_hi - seg.g_lo
    want = max(1, (WAVES * _num_sms(device) + programs_n - 1) // programs_n)
    gpp = max(1, -(-groups // want))
    return gpp, -(-groups // gpp)


def _args(qm: QuantMatrix) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """(scales, scale_max, zeros, stride_sc, stride_z) with placeholders for the unused tensors of a kind."""
    sm = qm.scale_max if qm.scale_max is not None else qm.scales
    z = qm.zeros if qm.zeros is not None else qm.scales
    return qm.scales, sm, z, qm.scales.stride(0), z.stride(0)


# Launch parameters; `tune` in benchmarks/quant_matmul.py overrides them to sweep. WAVES: fused-kernel programs
# per SM aimed for when choosing the K split.
WAVES = 4
USE_QMV32 = True
USE_GEMV = True  # one activation row: exl2_gemv (block-aligned groups); else _qmv32/_qmv below
CONFIG: dict[str, dict[str, int]] = {
    "qmv": {"BLOCK_N": 256, "CHUNK": 32, "num_warps": 4},
    "qmv32": {"BLOCK_N": 256, "CHUNK": 64, "num_warps": 4},
    "qmm": {"BLOCK_N": 64, "CHUNK": 32, "num_warps": 4},
    "dequant": {"BLOCK_N": 128, "CHUNK": 32, "num_warps": 8},
}


def fused_matmul(x: torch.Tensor, qm: QuantMatrix) -> torch.Tensor:
    """x [M <= 64, K] fp16 contiguous -> fp32 [M, N] by the generic fused kernels (any layout)."""
    m = x.shape[0]
    out = torch.zeros(m, qm.n, dtype=torch.float32, device=x.device)
    sc, sm, z, ssc, sz = _args(qm)
    perm = qm.perm if qm.perm is not None else qm.group_rows
    gptq = qm.kind == "gptq"
    for seg in qm.layout.segments:
        if m == 1:
            kern = _qmv32 if USE_QMV32 and seg.bits in qm.layout.aligned_bits() else _qmv
            cfg = CONFIG["qmv32" if kern is _qmv32 else "qmv"]
            pn = triton.cdiv(qm.n, cfg["BLOCK_N"])
            gpp, nk = _split(seg, pn, x.device)
            kern[(pn, nk)](x, perm, out, qm.q_weight, sc, sm, z, qm.group_rows, qm.n, qm.q_weight.stride(0), ssc,
                           sz, seg.g_lo, seg.g_hi, gpp, seg.row0, seg.word0, BITS=seg.bits, GPTQ=gptq,
                           HAS_PERM=qm.perm is not None, **cfg)
        else:
            cfg = CONFIG["qmm"]
            pn = triton.cdiv(qm.n, cfg["BLOCK_N"])
            gpp, nk = _split(seg, pn, x.device)
            _qmm[(pn, nk)](x, perm, out, qm.q_weight, sc, sm, z, qm.group_rows, m, qm.n, x.stride(0),
                           out.stride(0), qm.q_weight.stride(0), ssc, sz, seg.g_lo, seg.g_hi, gpp, seg.row0,
                           seg.word0, BITS=seg.bits, GPTQ=gptq, HAS_PERM=qm.perm is not None,
                           BLOCK_M=16 if m <= 16 else 32 if m <= 32 else 64, **cfg)
    return out


def dequantize(qm: QuantMatrix, n0: int = 0, n1: int | None = None, out: torch.Tensor | None = None,
               input_order: bool = False) -> torch.Tensor:
    """W_sorted[:, n0:n1] as fp16 [K, n1 - n0] (n0 a multiple of 32); with input_order, W[:, n0:n1] (rows in
    input-feature order: the act-order permutation applied while writing)."""
    n1 = qm.n if n1 is None else n1
    sub = qm.split_columns(n0, n1, copy=False) if (n0, n1) != (0, qm.n) else qm
    if out is None:
        out = torch.empty(qm.k, n1 - n0, dtype=torch.float16, device=qm.device)
    sc, sm, z, ssc, sz = _args(sub)
    cfg = CONFIG["dequant"]
    for seg in qm.layout.segments:
        grid = (triton.cdiv(sub.n, cfg["BLOCK_N"]), seg.g_hi - seg.g_lo)
        scatter = input_order and qm.perm is not None
        _qdequant[grid](out, sub.q_weight, sc, sm, z, qm.group_rows, qm.perm if scatter else qm.group_rows, sub.n,
                        out.stride(0), sub.q_weight.stride(0), ssc, sz, seg.g_lo, seg.row0, seg.word0, BITS=seg.bits,
                        GPTQ=qm.kind == "gptq", SCATTER=scatter, **cfg)
    return out


def dequant_matmul(x: torch.Tensor, qm: QuantMatrix | list[QuantMatrix], residual: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """x [M, K] fp16 @ [qm] or [parts side by side] -> fp16 [M, N total], or added into `residual` [M, N total]
    (fp16, contiguous; cuBLAS accumulates into it, beta = 1) and returned. W is dequantized in column slices of
    at most _SCRATCH_ELEMS, in input-feature order (the act-order permutation applied while writing, so x needs
    no gather), each multiplied straight into its columns of the output."""
    parts = qm if isinstance(qm, list) else [qm]
    k = parts[0].k
    step = max(32, (_SCRATCH_ELEMS // k) // 32 * 32)
    if len(parts) == 1 and step >= parts[0].n:
        w = dequantize(parts[0], input_order=True)
        return x @ w if residual is None else residual.addmm_(x, w)
    y = residual if residual is not None else torch.empty(x.shape[0], sum(p.n for p in parts),
                                                          dtype=torch.float16, device=x.device)
    scratch = torch.empty(k, min(step, max(p.n for p in parts)), dtype=torch.float16, device=x.device)
    o = 0
    for p in parts:
        for n0 in range(0, p.n, step):
            n1 = min(n0 + step, p.n)
            w = dequantize(p, n0, n1, scratch[:, :n1 - n0], input_order=True)
            if residual is None:
                torch.mm(x, w, out=y[:, o + n0:o + n1])
            else:
                y[:, o + n0:o + n1].addmm_(x, w)
        o += p.n
    return y


def fused_rows(m: int, qm: QuantMatrix) -> bool:
    """Whether m rows of qm run the multi-row path (exl2_qmm / exl2_tc, packed weights read once), by shape and
    layout."""
    return exl2_qmm_plan.rows_kernel_takes(m, qm.k, qm.n) and exl2_qmm_plan.supports(qm)


def exl2_matmul(x: torch.Tensor, qm: QuantMatrix, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W (+ bias) for x [..., K] on the packed matrix qm; result [..., N] in x's dtype."""
    lead = x.shape[:-1]
    m = x.numel() // qm.k
    if USE_GEMV and exl2_gemv.gemv_takes(m, qm.n, qm.k) and exl2_gemv.supports(qm):
        return exl2_gemv.exl2_gemv(x.reshape(m, qm.k), qm, bias).to(x.dtype).reshape(*lead, qm.n)
    if fused_rows(m, qm):  # 2-64 rows, or one row the tensor-core kernel takes
        return exl2_qmm.qmm(x.reshape(m, qm.k), [qm], bias).reshape(*lead, qm.n)
    x2 = x.reshape(-1, qm.k).to(torch.float16).contiguous()
    if x2.shape[0] == 1 and USE_GEMV and exl2_gemv.supports(qm):
        return exl2_gemv.exl2_gemv(x2, qm, bias).to(x.dtype).reshape(*lead, qm.n)
    if x2.shape[0] <= MAX_FUSED_ROWS and (x2.shape[0] == 1 or exl2_qmm_plan.rows_kernel_takes(x2.shape[0], qm.k,
                                                                                               qm.n)):
        y = fused_matmul(x2, qm)
    else:
        y = dequant_matmul(x2, qm)
    if bias is not None:
        y = y + bias
    return y.to(x.dtype).reshape(*lead, qm.n)


def quant_matmul_cuda(x: torch.Tensor, parts: list[QuantMatrix], bias: torch.Tensor | None = None,
                      residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                      eps: float = 0.0) -> torch.Tensor:
    """Same contract as `reference.quant_matmul`: 2-64 rows of layouts it takes go to exl2_qmm in one launch
    (norm, act-order gather and residual fused); longer inputs dequantize the parts into one output for cuBLAS
    (the residual accumulated by the GEMM); what remains (one row, other layouts) runs part by part."""
    from exlpy.kernels import ops

    k = parts[0].k
    n = sum(p.n for p in parts)
    m = x.numel() // k
    lead = x.shape[:-1]
    fits = residual is not None and residual.is_contiguous() and residual.dtype == torch.float16
    if 2 <= m and USE_GEMV and exl2_gemv.gemv_takes(m, n, k) and all(exl2_gemv.supports(p) for p in parts) \
            and (residual is None or (residual.is_contiguous() and residual.numel() == m * n)):
        try:
            group = _gemv_group(parts, bias)
        except ValueError:  # more output columns than the decode workspace holds
            group = None
        if group is not None:
            xp = (ops.rms_norm_act_order(x, norm_weight, eps, parts[0].perm, exl2_gemv.ROW_PAD)
                  if norm_weight is not None else ops.act_order(x, parts[0].perm, exl2_gemv.ROW_PAD))
            y = group.run(xp, x.dtype, residual.view(m, n) if residual is not None else None)
            return residual if residual is not None else y.view(*lead, n)
    takes = exl2_qmm_plan.rows_kernel_takes(m, k, n)
    if takes and all(exl2_qmm_plan.supports(p) for p in parts):  # 2-64 rows, or one the tc kernel takes
        res = residual.view(m, n) if residual is not None and residual.is_contiguous() else None
        y = exl2_qmm.qmm(x.reshape(m, k), parts, bias, res, norm_weight, eps)
        if residual is not None and res is None:
            return residual.add_(y.view(residual.shape))
        return residual if res is not None else y.view(*lead, n)
    h = ops.rms_norm(x, norm_weight, eps) if norm_weight is not None else x
    if m >= 2 and not takes:  # prefill: dequantize + cuBLAS, every part into one output
        h2 = h.reshape(m, k).to(torch.float16).contiguous()
        if fits and bias is None:
            dequant_matmul(h2, parts, residual.view(m, n))
            return residual
        y = dequant_matmul(h2, parts)
        if bias is not None:
            y = y + bias
        y = y.to(x.dtype).view(*lead, n)
        return y if residual is None else residual.add_(y.to(residual.dtype))
    ys, o = [], 0
    for p in parts:
        ys.append(exl2_matmul(h, p, bias[o:o + p.n] if bias is not None else None))
        o += p.n
    y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
    return y if residual is None else residual.add_(y.to(residual.dtype))


def _gemv_group(parts: list[QuantMatrix], bias: torch.Tensor | None) -> exl2_gemv.GemvGroup:
    """The GEMV group of these parts (its plan is cached by their layouts; the group itself is cheap)."""
    return exl2_gemv.GemvGroup(parts, bias)


def exl2_matmul_ref(x: torch.Tensor, qm: QuantMatrix, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Torch twin of exl2_matmul (fp32 math)."""
    y = _dense_ref(x, qm)
    return y if bias is None else (y.float() + bias.float()).to(x.dtype)


quant_matmul = exl2_matmul
