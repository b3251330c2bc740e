"""The split-K GEMV kernels of a mixture-of-experts block whose experts are EXL2, for few rows per expert (decode):
every routed expert's gate|up (with the activation) and down, same contracts as the tile kernels of
exlpy/kernels/moe_exl2.py, which dispatches here for aligned stacks (one width of 2-8 bits compiled in, or mixed
widths, each 32-row block at its own) while the mean sorted rows per routed expert is at most GEMV_MAX_ROWS.

Why not the tile kernels: at batch 1 they had far too little parallel work. Mixtral's down (K = 14336, 4096
outputs, 2 routed experts) ran 2 x 256 live programs of 16 columns, each walking all of K with 64 words per 32-row
block over 128 threads (half of them idle), every step a dependent chain (table entry, then the words it names)
into a tensor-core dot of one live row in sixteen; gate|up 2 x 224 programs of 64 columns (103 and 259 GB/s
measured on an H100). The GEMV kernels run one
program per (sorted row, column block of GEMV_COLS, K split): each thread owns 4 columns (fewer for narrow
outputs), loads every packed word row of its columns with one 16-byte load (a step's NB blocks loaded before any is
used), decodes each code with compile-time shifts and the fp32 mantissa trick of exl2_gemv (no int -> float
conversion), and feeds one FMA with the row's x, a scalar gathered through the expert's act order. K is split into
whole steps, as many splits as keep the grid within GEMV_WAVES programs per SM; the splits add their fp32 sums into
a zero workspace by atomics, and a second small kernel (no lock-free epilogue) takes each sum by atomic exchange
with zero, leaving the workspace zero for the next launch, and writes act(gate) * up, or down's y. No host sync, no
memset: the launches stay graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from exlpy.kernels.exl2_gemv import _MAGIC, _deq
from exlpy.kernels.moe import _ACTS, _sms, _store_gated, _tile
from exlpy.quant.exl2_ref import EXL2_BITS
from exlpy.quant.experts import ExpertStack
from exlpy.runtime import options

# One program per (sorted row, column block of GEMV_COLS, K split), no tensor cores, split-K through an fp32
# workspace. `benchmarks/moe.py --sweep` times other values of these (it sets them on this module).
GEMV_MAX_ROWS = 2  # the GEMV path while the mean sorted rows per routed expert is at most this (each row reads its
#                    expert's words on its own; the rows of one expert run side by side, so the repeats hit L2)
GEMV_COLS = 512  # columns per program: 4 per thread at GEMV_WARPS (one 16-byte load per packed word row)
GEMV_WARPS = 4
# 32-row blocks per step (their packed words are loaded before any is used) by (matrices, width), for K a
# multiple of the step (`even`: no row masks, Mixtral's and Qwen3-MoE's shapes) and for others: about 16 packed
# words in flight per thread (the decode GEMV's best on an H100, exl2_gemv_plan.CONFIG) where that stays within 128
# registers and unspilled under Triton 3.6 (4 programs per SM; benchmarks/moe_compile_check.py). The x gather's
# scalars of a step's rows live in registers too, so longer steps cost occupancy; masks cost more (3-bit down at
# 2 blocks spilled 72 bytes).
GEMV_NB = {(1, True): {2: 4, 3: 4, 4: 4, 5: 4, 6: 2, 8: 2}, (2, True): {2: 1, 3: 2, 4: 2, 5: 1, 6: 1, 8: 1},
           (1, False): {2: 2, 3: 1, 4: 2, 5: 2, 6: 2, 8: 2}, (2, False): {2: 1, 3: 1, 4: 1, 5: 1, 6: 1, 8: 1}}
GEMV_WAVES = 16  # K is split into as many parts as keep the programs within this many per SM. More programs than
#                 fit an SM at once hide the loads' latency better than one exact wave: Mixtral's EXL2 4.0 experts at
#                 batch 1 on an H100 (benchmarks/moe.py --sweep, 2026-11-26): waves 4 gate|up 73% / down 41% of the
#                 copy rate, 8 75% / 63%, 16 83% / 64%.
GEMV_WIDTHS = EXL2_BITS  # one-width stacks compiled for their width; mixed ones branch per block


@triton.jit
def _code(prev, cur, cur_hi, magic, i: tl.constexpr, B: tl.constexpr):
    """q - z (fp32) of code i of a 32-row block of width B whose words were taken in order (cur: the word code i
    ends in, prev: the one before, cur_hi: cur >> 16): compile-time shifts, the fp32 mantissa trick of
    exl2_gemv._deq (no int -> float conversion)."""
    Z: tl.constexpr = 1 << (B - 1)
    off: tl.constexpr = (i * B) % 32
    if (i * B) // 32 != (i * B + B - 1) // 32:  # straddles from the previous word
        d = _deq((prev >> off) | (cur << (32 - off)), magic, 0, B, Z)
    elif off + B <= 23:
        d = _deq(cur, magic, off, B, Z)
    else:
        d = _deq(cur_hi, magic, off - 16, B, Z)
    return d


@triton.jit
def _col_scale(sc_ptr, sm_ptr, info_ptr, at, inside, cols, ok, lds):
    """Per-column scale [BLOCK_N] fp32 of the group of the 32-row block whose first table entry is at `at`."""
    grp = (tl.load(info_ptr + at, mask=inside, other=0) >> 9).to(tl.int64)
    sw = tl.load(sc_ptr + grp * lds + cols // 8, mask=ok, other=0).to(tl.uint32, bitcast=True)
    c1 = ((sw >> ((cols % 8) * 4).to(tl.uint32)) & 15).to(tl.float32) + 1.0
    return c1 * c1 * tl.load(sm_ptr + grp)


@triton.jit
def _block_words(qw_ptr, word_ptr, at, inside, rows_left, ldq, cols, ok, ws, B: tl.constexpr, EVEN: tl.constexpr):
    """`ws` + the B packed words [BLOCK_N] of the 32-row block whose first table entry is at `at`; words holding
    no row below `rows_left` are not read (a partial last block may end the stack). EVEN: every block of every
    step lies inside K (no row masks)."""
    if EVEN:
        w0 = tl.load(word_ptr + at).to(tl.int64)
    else:
        w0 = tl.load(word_ptr + at, mask=inside, other=0).to(tl.int64)
    for wi in tl.static_range(B):
        if EVEN:
            m = ok
        else:
            # (int & int) != 0, not bool & bool: the CPU interpreter mis-types a scalar-broadcast bool &
            m = (ok.to(tl.int32) & (rows_left * B > wi * 32).to(tl.int32)) != 0
        ws = ws + (tl.load(qw_ptr + (w0 + wi) * ldq + cols, mask=m, other=0).to(tl.uint32, bitcast=True),)
    return ws


@triton.jit
def _x_at(x_row, perm_at, inside, EVEN: tl.constexpr):
    """x[perm[r]] (fp32 scalar) of the sorted row whose perm entry is at `perm_at`; 0 past K."""
    if EVEN:
        return tl.load(x_row + tl.load(perm_at)).to(tl.float32)
    return tl.load(x_row + tl.load(perm_at, mask=inside, other=0), mask=inside, other=0.0).to(tl.float32)


@triton.jit
def _one_block(x_row, qw_ptr, perm_ptr, word_ptr, at, k0, K, ldq, cols, ok, magic, B: tl.constexpr,
               EVEN: tl.constexpr, BLOCK_N: tl.constexpr):
    """sum over the 32 rows of one B-bit block (first table entry at `at`, first sorted row k0) of x[perm[r]] *
    (q - z), unscaled: mixed-width stacks, one block per step, its width chosen at run time."""
    ws = _block_words(qw_ptr, word_ptr, at, k0 < K, K - k0, ldq, cols, ok, (), B, EVEN)
    p = tl.zeros([BLOCK_N], tl.float32)
    prev = ws[0]
    for wi in tl.static_range(B):
        cur = ws[wi]
        hi = cur >> 16
        for i in tl.static_range(32):
            if (i * B + B - 1) // 32 == wi:
                p += _x_at(x_row, perm_ptr + at + i, k0 + i < K, EVEN) * _code(prev, cur, hi, magic, i, B)
        prev = cur
    return p


@triton.jit
def _mixed_block(x_row, qw_ptr, perm_ptr, word_ptr, info_ptr, at, k0, K, ldq, cols, ok, magic,
                 EVEN: tl.constexpr, BLOCK_N: tl.constexpr):
    """`_one_block` at the block's own width (any of EXL2's 2, 3, 4, 5, 6, 8), read from its first table entry."""
    bits = (tl.load(info_ptr + at, mask=k0 < K, other=4 << 5) >> 5) & 15
    p = tl.zeros([BLOCK_N], tl.float32)
    if bits == 2:
        p = _one_block(x_row, qw_ptr, perm_ptr, word_ptr, at, k0, K, ldq, cols, ok, magic, 2, EVEN, BLOCK_N)
    elif bits == 3:
        p = _one_block(x_row, qw_ptr, perm_ptr, word_ptr, at, k0, K, ldq, cols, ok, magic, 3, EVEN, BLOCK_N)
    elif bits == 4:
        p = _one_block(x_row, qw_ptr, perm_ptr, word_ptr, at, k0, K, ldq, cols, ok, magic, 4, EVEN, BLOCK_N)
    elif bits == 5:
        p = _one_block(x_row, qw_ptr, perm_ptr, word_ptr, at, k0, K, ldq, cols, ok, magic, 5, EVEN, BLOCK_N)
    elif bits == 6:
        p = _one_block(x_row, qw_ptr, perm_ptr, word_ptr, at, k0, K, ldq, cols, ok, magic, 6, EVEN, BLOCK_N)
    elif bits == 8:
        p = _one_block(x_row, qw_ptr, perm_ptr, word_ptr, at, k0, K, ldq, cols, ok, magic, 8, EVEN, BLOCK_N)
    return p


@triton.jit
def _gemv_span(x_row, g_qw, g_sc, g_sm, g_perm, g_word, g_info, u_qw, u_sc, u_sm, u_perm, u_word, u_info,
               e_row, k_lo, k_hi, K, cols, g_ok, u_ok, g_ldq, g_lds, u_ldq, u_lds, magic,
               B: tl.constexpr, NB: tl.constexpr, TWO: tl.constexpr, SAME_PERM: tl.constexpr,
               BLOCK_N: tl.constexpr, EVEN: tl.constexpr):
    """(sum over sorted rows [k_lo, k_hi) of x[perm[r]] * W[r, cols]) for one matrix, or for gate and up
    (TWO), of one activation row x_row, B-bit aligned stacks. Per step the packed words of NB blocks are loaded
    first (NB * B 16-byte loads per thread and matrix in flight), then each code is decoded by compile-time
    shifts and feeds one FMA with its row's x, a scalar (the act order's gather: one load of perm and one of x
    per row, shared by every column of the program); each block's partial sum is scaled once per column."""
    acc_g = tl.zeros([BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_N], tl.float32)
    if B == 0:  # mixed widths: one block per step, each at its own width (gate and up each theirs)
        for k0 in range(k_lo, k_hi, 32):
            pg = _mixed_block(x_row, g_qw, g_perm, g_word, g_info, e_row + k0, k0, K, g_ldq, cols, g_ok, magic, EVEN,
                              BLOCK_N)
            acc_g += pg * _col_scale(g_sc, g_sm, g_info, e_row + k0, k0 < K, cols, g_ok, g_lds)
            if TWO:
                pu = _mixed_block(x_row, u_qw, u_perm, u_word, u_info, e_row + k0, k0, K, u_ldq, cols, u_ok, magic,
                                  EVEN, BLOCK_N)
                acc_u += pu * _col_scale(u_sc, u_sm, u_info, e_row + k0, k0 < K, cols, u_ok, u_lds)
    else:
        for kb in range(k_lo, k_hi, 32 * NB):
            gws = ()
            uws = ()
            for blk in tl.static_range(NB):
                k0 = kb + blk * 32
                gws = _block_words(g_qw, g_word, e_row + k0, k0 < K, K - k0, g_ldq, cols, g_ok, gws, B, EVEN)
                if TWO:
                    uws = _block_words(u_qw, u_word, e_row + k0, k0 < K, K - k0, u_ldq, cols, u_ok, uws, B, EVEN)
            for blk in tl.static_range(NB):
                k0 = kb + blk * 32
                pg = tl.zeros([BLOCK_N], tl.float32)
                pu = tl.zeros([BLOCK_N], tl.float32)
                g_prev = gws[blk * B]
                u_prev = g_prev
                if TWO:
                    u_prev = uws[blk * B]
                for wi in tl.static_range(B):
                    g_cur = gws[blk * B + wi]
                    g_hi = g_cur >> 16
                    u_cur = g_cur
                    u_hi = g_hi
                    if TWO:
                        u_cur = uws[blk * B + wi]
                        u_hi = u_cur >> 16
                    for i in tl.static_range(32):
                        if (i * B + B - 1) // 32 == wi:  # code i ends in this word
                            xg = _x_at(x_row, g_perm + e_row + k0 + i, k0 + i < K, EVEN)
                            pg += xg * _code(g_prev, g_cur, g_hi, magic, i, B)
                            if TWO:
                                xu = xg
                                if not SAME_PERM:
                                    xu = _x_at(x_row, u_perm + e_row + k0 + i, k0 + i < K, EVEN)
                                pu += xu * _code(u_prev, u_cur, u_hi, magic, i, B)
                    g_prev = g_cur
                    u_prev = u_cur
                acc_g += pg * _col_scale(g_sc, g_sm, g_info, e_row + k0, k0 < K, cols, g_ok, g_lds)
                if TWO:
                    acc_u += pu * _col_scale(u_sc, u_sm, u_info, e_row + k0, k0 < K, cols, u_ok, u_lds)
    return acc_g, acc_u


