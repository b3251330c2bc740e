"""Single-row (decode) matmul on packed EXL2/GPTQ weights: y[1, N] = x[1, K] @ W, memory-bound by design.

At one activation row every packed word is used once, so the kernel must unpack a code in a handful of
instructions or it becomes instruction-bound (an H100 delivers ~6e12 4-bit codes/s but issues only ~3e13
lane-ops/s). How the kernel keeps to ~3-4 operations per code:

- Each packed word is loaded once (16-byte loads, coalesced across N: a warp reads consecutive columns of one
  q_weight row) and all its codes are taken out with compile-time shifts and masks.
- int -> float without I2F (a quarter-rate conversion): OR the masked field (at bit offset o <= 22 - bits) into
  the mantissa of 2^23, reinterpret as fp32 = 2^23 + q*2^o, then one FMA by the exact constants 2^-o and
  -(2^(23-o) + zero) yields q - zero exactly. Fields above bit 22 come from one shared `word >> 16`.
- Per group and column only `part += x[perm[r]] * (q - z)` runs per code; the scale multiply happens once per
  group (EXL2 zero points are constants; GPTQ's per-column zeros are folded out as z * sum(x) per group).
- x is read in act order straight through q_perm (scalar loads, shared by all columns of a thread).
- Split-K over whole groups fills the SMs; partial sums go to a per-device fp32 workspace by atomics, and the
  last program of each column block (a self-resetting arrival counter) adds the bias, writes fp16 y and zeroes
  the workspace again: one launch per bit-width segment, no memset, no host sync, CUDA-graph safe.

Launch defaults (CONFIG) come from the H100 sweep in benchmarks/results/quant_matmul.md: the x gather as a tiny
first kernel and a 96-register cap (5 instead of 4 programs per SM) took 4-bit 4096x14336 from 1.2 to 1.6 TB/s.

The workspace is shared by all matmuls on a device: two of them must not run concurrently on different streams
of one device (decode runs one stream per device).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from exlpy.quant.layout import QuantLayout, QuantMatrix

_WS_COLS = 1 << 20  # fp32 workspace columns per device (N above this takes the generic path)
_WS_BLOCKS = 1 << 14  # arrival counters per device


@triton.jit
def _code(t, x, magic, oo: tl.constexpr, BITS: tl.constexpr, Z: tl.constexpr):
    """x * (q - Z) for the BITS-wide field of uint32 t at bit oo (oo + BITS <= 23). `magic` = 0x4B000000 comes
    in as a run-time value: it then lives in one register and the AND-OR is one LOP3 with the mask as its
    immediate (with both constants immediate, ptxas re-materializes the mask for every code)."""
    f = ((t & (((1 << BITS) - 1) << oo)) | magic).to(tl.float32, bitcast=True)
    return x * (f * (1.0 / (1 << oo)) - ((1 << (23 - oo)) + Z))


@triton.jit
def _gemv(x_ptr, perm_ptr, qw_ptr, sc_ptr, sm_ptr, z_ptr, grows_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr,
          magic, N, NP, stride_qw, stride_sc, stride_z, g_lo, g_hi, gpp, row0, word0,
          BITS: tl.constexpr, GPTQ: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
          MODE: tl.constexpr, XPRE: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr):
    """Programs (column block, K split). MODE 0: write y; 1: add into the workspace; 2: add, and the last
    program of a column block writes y and resets the workspace and its counter."""
    Z: tl.constexpr = 0 if GPTQ else (1 << (BITS - 1))
    pid_n = tl.program_id(0)
    ga = g_lo + tl.program_id(1) * gpp
    gb = tl.minimum(ga + gpp, g_hi)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ld_mask = offs_n < NP  # q_weight holds NP (multiple of 32) columns: keeps 16-byte loads possible
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for g in range(ga, gb):
        r_lo = tl.load(grows_ptr + g)
        r_hi = tl.load(grows_ptr + g + 1)
        part = tl.zeros((BLOCK_N,), tl.float32)
        xsum = 0.0
        for rb in range(r_lo, r_hi, 32 * NB):
            # All packed words of this step are loaded before any is used: NB * BITS loads in flight per thread.
            ws = ()
            for blk in tl.static_range(NB):
                r0 = rb + blk * 32
                nbits = (r_hi - r0) * BITS  # valid stream bits left in this block (<= 0: block is past the group)
                wp = qw_ptr + (word0 + (r0 - row0) // 32 * BITS) * stride_qw + offs_n
                for wi in tl.static_range(BITS):
                    # (int & int) != 0, not bool & bool: the CPU interpreter mis-types a scalar-broadcast bool &
                    wmask = (ld_mask.to(tl.int32) & (nbits > wi * 32).to(tl.int32)) != 0
                    ws = ws + (tl.load(wp + wi * stride_qw, mask=wmask, other=0).to(tl.uint32, bitcast=True),)
            for blk in tl.static_range(NB):
                # A block of 32 rows is BITS whole words: every code's word and offset are compile-time.
                r0 = rb + blk * 32
                # per-block base pointers: each code's x address is then base + a compile-time offset
                xb = x_ptr + r0
                pb = perm_ptr + r0
                prev = ws[blk * BITS]
                for wi in tl.static_range(BITS):
                    cur = ws[blk * BITS + wi]
                    cur_hi = cur >> 16
                    for i in tl.static_range(32):
                        if (i * BITS + BITS - 1) // 32 == wi:  # code i ends in this word
                            r = r0 + i
                            if XPRE:  # x already in act order, fp32, zero past K
                                xv = tl.load(xb + i)
                            elif HAS_PERM:
                                src = tl.load(pb + i, mask=r < r_hi, other=0)
                                xv = tl.load(x_ptr + src, mask=r < r_hi, other=0.0).to(tl.float32)
                            else:
                                xv = tl.load(xb + i, mask=r < r_hi, other=0.0).to(tl.float32)
                            if GPTQ:
                                xsum += xv
                            if (i * BITS) // 32 != wi:  # straddles from the previous word
                                part += _code((prev >> ((i * BITS) % 32)) | (cur << (32 - (i * BITS) % 32)), xv,
                                              magic, 0, BITS, Z)
                            elif (i * BITS) % 32 + BITS <= 23:
                                part += _code(cur, xv, magic, (i * BITS) % 32, BITS, Z)
                            else:
                                part += _code(cur_hi, xv, magic, (i * BITS) % 32 - 16, BITS, Z)
                    prev = cur
        if GPTQ:
            s = tl.load(sc_ptr + g * stride_sc + offs_n, mask=ld_mask, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g * stride_z + offs_n, mask=ld_mask, other=0.0).to(tl.float32)
            acc += (part - xsum * z) * s
        else:
            w = tl.load(sc_ptr + g * stride_sc + offs_n // 8, mask=ld_mask, other=0)
            c1 = (((w >> ((offs_n % 8) * 4)) & 15) + 1).to(tl.float32)
            acc += part * (c1 * c1 * tl.load(sm_ptr + g))
    out_mask = offs_n < N
    if MODE == 0:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=out_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.atomic_add(ws_ptr + offs_n, acc, mask=out_mask, sem="relaxed")
        if MODE == 2:
            tl.debug_barrier()  # every thread's partial is in before the arrival is counted
            arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
            if arrived == tl.num_programs(1) - 1:
                # .cg: the sums live in L2 (atomics); this SM's L1 may hold a stale line from an earlier call
                tot = tl.load(ws_ptr + offs_n, mask=out_mask, other=0.0, cache_modifier=".cg")
                tl.store(ws_ptr + offs_n, tl.zeros_like(acc), mask=out_mask)
                if HAS_BIAS:
                    tot += tl.load(bias_ptr + offs_n, mask=out_mask, other=0.0).to(tl.float32)
                tl.store(y_ptr + offs_n, tot.to(y_ptr.dtype.element_ty), mask=out_mask)
                tl.atomic_xchg(cnt_ptr + pid_n, 0)


@triton.jit
def _xperm(x_ptr, perm_ptr, xp_ptr, K, KP, HAS_PERM: tl.constexpr, BLOCK: tl.constexpr):
    """xp[r] = x[perm[r]] as fp32 for r < K, 0 up to KP (so the main loop needs no row masks)."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = r < K
    src = tl.load(perm_ptr + r, mask=m, other=0) if HAS_PERM else r
    tl.store(xp_ptr + r, tl.load(x_ptr + src, mask=m, other=0.0).to(tl.float32), mask=r < KP)


