"""Grouped GEMMs of a mixture-of-experts block: every expert's gate|up (with the activation) in one launch, every
expert's down in another. Same contracts as `reference.moe_gate_up / moe_down` (read those first).

The rows are the step's (token, slot) pairs sorted by expert (`moe_sort`: one program, a counting sort), so each
expert owns a contiguous run of rows. The row axis of the grid is a list of row tiles: expert e's run is cut into
ceil(count_e / BLOCK_M) tiles, laid end to end in expert order. A program reads the expert counts from device
memory, finds which expert's tile it is (a prefix sum over the E counts) and multiplies that tile by that
expert's weights, which it reads once for all the tile's rows; programs past the last tile exit at once. Sum over
experts of ceil(count_e / BLOCK_M) <= ceil(N / BLOCK_M) + min(E, N), so the grid has that many row tiles: fixed
for a given number of pairs N, whatever the routing. Nothing is read on the host, nothing is allocated with a
routed size, and experts no token chose are never read: one launch per projection, capturable in a CUDA graph.

gate|up gathers its input rows (token order[r] // k) and writes act(gate) * up in sorted order; down reads the
sorted rows and writes each row back to its pair's place, unweighted; `moe_combine` sums the k outputs of a token
with their routing weights in fp32 and adds the residual. With `moe_route` (softmax, top-k, renormalisation in
one program per token) an MoE block is seven launches: norm, router matmul, route, sort, gate|up, down, combine.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from exlpy.kernels import reference

_ACTS = {"silu": 0, "gelu_tanh": 1}
STAGES = 3  # software pipelining depth of the K loop (weight tiles in flight per program)


@triton.jit
def _route_kernel(logits_ptr, w_ptr, ids_ptr, E, sl, norm_p, K: tl.constexpr, K_P2: tl.constexpr,
                  E_P2: tl.constexpr, NORM: tl.constexpr):
    """One token per program: softmax over the E logits in fp32, the K largest taken one by one (the lowest
    index among equals; NaN logits still give an expert id < E), divided by their L_p norm (NORM 1: the sum;
    2: any p > 0, via exp2/log2; 0: none)."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_P2)
    x = tl.load(logits_ptr + t * sl + e, mask=e < E, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(e < E, p, -1.0)
    j = tl.arange(0, K_P2)
    top = tl.zeros([K_P2], tl.float32)
    idx = tl.zeros([K_P2], tl.int64)
    for i in tl.static_range(K):
        m = tl.max(p, axis=0)
        at = tl.minimum(tl.min(tl.where(p == m, e, E_P2), axis=0), E - 1)
        top = tl.where(j == i, m, top)
        idx = tl.where(j == i, at.to(tl.int64), idx)
        p = tl.where(e == at, -1.0, p)
    if NORM == 1:
        top = top / tl.sum(top, axis=0)
    elif NORM == 2:
        top = top / tl.exp2(tl.log2(tl.sum(tl.exp2(tl.log2(top) * norm_p), axis=0)) / norm_p)
    tl.store(w_ptr + t * K + j, top.to(w_ptr.dtype.element_ty), mask=j < K)
    tl.store(ids_ptr + t * K + j, idx, mask=j < K)


@triton.jit
def _combine_kernel(y_ptr, w_ptr, res_ptr, out_ptr, H, K: tl.constexpr, HAS_RES: tl.constexpr,
                    BLOCK: tl.constexpr):
    """out[t] = (residual[t] +) round(sum_j w[t, j] * y[t * K + j]) over a block of columns, sums in fp32."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(K):
        w = tl.load(w_ptr + t * K + j).to(tl.float32)
        acc += w * tl.load(y_ptr + (t * K + j) * H + cols, mask=ok, other=0.0).to(tl.float32)
    out = acc.to(y_ptr.dtype.element_ty)
    if HAS_RES:
        out = (tl.load(res_ptr + t * H + cols, mask=ok, other=0.0).to(tl.float32) + out.to(tl.float32)).to(
            out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * H + cols, out, mask=ok)


@triton.jit
def _sort_kernel(ids_ptr, order_ptr, counts_ptr, N, E, E_P2: tl.constexpr, CHUNK: tl.constexpr):
    """One program: counts per expert, then each pair's sorted row = rows of earlier experts + earlier pairs of
    its own expert (a stable counting sort; chunks of pairs one-hot against the experts, ranks by cumsum)."""
    e = tl.arange(0, E_P2)
    counts = tl.zeros([E_P2], tl.int32)
    for c0 in range(0, N, CHUNK):
        p = c0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + p, mask=p < N, other=-1)
        counts += tl.sum((ids[:, None] == e[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + e, counts, mask=e < E)
    base = tl.cumsum(counts, axis=0) - counts  # first sorted row of each expert, then of its next pair
    for c0 in range(0, N, CHUNK):
        p = c0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + p, mask=p < N, other=-1)
        hot = (ids[:, None] == e[None, :]).to(tl.int32)
        pos = tl.sum(hot * (base[None, :] + tl.cumsum(hot, axis=0) - 1), axis=1)
        tl.store(order_ptr + pos, p.to(tl.int64), mask=p < N)
        base += tl.sum(hot, axis=0)


@triton.jit
def _tile(counts_ptr, pid, E, E_P2: tl.constexpr, BLOCK_M: tl.constexpr):
    """(expert, first sorted row, end of the expert's rows) of row tile `pid`; expert == E past the last tile."""
    e = tl.arange(0, E_P2)
    c = tl.load(counts_ptr + e, mask=e < E, other=0)
    tiles = (c + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, axis=0)
    row_end = tl.cumsum(c, axis=0)
    expert = tl.sum((tile_end <= pid).to(tl.int32), axis=0)
    mine = e == expert
    first_tile = tl.sum(tl.where(mine, tile_end - tiles, 0), axis=0)
    end = tl.sum(tl.where(mine, row_end, 0), axis=0)
    start = end - tl.sum(tl.where(mine, c, 0), axis=0)
    return expert, start + (pid - first_tile) * BLOCK_M, end


@triton.jit
def _tile_rows(order_ptr, row0, end, BLOCK_M: tl.constexpr):
    """(rows [BLOCK_M] of the tile from row0, live: those below the expert's end, order[rows]: their pairs,
    0 where not live)."""
    rows = row0 + tl.arange(0, BLOCK_M)
    live = rows < end
    return rows, live, tl.load(order_ptr + rows, mask=live, other=0)


@triton.jit
def _tile_cols(n_cols, BLOCK_N: tl.constexpr):
    """(cols [BLOCK_N] of this program's column tile, col_ok: those below n_cols)."""
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return cols, cols < n_cols


@triton.jit
def _store_gated(out_ptr, so, rows, live, cols, col_ok, acc_g, acc_u, ACT: tl.constexpr):
    """act(gate) * up of the tile's fp32 accumulators into the sorted rows of out (ACT 0: SiLU; 1: GELU)."""
    if ACT == 0:
        y = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    else:  # GELU, tanh approximation, with tanh(v) = 1 - 2 / (exp(2v) + 1)
        inner = 0.7978845608028654 * (acc_g + 0.044715 * acc_g * acc_g * acc_g)
        y = 0.5 * acc_g * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)) * acc_u
    tl.store(out_ptr + rows[:, None].to(tl.int64) * so + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=live[:, None] & col_ok[None, :])


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:  # fp32 weights: exact products (on GPUs fp32 dots default to tf32)
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _gate_up_kernel(x_ptr, order_ptr, counts_ptr, w_ptr, out_ptr, E, H, INTER, top_k, sx, swe, swn, so,
                    E_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    ACT: tl.constexpr, IEEE: tl.constexpr):
    expert, row0, end = _tile(counts_ptr, tl.program_id(0), E, E_P2, BLOCK_M)
    if expert < E:
        rows, live, pairs = _tile_rows(order_ptr, row0, end, BLOCK_M)
        tok = pairs // top_k
        cols, col_ok = _tile_cols(INTER, BLOCK_N)
        w_e = w_ptr + expert.to(tl.int64) * swe  # the expert's weights; offsets inside them fit 32 bits
        w_gate = cols[None, :] * swn
        w_up = w_gate + INTER * swn
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < H
            xt = tl.load(x_ptr + tok[:, None] * sx + kk[None, :], mask=live[:, None] & k_ok[None, :], other=0.0)
            wmask = k_ok[:, None] & col_ok[None, :]
            wg = tl.load(w_e + (w_gate + kk[:, None]), mask=wmask, other=0.0)  # [BLOCK_K, BLOCK_N]: gate rows^T
            wu = tl.load(w_e + (w_up + kk[:, None]), mask=wmask, other=0.0)
            acc_g = _dot(xt.to(wg.dtype), wg, acc_g, IEEE)
            acc_u = _dot(xt.to(wu.dtype), wu, acc_u, IEEE)
        _store_gated(out_ptr, so, rows, live, cols, col_ok, acc_g, acc_u, ACT)