@triton.jit
def _gate_up_gemv_kernel(x_ptr, order_ptr, counts_ptr,
                         g_qw, g_sc, g_sm, g_perm, g_word, g_info,
                         u_qw, u_sc, u_sm, u_perm, u_word, u_info,
                         ws_ptr, E, H, INTER, g_ldq, g_lds, u_ldq, u_lds, top_k, sx, chunk, magic,
                         E_P2: tl.constexpr, BLOCK_N: tl.constexpr, B: tl.constexpr, NB: tl.constexpr,
                         SAME_PERM: tl.constexpr, EVEN: tl.constexpr):
    """Program (sorted row, column block, K split): that row's gate and up sums over the split's sorted rows,
    added into the fp32 workspace [N, 2 * INTER] (gate | up), which `_act_kernel` turns into act(gate) * up."""
    expert, row, _ = _tile(counts_ptr, tl.program_id(0), E, E_P2, 1)
    if expert < E:
        tok = tl.load(order_ptr + row) // top_k
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        k_lo = tl.program_id(2) * chunk
        acc_g, acc_u = _gemv_span(x_ptr + tok * sx, g_qw, g_sc, g_sm, g_perm, g_word, g_info, u_qw, u_sc, u_sm,
                                  u_perm, u_word, u_info, expert.to(tl.int64) * H, k_lo, tl.minimum(k_lo + chunk, H),
                                  H, cols, cols < g_ldq, cols < u_ldq, g_ldq, g_lds, u_ldq, u_lds, magic, B, NB,
                                  True, SAME_PERM, BLOCK_N, EVEN)
        out = ws_ptr + row.to(tl.int64) * (2 * INTER) + cols
        tl.atomic_add(out, acc_g, mask=cols < INTER, sem="relaxed")
        tl.atomic_add(out + INTER, acc_u, mask=cols < INTER, sem="relaxed")