@functools.cache
def _workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-device zeroed (fp32 partial sums, int32 arrival counters); fixed size, kept zero by the kernel."""
    return (torch.zeros(_WS_COLS, dtype=torch.float32, device=device),
            torch.zeros(_WS_BLOCKS, dtype=torch.int32, device=device))


def prepare(device: torch.device) -> None:
    """Allocate the device's workspace now (outside any CUDA-graph capture)."""
    if device.type == "cuda":
        _workspace(torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device()))


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # the CPU interpreter: a few programs exercise split-K and the counters
    return torch.cuda.get_device_properties(device).multi_processor_count


# Launch parameters; benchmarks/quant_matmul.py sweeps them. BLOCK_N shrinks (down to MIN_BLOCK_N) until the
# grid has WAVES programs per SM; num_warps = BLOCK_N / (32 * COLS) gives each thread COLS columns (4: one
# 16-byte load per word row). XPRE: gather x into act order by a small first kernel (1) or inside the main loop
# through q_perm (0). MAXNREG: register cap per thread (0: compiler's choice), trading hoisted loads for
# occupancy. Defaults: best of the H100 sweep in benchmarks/results/quant_matmul.md.
CONFIG: dict[str, int] = {"BLOCK_N": 512, "MIN_BLOCK_N": 128, "WAVES": 4, "WORDS": 16, "XPRE": 1, "COLS": 4,
                          "MAXNREG": 96}