@triton.jit
def _down_kernel(a_ptr, order_ptr, counts_ptr, w_ptr, y_ptr, E, H, INTER, sa, swe, swn, sy,
                 E_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 IEEE: tl.constexpr):
    expert, row0, end = _tile(counts_ptr, tl.program_id(0), E, E_P2, BLOCK_M)
    if expert < E:
        rows, live, pair = _tile_rows(order_ptr, row0, end, BLOCK_M)
        cols, col_ok = _tile_cols(H, BLOCK_N)
        w_e = w_ptr + expert.to(tl.int64) * swe
        w = cols[None, :] * swn
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < INTER
            at = tl.load(a_ptr + rows[:, None].to(tl.int64) * sa + kk[None, :], mask=live[:, None] & k_ok[None, :],
                         other=0.0)
            wt = tl.load(w_e + (w + kk[:, None]), mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = _dot(at.to(wt.dtype), wt, acc, IEEE)
        tl.store(y_ptr + pair[:, None] * sy + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=live[:, None] & col_ok[None, :])


# (BLOCK_N, BLOCK_K, warps) per tile height, 2-byte weights; chosen so that no variant spills registers on sm_90a
# (benchmarks/moe_compile_check.py). 16-row tiles (decode) take narrow column tiles and long K steps: more
# programs streaming weights, more bytes in flight each. benchmarks/moe.py --sweep times alternatives on a GPU.
TILES: dict[int, tuple[int, int, int]] = {16: (32, 128, 4), 32: (64, 64, 8), 64: (64, 64, 8)}
WAVES = 3  # 0: no narrowing
SORT_MAX_PAIRS = 4096  # (token, expert) pairs the one-program sort takes: 256 decode rows of top-8, and more


def plan(n_pairs: int, n_experts: int, elem_bytes: int = 2, n_out: int = 0, sms: int = 0
         ) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, row tiles) for N pairs over E experts. The tile height follows the mean
    rows per routed expert (known only on the device, so estimated from N and E). With the output width and the
    device's SM count, 16-row tiles halve their column tile while the routed experts' programs would fill the
    device less than WAVES times (Qwen3-MoE's 768-wide gate|up at batch 1: 192 programs on 132 SMs)."""
    routed = max(1, min(n_experts, n_pairs))
    per_expert = n_pairs / routed
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    block_n, block_k, warps = TILES[block_m]
    if block_m == 16:
        block_n = narrow_cols(block_n, routed, n_out, sms, WAVES)
    if elem_bytes > 2:  # fp32 weights (exact dots: tests, fp32 models): a short K step keeps registers
        block_k = 32
    return block_m, block_n, block_k, warps, triton.cdiv(n_pairs, block_m) + routed


def narrow_cols(block_n: int, routed: int, n_out: int, sms: int, waves: int) -> int:
    """A decode tile's column width, halved (down to 16) while `routed` experts' programs over `n_out` output
    columns would fill the device's `sms` SMs less than `waves` times (sms 0 or waves 0: as it is)."""
    while sms and block_n > 16 and routed * triton.cdiv(n_out, block_n) < waves * sms:
        block_n //= 2
    return block_n


def rows_and_out(x: torch.Tensor, n: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x with unit column stride, an empty [n, width] output in x's dtype): a grouped launch's operands."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    return x, torch.empty(n, width, dtype=x.dtype, device=x.device)


def _sms(t: torch.Tensor) -> int:
    return _sm_count(t.device.index if t.device.index is not None else torch.cuda.current_device()) \
        if t.is_cuda else 0


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def fits(w: torch.Tensor) -> bool:
    """The kernels address inside one expert with 32-bit offsets."""
    return w.stride(0) < 2**31 and w.stride(-1) == 1


def moe_route(logits: torch.Tensor, top_k: int, norm_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `reference.moe_route`, one launch (softmax, top-k, renormalisation)."""
    T, E = logits.shape
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    weights = torch.empty(T, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T:
        _route_kernel[(T,)](logits, weights, ids, E, logits.stride(0), float(norm_p or 1.0), K=top_k,
                            K_P2=triton.next_power_of_2(top_k), E_P2=triton.next_power_of_2(E),
                            NORM=0 if not norm_p else 1 if norm_p == 1.0 else 2, num_warps=1 if E <= 256 else 4)
    return weights, ids


def moe_combine(y: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `reference.moe_combine` (+ the residual in the same launch)."""
    T, k = weights.shape
    H = y.shape[-1]
    y = y if y.is_contiguous() else y.contiguous()
    weights = weights if weights.is_contiguous() else weights.contiguous()
    if residual is not None and not residual.is_contiguous():
        residual = residual.contiguous()
    out = torch.empty(T, H, dtype=y.dtype if residual is None else residual.dtype, device=y.device)
    if T:
        block = min(1024, triton.next_power_of_2(H))
        _combine_kernel[(T, triton.cdiv(H, block))](y, weights, residual if residual is not None else y, out, H,
                                                    K=k, HAS_RES=residual is not None, BLOCK=block, num_warps=4)
    return out


def moe_sort(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `reference.moe_sort` (the same stable order), in one launch instead of a sort and a
    scatter: one small kernel per MoE layer of a decode step. Its one program walks the pairs serially in chunks,
    so a prefill's many pairs take torch's parallel sort instead (also free of host syncs)."""
    if ids.numel() > SORT_MAX_PAIRS:
        return reference.moe_sort(ids, num_experts)
    flat = ids.reshape(-1)
    flat = flat if flat.is_contiguous() else flat.contiguous()
    n = flat.shape[0]
    order = torch.empty(n, dtype=torch.int64, device=ids.device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    e_p2 = triton.next_power_of_2(num_experts)
    _sort_kernel[(1,)](flat, order, counts, n, num_experts, E_P2=e_p2, CHUNK=max(16, 8192 // e_p2), num_warps=4)
    return order, counts


def moe_gate_up(x: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor, top_k: int,
                kind: str) -> torch.Tensor:
    """Same contract as `reference.moe_gate_up` (activations silu and gelu_tanh; ops sends others there)."""
    E, two_i, H = w_gate_up.shape
    inter, N = two_i // 2, order.shape[0]
    w = w_gate_up
    if not fits(w):
        return reference.moe_gate_up(x, order, counts, w, top_k, kind)
    x, out = rows_and_out(x, N, inter)
    if N == 0:
        return out
    bm, bn, bk, warps, tiles = plan(N, E, w.element_size(), inter, _sms(x))
    _gate_up_kernel[(tiles, triton.cdiv(inter, bn))](
        x, order, counts, w, out, E, H, inter, top_k, x.stride(0), w.stride(0), w.stride(1), out.stride(0),
        E_P2=triton.next_power_of_2(E), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, ACT=_ACTS[kind],
        IEEE=w.dtype == torch.float32, num_warps=warps, num_stages=STAGES)
    return out


def moe_down(a: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """Same contract as `reference.moe_down`."""
    E, H, inter = w_down.shape
    N = order.shape[0]
    w = w_down
    if not fits(w):
        return reference.moe_down(a, order, counts, w)
    a, y = rows_and_out(a, N, H)
    if N == 0:
        return y
    bm, bn, bk, warps, tiles = plan(N, E, w.element_size(), H, _sms(a))
    _down_kernel[(tiles, triton.cdiv(H, bn))](
        a, order, counts, w, y, E, H, inter, a.stride(0), w.stride(0), w.stride(1), y.stride(0),
        E_P2=triton.next_power_of_2(E), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE=w.dtype == torch.float32,
        num_warps=warps, num_stages=STAGES)
    return y
