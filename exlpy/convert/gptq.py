"""Adaptive GPTQ over EXL2 option layouts (spec §4.6), batched over several (matrix, option) items.

Items that read the same input share its Hessian and so its act order (q/k/v, gate/up, every option of one
matrix during measurement): they are quantized together as one [items, K, N] tensor, one pass over the rows.
Rows are processed in blocks of 32 (every group boundary of the option tables lies on one): inside a block the
error of each row is fed to the rows below it (standard GPTQ; the whole block in one launch, `ops.gptq_block`),
after the block all later rows get the block's correction at once (one batched GEMM), so each group's scales are
chosen on fully corrected weights.

The dequantized values are computed exactly as exlpy's EXL2 reader computes them (fp32, scale = code^2 *
fp16(q_scale_max) / 256), so the error fed back is the error the model will see.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exlpy.convert.qparams import QParams
from exlpy.errors import NumericalError
from exlpy.kernels import ops

BLOCK = 32
# p grid of the per-group max-scale search (spec §4.6: 0.70 to 1.20), searched coarse then fine.
P_LO, P_HI = 0.70, 1.20
SEARCH_COLS = 256
LAZY_ROWS = 2048


@dataclass
class PreparedHessian:
    """Act order and the upper Cholesky factor of the damped inverse Hessian, in act order."""

    perm: torch.Tensor  # [K] int64: sorted row r is input feature perm[r]
    u: torch.Tensor  # [K, K] fp32 upper triangular
    hdiag: torch.Tensor  # [K] fp32 damped diagonal in sorted order (row weights for the scale search)


@dataclass
class QuantResult:
    """One quantized matrix in sorted row order, plus what the packer needs."""

    qparams: QParams
    perm: torch.Tensor  # [K] int64
    groups: list[tuple[int, int]]  # (bits, rows) per group
    codes: torch.Tensor  # [K, N] uint8 stored codes
    qscale: torch.Tensor  # [G, N] int64 scale codes 1..16
    scale_max: torch.Tensor  # [G] fp16
    dq_sorted: torch.Tensor  # [K, N] fp32 dequantized weights, sorted rows

    def dense(self) -> torch.Tensor:
        """[K, N] fp32 in original input-feature order (y = x @ W)."""
        w = torch.empty_like(self.dq_sorted)
        w[self.perm.to(w.device)] = self.dq_sorted
        return w


def prepare_hessian(h: torch.Tensor, damp: float, key: str, perm: torch.Tensor | None = None,
                    act_order: bool = True) -> PreparedHessian:
    """Damp H until its inverse has a Cholesky factor (spec §4.6 steps 1-2), in act order."""
    h = h.float().clone()
    k = h.shape[0]
    diag = torch.diagonal(h)
    if not torch.isfinite(h).all():
        raise NumericalError(f"Hessian of {key} holds NaN or inf (the calibration inputs of this layer are not "
                             "finite)")
    if not bool((diag != 0).any()):
        h = torch.eye(k, dtype=h.dtype, device=h.device)  # no calibration signal at all: plain rounding
        diag = torch.diagonal(h)
    dead = diag == 0
    diag[dead] = 1.0  # inputs that never fire: their rows are rounded alone
    if perm is None:
        perm = torch.argsort(-diag, stable=True) if act_order else torch.arange(k, device=h.device)
    h = h[perm][:, perm]
    step = max(damp * float(torch.diagonal(h).mean()), 1e-5)
    for _ in range(10):
        torch.diagonal(h).add_(step)
        try:
            lower, info = torch.linalg.cholesky_ex(h)
            if int(info) == 0:
                hinv = torch.cholesky_inverse(lower)
                u, info = torch.linalg.cholesky_ex(hinv, upper=True)
                if int(info) == 0 and bool(torch.isfinite(u).all()):
                    return PreparedHessian(perm, u, torch.diagonal(h).clone())
        except RuntimeError:
            pass
    raise NumericalError(f"Hessian of {key} is not invertible after 10 rounds of damping (step "
                         f"{step:.3g}); the layer's calibration inputs are degenerate: use more or more varied "
                         "calibration rows (-r, -l, -c)")


def _fp16_round(x: torch.Tensor) -> torch.Tensor:
    return x.half().float()


def _quant_err(w: torch.Tensor, s: torch.Tensor, maxq: int | torch.Tensor, norm: float,
               weight: torch.Tensor | None) -> torch.Tensor:
    """Σ over rows of weight * |dequant(quant(w)) - w|^norm for scales s broadcast over w [..., R, N] -> [..., N].
    maxq: one width's, or per item [I, 1, 1, 1] (w [I, P, R, N])."""
    z = (maxq + 1) // 2 if isinstance(maxq, torch.Tensor) else float((maxq + 1) // 2)
    e = torch.round(w / s).clamp_(-z, maxq - z).mul_(s).sub_(w)
    e = e.square_() if norm == 2 else e.abs_().pow_(norm)
    if weight is not None:
        e.mul_(weight[:, None])
    return e.sum(-2)