@triton.jit
def _down_gemv_kernel(a_ptr, order_ptr, counts_ptr, qw, sc, sm, perm_ptr, word_ptr, info_ptr, ws_ptr,
                      E, H, INTER, ldq, lds, sa, chunk, magic,
                      E_P2: tl.constexpr, BLOCK_N: tl.constexpr, B: tl.constexpr, NB: tl.constexpr,
                      EVEN: tl.constexpr):
    """Program (sorted row, column block, K split): that row's down sums over the split's rows, added into the
    fp32 workspace [N, H] at the row's pair (unsorted order); the caller converts it to y."""
    expert, row, end = _tile(counts_ptr, tl.program_id(0), E, E_P2, 1)
    if expert < E:
        pair = tl.load(order_ptr + row)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        k_lo = tl.program_id(2) * chunk
        acc, unused = _gemv_span(a_ptr + row.to(tl.int64) * sa, qw, sc, sm, perm_ptr, word_ptr, info_ptr, qw, sc, sm,
                            perm_ptr, word_ptr, info_ptr, expert.to(tl.int64) * INTER, k_lo,
                            tl.minimum(k_lo + chunk, INTER), INTER, cols, cols < ldq, cols < ldq, ldq, lds, ldq, lds,
                            magic, B, NB, False, True, BLOCK_N, EVEN)
        tl.atomic_add(ws_ptr + pair * H + cols, acc, mask=cols < H, sem="relaxed")