_MAGIC = 0x4B000000  # fp32 2^23: OR-ing a field below bit 23 into its mantissa gives 2^23 + field
_ROW_PAD = 16 * 32  # xp is zero-padded this far past K: a step covers at most WORDS // 2 (<= 16) blocks of 32


def supports(qm: QuantMatrix) -> bool:
    """Whether the decode kernel takes this matrix: every group but the last spans whole 32-row blocks (so
    every group starts on a block of its segment; 2-bit groups of 16 rows do not qualify)."""
    return qm.n <= _WS_COLS and _blocked(qm.layout)


@functools.lru_cache(maxsize=4096)
def _blocked(lay: QuantLayout) -> bool:
    return all((b - a) % 32 == 0 for a, b in zip(lay.group_rows[:-2], lay.group_rows[1:-1]))


@functools.lru_cache(maxsize=4096)
def _plan_cached(lay: QuantLayout, n: int, sms: int, cfg: tuple[tuple[str, int], ...]
                 ) -> tuple[int, tuple[tuple[int, int, int], ...]]:
    c = dict(cfg)
    want = c["WAVES"] * sms
    bn = c["BLOCK_N"]
    while bn > max(c["MIN_BLOCK_N"], 32 * c["COLS"]) and triton.cdiv(n, bn) * lay.num_groups < want:
        bn //= 2
    pn = triton.cdiv(n, bn)
    cost = [(lay.group_rows[s.g_hi] - s.row0) * s.bits for s in lay.segments]
    plan = []
    for seg, w in zip(lay.segments, cost):
        groups = seg.g_hi - seg.g_lo
        nk = max(1, min(groups, round(want * w / sum(cost) / pn)))
        gpp = -(-groups // nk)
        # 32-row blocks per step: about WORDS packed words in flight per column. A step never crosses into the
        # next group: nb divides every group's block count but the matrix's last (its overhang reads zero x).
        blocks = [-(-(lay.group_rows[g + 1] - lay.group_rows[g]) // 32) for g in range(seg.g_lo, seg.g_hi)]
        nb = max(1, min(c["WORDS"] // seg.bits, 16, max(blocks)))
        whole = blocks[:-1] if seg.g_hi == lay.num_groups else blocks
        while any(b % nb for b in whole):
            nb -= 1
        plan.append((gpp, -(-groups // gpp), nb))
    return bn, tuple(plan)


def _plan(qm: QuantMatrix, device: torch.device) -> tuple[int, tuple[tuple[int, int, int], ...]]:
    """(BLOCK_N, ((groups per program, K splits, blocks per step) per segment)): the grid fills the device
    about WAVES times over. Cached: host work per call stays O(1) beyond hashing the layout."""
    return _plan_cached(qm.layout, qm.n, _num_sms(device), tuple(sorted(CONFIG.items())))


def exl2_gemv(x: torch.Tensor, qm: QuantMatrix, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] (any float dtype, contiguous) -> y [1, N] in x's dtype; caller checks `supports(qm)`."""
    dev = x.device
    y = torch.empty(1, qm.n, dtype=x.dtype, device=dev)
    bn, plan = _plan(qm, dev)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    ws, cnt = _workspace(dev)
    if triton.cdiv(qm.n, bn) > cnt.numel():
        raise ValueError(f"N = {qm.n} needs more than {cnt.numel()} column blocks")  # unreachable: N <= _WS_COLS
    gptq = qm.kind == "gptq"
    sm = qm.scale_max if qm.scale_max is not None else qm.scales
    z = qm.zeros if qm.zeros is not None else qm.scales
    perm = qm.perm if qm.perm is not None else qm.group_rows
    xpre = bool(CONFIG["XPRE"])
    if xpre:
        kp = qm.k + _ROW_PAD
        xp = torch.empty(kp, dtype=torch.float32, device=x.device)
        _xperm[(triton.cdiv(kp, 1024),)](x, perm, xp, qm.k, kp, HAS_PERM=qm.perm is not None, BLOCK=1024,
                                          num_warps=4)
        x = xp
    launch = {"num_warps": max(1, bn // (32 * CONFIG["COLS"]))}
    if CONFIG["MAXNREG"] and dev.type == "cuda":
        launch["maxnreg"] = CONFIG["MAXNREG"]
    last = len(plan) - 1
    for i, (seg, (gpp, nk, nb)) in enumerate(zip(qm.layout.segments, plan)):
        mode = 0 if (last == 0 and nk == 1) else (2 if i == last else 1)
        _gemv[(triton.cdiv(qm.n, bn), nk)](
            x, perm, qm.q_weight, qm.scales, sm, z, qm.group_rows, bias if bias is not None else y, y, ws, cnt,
            _MAGIC, qm.n, qm.q_weight.shape[1], qm.q_weight.stride(0), qm.scales.stride(0), z.stride(0), seg.g_lo,
            seg.g_hi, gpp, seg.row0, seg.word0, BITS=seg.bits, GPTQ=gptq, HAS_PERM=qm.perm is not None,
            HAS_BIAS=bias is not None, MODE=mode, XPRE=xpre, BLOCK_N=bn, NB=nb, **launch)
    return y