def search_scales(w: torch.Tensor, bits: int | torch.Tensor, norm: float, weight: torch.Tensor | None = None,
                  smax_fixed: torch.Tensor | None = None, plain: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales of groups w [I, R, N] (I items, one group each): (codes 1..16 [I, N] int64, q_scale_max fp16 [I]).
    `bits`: the groups' width, or each item's ([I] int64 tensor: groups of several widths searched at once).

    exllamav2's search (spec §4.6 step 4) picks one factor p for the group's max scale; here it is searched
    coarse-to-fine, then each column's own 4-bit code is refined by +-1, both minimizing the (row-weighted)
    error^norm. With `smax_fixed` [I] (vocabulary slices of the head share the group maximum) only codes are
    searched. `plain`: the nominal codes, no search (the round-to-nearest baseline).
    """
    if isinstance(bits, torch.Tensor):  # exact integers, then fp32 [I, 1, 1, 1]: broadcast over [I, P, R, N]
        maxq = maxq4 = (torch.bitwise_left_shift(torch.ones_like(bits), bits) - 1).float().view(-1, 1, 1, 1)
    else:
        maxq = maxq4 = 2**bits - 1
    dev = w.device
    base = w.abs().amax(1) / (maxq4[:, :, 0, 0] / 2 if isinstance(maxq4, torch.Tensor) else maxq / 2)  # [I, N]
    smax = base.amax(1) if smax_fixed is None else smax_fixed.to(dev, torch.float32)
    smax = torch.where(smax > 0, smax, torch.full_like(smax, 1e-6))
    qs = torch.clamp(torch.round(torch.sqrt(base / smax[:, None]) * 16), 1, 16)

    def scales(qsv: torch.Tensor, smax16: torch.Tensor) -> torch.Tensor:
        return qsv * qsv * (smax16 / 256)

    if plain:
        smax16 = _fp16_round(smax)
        return torch.clamp(torch.ceil(torch.sqrt(base / smax16[:, None]) * 16), 1, 16).long(), smax16.half()
    if smax_fixed is None:
        # The group's one factor p is searched on at most SEARCH_COLS evenly spaced columns (it is a property
        # of the whole group; every column's own code is refined below).
        cols = torch.linspace(0, w.shape[2] - 1, min(w.shape[2], SEARCH_COLS), device=dev).long()
        ws, qss = w[:, :, cols], qs[:, cols]
        lo = torch.full_like(smax, P_LO)
        hi = torch.full_like(smax, P_HI)
        for points in (7, 5):
            t = torch.linspace(0, 1, points, device=dev)
            grid = lo[:, None] + (hi - lo)[:, None] * t  # [I, P]
            sm = _fp16_round(smax[:, None] * grid)
            s = scales(qss[:, None, :], sm[:, :, None])[:, :, None, :]  # [I, P, 1, N]
            err = _quant_err(ws[:, None], s, maxq4, norm, weight).sum(-1)  # [I, P]
            best = torch.gather(grid, 1, torch.argmin(err, 1, keepdim=True)).squeeze(1)
            step = (hi - lo) / (points - 1)
            lo, hi = best - step, best + step
        smax16 = _fp16_round(smax * best)
    else:
        smax16 = _fp16_round(smax)
    smax16 = torch.where(smax16 > 0, smax16, torch.full_like(smax16, 2.0**-24))
    cand = torch.stack([(qs - 1).clamp(min=1), qs, (qs + 1).clamp(max=16)], 1)  # [I, 3, N]
    err = _quant_err(w[:, None], scales(cand, smax16[:, None, None])[:, :, None, :], maxq4, norm, weight)
    pick = torch.argmin(err, 1, keepdim=True)  # [I, 1, N]
    return torch.gather(cand, 1, pick).squeeze(1).long(), smax16.half()


@dataclass
class _GroupStart:
    """Items whose groups of one height start at one row: one batched scale search over all their widths."""

    bits: int | torch.Tensor  # the width, or per item [I] (int64) when they differ
    rows: int
    items: torch.Tensor  # [I] int64 on the device
    groups: torch.Tensor  # [I] int64: each item's group index
    zero: torch.Tensor  # [I, 1] fp32: 2^(bits-1)
    maxq: torch.Tensor  # [I, 1] fp32: 2^bits - 1


def _schedule(k: int, layouts: list[list[tuple[int, int]]], dev: torch.device
              ) -> list[tuple[int, int, list[_GroupStart]]]:
    """(first row, end row, groups starting there) per block of rows. Every block boundary is a multiple of
    BLOCK or a group boundary of some item, so each item's group starts at a block's first row. Groups of one
    height starting together are searched together whatever their widths (every candidate configuration of a
    matrix in one search). The index tensors of all blocks go to the device in one copy (one per block would
    synchronize the host each time)."""
    starts: dict[int, dict[int, list[tuple[int, int, int]]]] = {}
    for i, groups in enumerate(layouts):
        r = 0
        for g, (bits, rows) in enumerate(groups):
            starts.setdefault(r, {}).setdefault(rows, []).append((i, g, bits))
            r += rows
    cuts = sorted(set(range(0, k, BLOCK)) | {r for r in starts if r < k}) + [k]
    todo = [(r, rows, ig) for r in cuts[:-1] for rows, ig in starts.get(r, {}).items()]
    idx = torch.tensor([x for _, _, ig in todo for col in (0, 1) for x in (t[col] for t in ig)],
                       dtype=torch.int64).to(dev)
    widths = [t[2] for _, _, ig in todo for t in ig]
    bits = torch.tensor(widths, dtype=torch.int64).to(dev)
    zero = torch.tensor([2.0 ** (b - 1) for b in widths], dtype=torch.float32).to(dev)
    maxq = torch.tensor([2.0**b - 1 for b in widths], dtype=torch.float32).to(dev)
    plan: list[tuple[int, int, list[_GroupStart]]] = [(b0, b1, []) for b0, b1 in zip(cuts[:-1], cuts[1:])]
    row_of = {b0: j for j, (b0, _, _) in enumerate(plan)}
    pos = bpos = 0
    for r, rows, ig in todo:
        n = len(ig)
        kinds = {t[2] for t in ig}
        b = kinds.pop() if len(kinds) == 1 else bits[bpos:bpos + n]
        plan[row_of[r]][2].append(_GroupStart(b, rows, idx[pos:pos + n], idx[pos + n:pos + 2 * n],
                                              zero[bpos:bpos + n, None], maxq[bpos:bpos + n, None]))
        pos += 2 * n
        bpos += n
    return plan


def gptq_quantize(ws: list[torch.Tensor], options: list[QParams], ph: PreparedHessian, norm: float = 2.4,
                  smax_fixed: list[list[float]] | None = None, rtn: bool = False, plain_scales: bool = False
                  ) -> list[QuantResult]:
    """Quantize items ws[i] ([K, N_i] fp32, y = x @ W, original row order) with options[i], sharing `ph`.

    smax_fixed[i][g]: fixed per-group max scales (head slices). rtn: no error feedback (round-to-nearest);
    plain_scales: no scale search (the round-to-nearest baseline).

    Everything stays on the device: per block of rows one scale search per height of the groups starting
    there (all widths at once), one launch for the block's rows (`ops.gptq_block`), one batched GEMM for the
    later rows; nothing is read back on the host. Each item's result is what quantizing it alone gives (bit for
    bit on the CPU; a GPU may order a reduction's sums differently for another batch).
    """
    dev = ph.u.device
    k = ph.u.shape[0]
    n_max = max(w.shape[1] for w in ws)
    o = len(ws)
    wq = torch.zeros(o, k, n_max, dtype=torch.float32, device=dev)
    for i, w in enumerate(ws):
        wq[i, :, :w.shape[1]] = w.to(dev, torch.float32)[ph.perm]
    codes = torch.zeros(o, k, n_max, dtype=torch.uint8, device=dev)
    layouts = [opt.groups(k) for opt in options]
    g_max = max(len(g) for g in layouts)
    # Per item and group: scale codes (columns past an item's width are never read) and max scales.
    qscale = torch.ones(o, g_max, n_max, dtype=torch.int64, device=dev)
    smaxs = torch.zeros(o, g_max, dtype=torch.float16, device=dev)
    fixed = None
    if smax_fixed is not None:
        fixed = torch.tensor([list(f) + [0.0] * (g_max - len(f)) for f in smax_fixed], dtype=torch.float32).to(dev)
    s_cur = torch.ones(o, n_max, device=dev)
    z_cur = torch.zeros(o, 1, device=dev)
    maxq_cur = torch.zeros(o, 1, device=dev)
    u = ph.u
    weight = ph.hdiag
    for b0, b1, todo in _schedule(k, layouts, dev):
        for st in todo:
            sm_fixed = None if fixed is None else fixed[st.items, st.groups]
            qs, sm = search_scales(wq[st.items, b0:b0 + st.rows], st.bits, norm, weight[b0:b0 + st.rows], sm_fixed,
                                   plain_scales)
            qscale[st.items, st.groups] = qs
            smaxs[st.items, st.groups] = sm
            s_cur[st.items] = qs.float() ** 2 * (sm.float()[:, None] / 256)
            z_cur[st.items] = st.zero
            maxq_cur[st.items] = st.maxq
        err = torch.empty(o, b1 - b0, n_max, device=dev)
        ops.gptq_block(wq[:, b0:b1], u[b0:b1, b0:b1], s_cur, z_cur, maxq_cur, codes[:, b0:b1], err, rtn)
        if not rtn and b1 < k:
            # All later rows get this block's correction; in row slices so the temporary stays small.
            for r0 in range(b1, k, LAZY_ROWS):
                r1 = min(r0 + LAZY_ROWS, k)
                wq[:, r0:r1] -= torch.matmul(u[b0:b1, r0:r1].t(), err)
    out = []
    for i, w in enumerate(ws):
        n, g = w.shape[1], len(layouts[i])
        # Views, not copies: the caller keeps what it needs (measurement keeps only dense fp16 weights).
        out.append(QuantResult(options[i], ph.perm, layouts[i], codes[i, :, :n], qscale[i, :g, :n], smaxs[i, :g],
                               wq[i, :, :n]))
    return out


def refine_rounding(ws: list[torch.Tensor], results: list[QuantResult], h: torch.Tensor, damp: float,
                    passes: int) -> list[QuantResult]:
    """Learned rounding: re-choose every code of the GPTQ results by cyclic coordinate descent on the layer's
    output error tr((Q - W)ᵀ H (Q - W)), scales fixed (QuantEase, Behdin et al. 2023).

    GPTQ rounds each row once, seeing only the error of the rows before it; here each row is revisited with the
    error of all the others: its best value is W_k + ... = Q_k - (H E)_k / H_kk, rounded on its group's grid,
    which is the exact minimum over that row's codes, so the error never grows. Rows go in blocks of 32 with the
    block's correction applied to later rows by one GEMM (GPTQ's lazy batching); a pass costs about one GPTQ.
    ws: the targets [K, N_i] in original row order (the source or the asymmetric weights); h: their Hessian,
    damped as GPTQ damps it."""
    if passes <= 0 or not results:
        return results
    perm = results[0].perm
    dev = results[0].dq_sorted.device
    k = perm.numel()
    o = len(results)
    n_max = max(r.dq_sorted.shape[1] for r in results)
    hs = h.to(dev, torch.float32)[perm][:, perm].clone()
    torch.diagonal(hs).add_(max(damp * float(torch.diagonal(hs).mean()), 1e-5))
    hkk = torch.diagonal(hs).clone()
    w = torch.zeros(o, k, n_max, device=dev)
    dq = torch.zeros(o, k, n_max, device=dev)
    codes = torch.zeros(o, k, n_max, dtype=torch.uint8, device=dev)
    s = torch.ones(o, k, n_max, device=dev)
    z = torch.zeros(o, k, 1, device=dev)
    maxq = torch.zeros(o, k, 1, device=dev)
    for i, (wi, r) in enumerate(zip(ws, results)):
        n = r.dq_sorted.shape[1]
        w[i, :, :n] = wi.to(dev, torch.float32)[perm]
        dq[i, :, :n] = r.dq_sorted
        codes[i, :, :n] = r.codes
        r0 = 0
        for g, (bits, rows) in enumerate(r.groups):
            s[i, r0:r0 + rows, :n] = (r.qscale[g].float() ** 2 * (r.scale_max[g].float() / 256))[None]
            z[i, r0:r0 + rows] = float(2 ** (bits - 1))
            maxq[i, r0:r0 + rows] = float(2**bits - 1)
            r0 += rows
    qscale = [r.qscale.clone() for r in results]
    codes16 = torch.arange(1, 17, device=dev, dtype=torch.float32)
    for _ in range(passes):
        # Scales first: per group and column, the 4-bit scale code of least error with the codes fixed. With
        # u = q - z on the group's rows and δ the change of scale, the error changes by 2δ·uᵀ(HE) + δ²·uᵀHu.
        g_all = torch.matmul(hs, dq - w)
        for i, r in enumerate(results):
            n = r.dq_sorted.shape[1]
            r0 = 0
            for g, (_bits, rows) in enumerate(r.groups):
                sl = slice(r0, r0 + rows)
                u = codes[i, sl, :n].float() - z[i, sl]
                a = (u * g_all[i, sl, :n]).sum(0)
                b = (u * torch.matmul(hs[sl, sl], u)).sum(0)
                cand = codes16[:, None] ** 2 * (r.scale_max[g].float() / 256)  # [16, 1]
                delta = cand - s[i, r0, :n][None]  # [16, N]
                pick = torch.argmin(2 * delta * a + delta * delta * b, 0)
                qscale[i][g] = pick + 1
                s_new = cand[:, 0][pick]  # exactly the reader's scale of the new code
                new = u * s_new
                de = new - dq[i, sl, :n]
                s[i, sl, :n] = s_new
                dq[i, sl, :n] = new
                g_all[i, :, :n] += torch.matmul(hs[:, sl], de)
                r0 += rows
        g_all = torch.matmul(hs, dq - w)  # [o, K, N]: H E, kept current for the rows still to visit
        for b0 in range(0, k, BLOCK):
            b1 = min(b0 + BLOCK, k)
            de = torch.zeros(o, b1 - b0, n_max, device=dev)
            for j in range(b0, b1):
                v = dq[:, j] - g_all[:, j] / hkk[j]
                q = torch.clamp(torch.round(v / s[:, j]) + z[:, j], min=torch.zeros_like(z[:, j]), max=maxq[:, j])
                new = (q - z[:, j]) * s[:, j]
                d = new - dq[:, j]
                dq[:, j] = new
                codes[:, j] = q.to(torch.uint8)
                de[:, j - b0] = d
                if j + 1 < b1:
                    g_all[:, j + 1:b1] += hs[j + 1:b1, j].view(1, -1, 1) * d.unsqueeze(1)
            if b1 < k:
                for r0 in range(b1, k, LAZY_ROWS):
                    r1 = min(r0 + LAZY_ROWS, k)
                    g_all[:, r0:r1] += torch.matmul(hs[r0:r1, b0:b1], de)
    out = []
    for i, r in enumerate(results):
        n = r.dq_sorted.shape[1]
        out.append(QuantResult(r.qparams, r.perm, r.groups, codes[i, :, :n], qscale[i], r.scale_max, dq[i, :, :n]))
    return out