@triton.jit
def _take(ws_ptr, at, ok):
    """The fp32 sums at `at`, zeroed in the same atomic exchange (the workspace is zero again for the next
    launch). Never a load then a store of zeros: compiled, the two may be laid out over different threads with no
    barrier between (the race of the decode GEMV's first GPU run, exl2_gemv._finish). As int32 words: the CPU
    interpreter exchanges no floats."""
    wsi = ws_ptr.to(tl.pointer_type(tl.int32)) + at
    zero = tl.zeros_like(at).to(tl.int32)
    return tl.atomic_xchg(wsi, zero, mask=ok, sem="relaxed").to(tl.float32, bitcast=True)


@triton.jit
def _act_kernel(ws_ptr, out_ptr, INTER, so, ACT: tl.constexpr, BLOCK: tl.constexpr):
    """out[r] = act(gate) * up of workspace row r (fp32 gate | up sums, taken and zeroed), in out's dtype."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < INTER
    g = _take(ws_ptr, r * (2 * INTER) + cols, ok)
    u = _take(ws_ptr, r * (2 * INTER) + INTER + cols, ok)
    row = tl.zeros([1], tl.int64) + r  # a one-row tile for the tile kernels' store
    _store_gated(out_ptr, so, row, row >= 0, cols, ok, g[None, :], u[None, :], ACT)


@triton.jit
def _convert_kernel(ws_ptr, y_ptr, H, sy, BLOCK: tl.constexpr):
    """y[r] = workspace row r (fp32 sums, taken and zeroed) in y's dtype."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    tl.store(y_ptr + r * sy + cols, _take(ws_ptr, r * H + cols, ok).to(y_ptr.dtype.element_ty), mask=ok)


# --- host side -----------------------------------------------------------------------------------------------------
# Zeroed fp32 workspaces per (device, power-of-two size), kept zero by the kernels that read them (`_take`): no
# memset per launch. Launches of one device share them, so two MoE layers must not run concurrently on different
# streams of one device (decode runs one stream per device; exl2_gemv's workspace has the same rule).
_WORKSPACES: dict[tuple[torch.device, int], torch.Tensor] = {}


def _workspace(device: torch.device, numel: int) -> torch.Tensor:
    """A zero fp32 buffer of at least `numel` elements. Made on first use outside a CUDA-graph capture and kept
    (a capture only records the memset, so a buffer made there would not be zero outside the graph: a capture
    before any eager call of its size takes a fresh zeroed buffer of its own, from the graph's pool)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    size = triton.next_power_of_2(max(numel, 1))
    ws = _WORKSPACES.get((device, size))
    if ws is None:
        ws = torch.zeros(size, dtype=torch.float32, device=device)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _WORKSPACES[device, size] = ws
    return ws


def gemv_width(*stacks: ExpertStack) -> int | None:
    """How the GEMV kernels take these stacks: their one width (every block of every stack that wide), 0 for
    mixed widths (each block at its own, chosen at run time), None when some group is off the 32-row grid (the
    tile kernels' per-row path). EXL2 files hold only GEMV_WIDTHS (exl2_ref.EXL2_BITS, checked at load)."""
    if not all(s.aligned for s in stacks):
        return None
    w = stacks[0].width
    return w if w in GEMV_WIDTHS and all(s.width == w for s in stacks) else 0


def gemv_rows(n_pairs: int, n_experts: int) -> bool:
    """Whether N sorted rows over E experts are few per expert (decode): mean rows per routed expert at most
    GEMV_MAX_ROWS, where the GEMV kernels are on (the default; EXLPY_MOE_GEMV=0 turns them off, exlpy/runtime.py)."""
    return options().moe_gemv and n_pairs <= GEMV_MAX_ROWS * max(1, min(n_experts, n_pairs))


def gemv_nb(bits: int, matrices: int, k: int) -> tuple[int, bool]:
    """(32-row blocks per step, whether K is whole steps) for `matrices` stacks of `bits` (0: mixed, one block
    per step) over K rows."""
    if not bits:  # masked even where K is whole blocks: unmasked, Triton 3.9's gate|up spilled 40 bytes (3.6: none)
        return 1, False
    nb = GEMV_NB[matrices, True][bits]
    if k % (32 * nb):
        nb = GEMV_NB[matrices, False][bits]
    return nb, k % (32 * nb) == 0


def gemv_split(rows: int, n_out: int, k: int, nb: int, sms: int) -> tuple[int, int, int, int, int]:
    """(columns per program, warps, column blocks, K splits, sorted rows per split). Column blocks of GEMV_COLS
    (GEMV_WARPS warps: 4 columns a thread), halved while the last block would leave more than an eighth of the
    columns idle, down to one column a thread (Qwen3-MoE's 768: three of 256, not two of 512; the warps stay: at
    2 warps the 256-column 4-bit gate|up spilled 8 bytes under Triton 3.6). K is cut into whole steps of nb
    blocks of 32 rows, into as many splits as keep the programs of `rows` live rows within GEMV_WAVES per SM (on
    the CPU every step its own split, so that the interpreter tests cover the workspace's sums)."""
    cols, warps = GEMV_COLS, GEMV_WARPS
    while cols > 32 * warps and (triton.cdiv(n_out, cols) * cols - n_out) * 8 > n_out:
        cols //= 2
    col_blocks = triton.cdiv(n_out, cols)
    step = 32 * nb
    steps = triton.cdiv(k, step)
    want = GEMV_WAVES * sms // (rows * col_blocks) if sms else steps
    per = triton.cdiv(steps, max(1, min(steps, want)))
    return cols, warps, col_blocks, triton.cdiv(steps, per), per * step


def gate_up_gemv(x: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, gate: ExpertStack, up: ExpertStack,
                  top_k: int, kind: str, width: int, out: torch.Tensor) -> torch.Tensor:
    E, H, inter, N = gate.num_experts, gate.k, gate.n, order.shape[0]
    nb, even = gemv_nb(width, 2, H)
    cols, warps, col_blocks, splits, chunk = gemv_split(N, inter, H, nb, _sms(x))
    ws = _workspace(x.device, N * 2 * inter)  # split-K sums: gate | up
    _gate_up_gemv_kernel[(N, col_blocks, splits)](
        x, order, counts, gate.q_weight, gate.scales, gate.scale_max, gate.perm, gate.word, gate.info,
        up.q_weight, up.scales, up.scale_max, up.perm, up.word, up.info,
        ws, E, H, inter, gate.q_weight.stride(0), gate.scales.stride(0), up.q_weight.stride(0),
        up.scales.stride(0), top_k, x.stride(0), chunk, _MAGIC,
        E_P2=triton.next_power_of_2(E), BLOCK_N=cols, B=width, NB=nb,
        SAME_PERM=gate.perm_digest == up.perm_digest, EVEN=even, num_warps=warps, num_stages=1)
    block = min(1024, triton.next_power_of_2(inter))
    _act_kernel[(N, triton.cdiv(inter, block))](ws, out, inter, out.stride(0), ACT=_ACTS[kind], BLOCK=block,
                                                num_warps=4)
    return out


def down_gemv(a: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, down: ExpertStack, width: int,
               y: torch.Tensor) -> torch.Tensor:
    E, inter, H, N = down.num_experts, down.k, down.n, order.shape[0]
    nb, even = gemv_nb(width, 1, inter)
    cols, warps, col_blocks, splits, chunk = gemv_split(N, H, inter, nb, _sms(a))
    ws = _workspace(a.device, N * H)  # split-K sums, rows in pair order
    _down_gemv_kernel[(N, col_blocks, splits)](
        a, order, counts, down.q_weight, down.scales, down.scale_max, down.perm, down.word, down.info, ws,
        E, H, inter, down.q_weight.stride(0), down.scales.stride(0), a.stride(0), chunk, _MAGIC,
        E_P2=triton.next_power_of_2(E), BLOCK_N=cols, B=width, NB=nb, EVEN=even,
        num_warps=warps, num_stages=1)
    block = min(1024, triton.next_power_of_2(H))
    _convert_kernel[(N, triton.cdiv(H, block))](ws, y, H, y.stride(0), BLOCK=block, num_warps=4)
    return y
