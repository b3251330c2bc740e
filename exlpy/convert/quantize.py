"""Quantization (spec §4.6): each decoder module with its chosen options, then the head in vocabulary slices.

Inputs are the previous module's *quantized* outputs. Inside a module the linears are quantized in forward
order, and the input of o_proj / down_proj is recorded after the linears before them were quantized, so every
Hessian describes the inputs the quantized model will really see.

The target is the unquantized model's output (asymmetric calibration, as GPTAQ, Li et al. 2025): the source
model's hidden states run beside the quantized ones, and each linear's input X (source) is recorded with the
quantized model's input X̃ of the same tokens. The least-squares weights for X̃ are
W* = W + (X̃ᵀX̃ + λI)⁻¹ X̃ᵀ(X - X̃) W, and since the residual of that fit is orthogonal to X̃,
‖XW - X̃Q‖² = ‖XW - X̃W*‖² + tr((W* - Q)ᵀ X̃ᵀX̃ (W* - Q)): GPTQ of W* under X̃'s Hessian minimizes the error to
the source output, where GPTQ of W minimizes only the error to what the already-quantized inputs would give.
"""

from __future__ import annotations

import contextlib

import torch

from exlpy.convert.blocktune import tunable, tune_block
from exlpy.convert.forward import (
    Hessian,
    States,
    StopForward,
    Tap,
    _chunk_batch,
    _run,
    forward_chunks,
    install_taps,
    module_input,
    run_chunk,
)
from exlpy.convert.gptq import QuantResult, gptq_quantize, prepare_hessian, refine_rounding
from exlpy.convert.layers import check_source, hessian_groups, read_bias, read_weight
from exlpy.convert.packing import check_packed, pack_exl2
from exlpy.convert.qparams import HEAD_OPTIONS, QParams
from exlpy.model.batch import contiguous_batch
from exlpy.model.module import Module


def quantize_module(module: Module, states: States, device: torch.device, store: torch.device,
                    option: dict[str, QParams], damp: float, norm: float, act_order: str = "auto",
                    ref: States | None = None, rounding_passes: int = 0, tune_steps: int = 0,
                    tune_tokens: int = 1024, tune_norms: bool = False
                    ) -> tuple[dict[str, torch.Tensor], States, States | None, float]:
    """(packed tensors, quantized outputs, source outputs, relative error of the first chunk's output) of a
    loaded module. `states`: the quantized model's inputs; `ref`: the source model's inputs of the same rows
    (then every linear targets the source output, see the module docstring; None: GPTQ of the source weights).
    `rounding_passes`: passes of learned rounding after GPTQ (gptq.refine_rounding; 0: GPTQ's own rounding).
    `tune_steps`: steps of block-wise output tuning of all the module's linears together, about `tune_tokens`
    calibration tokens each (blocktune.tune_block; 0: none); `tune_norms`: the block's input-norm weight tuned with
    them, and written with the module's tensors in place of the source's."""
    check_source(module)
    taps = install_taps(module)
    dtype = module.dtype(device)
    done: dict[str, torch.Tensor] = {}  # dense quantized weights of the linears already quantized
    quantized: dict[str, QuantResult] = {}
    sources: dict[str, torch.Tensor] = {}
    for rec, keys in hessian_groups(module):
        hm, cross = record_inputs(module, taps, rec, done, states, ref, device)
        ws = [read_weight(module.index, f"{module.key}.{k}.weight", device) for k in keys]
        targets = ws if cross is None else asymmetric_targets(ws, hm, cross, damp)
        results = quantize_best_order(targets, [option[k] for k in keys], hm, damp, norm, f"{module.key}.{rec}",
                                      act_order, rounding_passes)
        del hm, cross
        for k, w, res in zip(keys, ws, results):
            quantized[k] = res
            if tune_steps > 0:  # the source weights are held only for the block tuning's targets
                sources[k] = w
            done[k] = res.dense()
            taps[k].set_weight(done[k], dtype)
        del ws, targets, results
    source_norm = getattr(module, "norm_w", None)
    tensors: dict[str, torch.Tensor] = {}
    if tune_steps > 0 and tunable(module):
        tuned = tune_block(module, taps, quantized, sources, states, device, tune_steps, tune_tokens, tune_norms)
        quantized = tuned.results
        if tuned.norm is not None and tuned.norm_name is not None:
            tensors[tuned.norm_name] = tuned.norm  # the compiler writes it instead of the source's
    del sources
    for k, res in quantized.items():
        prefix = f"{module.key}.{k}"
        packed = pack_exl2(res, prefix, read_bias(module.index, prefix))
        check_packed(packed, res, prefix)
        tensors.update(packed)
    out = forward_chunks(module, states, device, store, module.key)
    assert out is not None
    # Relative error against the unquantized module on the first chunk: the figure the summary reports.
    yq = out.chunks[0].to(device).float()
    for t in taps.values():
        t.set_weight(None, dtype)
    if source_norm is not None:
        module.norm_w = source_norm  # type: ignore[attr-defined]  # the unquantized module: the source's norm
    y = run_chunk(module, states, 0, device).float()
    rfn = float(((yq - y).flatten(1).norm(dim=1) / y.flatten(1).norm(dim=1).clamp(min=1e-20)).mean())
    ref_out = forward_chunks(module, ref, device, store, module.key) if ref is not None else None
    return tensors, out, ref_out, rfn


def record_inputs(module: Module, taps: dict[str, Tap], rec: str, done: dict[str, torch.Tensor], states: States,
                  ref: States | None, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(X̃ᵀX̃ / rows, X̃ᵀX / rows or None) of the input of linear `rec`: X̃ with the linears in `done` quantized
    on the quantized states, X with the source weights on the source states (`ref`), chunk by chunk."""
    dtype = module.dtype(device)
    tap = taps[rec]
    h = Hessian(tap.in_features, device)
    cross = torch.zeros_like(h.h) if ref is not None else None
    seen: list[torch.Tensor] = []

    def run(st: States, i: int, quantized: bool) -> torch.Tensor:
        for k, t in taps.items():
            if k in done:
                t.set_weight(done[k] if quantized else None, dtype)
        seen.clear()
        tap.record, tap.stop = seen.append, True
        xd = module_input(st.chunks[i], device)
        with contextlib.suppress(StopForward):
            _run(module, xd, _chunk_batch(module, st, i, xd, device))
        tap.reset()
        return seen[0]

    for i in range(len(states.chunks)):
        xq = run(states, i, True)
        h.add(xq)
        if cross is not None:
            assert ref is not None
            x = run(ref, i, False)
            xq2, x2 = xq.reshape(-1, xq.shape[-1]), x.reshape(-1, x.shape[-1])
            for a in range(0, xq2.shape[0], 8192):
                cross.addmm_(xq2[a:a + 8192].float().t(), x2[a:a + 8192].float())
            del x, x2
        del xq
    for k, t in taps.items():
        if k in done:
            t.set_weight(done[k], dtype)
    rows = max(1, h.rows)
    return h.result(), (cross / rows if cross is not None else None)


def correction(h: torch.Tensor, cross: torch.Tensor, damp: float) -> torch.Tensor:
    """M = I + (H + λI)⁻¹ (C - H), so that W* = M W (identity when the quantized inputs equal the source's);
    λ is GPTQ's damping, which also keeps the fit from chasing noise on few calibration rows."""
    k = h.shape[0]
    hd = h.double()
    lam = max(damp * float(torch.diagonal(hd).mean()), 1e-8)
    a = hd + lam * torch.eye(k, dtype=hd.dtype, device=hd.device)
    lower, info = torch.linalg.cholesky_ex(a)
    if int(info) != 0 or not bool(torch.isfinite(cross).all()):
        return torch.eye(k, dtype=h.dtype, device=h.device)  # degenerate inputs: keep the plain GPTQ target
    m = torch.cholesky_solve(cross.double() - hd, lower)
    m.diagonal().add_(1.0)
    return m.float()


def asymmetric_targets(ws: list[torch.Tensor], h: torch.Tensor, cross: torch.Tensor, damp: float
                       ) -> list[torch.Tensor]:
    """The weights W* = M W that best reproduce the source output from the quantized inputs."""
    m = correction(h, cross, damp)
    return [m @ w for w in ws]


def proxy_error(ws: list[torch.Tensor], results: list[QuantResult], h: torch.Tensor) -> float:
    """Σ over items of tr(ΔWᵀ H ΔW) / tr(Wᵀ H W): the relative output error on the calibration inputs."""
    num = den = 0.0
    for w, r in zip(ws, results):
        d = r.dense() - w
        num += float((h @ d * d).sum())
        den += float((h @ w * w).sum())
    return num / max(den, 1e-30)


def quantize_best_order(ws: list[torch.Tensor], options: list[QParams], h: torch.Tensor, damp: float, norm: float,
                        key: str, act_order: str = "auto", rounding_passes: int = 0) -> list[QuantResult]:
    """GPTQ in act order ("on"), in the natural row order ("off"), or both, keeping the order whose output
    error on the calibration inputs is lower ("auto"). Act order usually wins; the natural order wins where the
    weights still carry the block structure of an earlier quantization (models distilled from GGUF files)."""
    orders = {"on": [True], "off": [False], "auto": [True, False]}[act_order]
    best, best_err = None, float("inf")
    for ao in orders:
        res = gptq_quantize(ws, options, prepare_hessian(h, damp, key, act_order=ao), norm=norm)
        err = proxy_error(ws, res, h) if len(orders) > 1 else 0.0
        if err < best_err:
            best, best_err = res, err
    assert best is not None
    return refine_rounding(ws, best, h, damp, rounding_passes)


def head_hessian(norm_module: Module, states: States, device: torch.device, ref: States | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(X̃ᵀX̃ / rows, X̃ᵀX / rows or None) of the head's input: the final norm's output over the calibration
    rows, X̃ from the quantized model's states, X from the source model's (`ref`)."""
    h = Hessian(norm_module.spec.hidden_size, device)
    cross = torch.zeros_like(h.h) if ref is not None else None

    def normed(st: States, i: int) -> torch.Tensor:
        xd = module_input(st.chunks[i], device)
        y = _run(norm_module, xd, contiguous_batch(xd.shape[0], xd.shape[1], 0, None, 0, device))
        return y.reshape(-1, y.shape[-1])

    for i in range(len(states.chunks)):
        xq = normed(states, i)
        h.add(xq)
        if cross is not None:
            assert ref is not None
            x = normed(ref, i)
            for a in range(0, xq.shape[0], 8192):
                cross.addmm_(xq[a:a + 8192].float().t(), x[a:a + 8192].float())
    rows = max(1, h.rows)
    return h.result(), (cross / rows if cross is not None else None)


def quantize_head(index: object, weight_name: str, h: torch.Tensor, head_bits: int, device: torch.device,
                  slice_cols: int, damp: float, norm: float, sample: torch.Tensor | None = None,
                  norm_rows: bool = False, cross: torch.Tensor | None = None) -> tuple[dict[str, torch.Tensor], float]:
    """The head in slices of `slice_cols` vocabulary columns (a multiple of 32), so its GPU memory stays that of
    one decoder matrix. The group max scales are shared by every slice, fixed from the whole matrix first.
    `sample`: normed hidden states [T, K] to report the head's relative output error on. `norm_rows`: the
    config's `norm_head` (Index): the head the model computes with has its vocabulary rows L2-normalized, which
    the loader does only for an unquantized head, so the quantized one is made from the normalized rows.
    `cross`: X̃ᵀX / rows (head_hessian with the source states): every slice targets the source logits."""
    vocab, k = index.info(weight_name).shape  # type: ignore[attr-defined]
    m = correction(h, cross, damp) if cross is not None else None

    def read(n0: int) -> torch.Tensor:
        w = read_weight(index, weight_name, device, slice(n0, n0 + slice_cols))  # type: ignore[arg-type]
        w = w / w.norm(dim=0, keepdim=True).clamp_min(1e-12) if norm_rows else w
        return m @ w if m is not None else w

    option = HEAD_OPTIONS[head_bits]
    ph = prepare_hessian(h, damp, "lm_head")
    groups = option.groups(k)
    bounds = [0]
    for _, rows in groups:
        bounds.append(bounds[-1] + rows)
    smax = [0.0] * len(groups)
    for n0 in range(0, vocab, slice_cols):
        w = read(n0)[ph.perm]
        for g, (b, _) in enumerate(groups):
            smax[g] = max(smax[g], float(w[bounds[g]:bounds[g + 1]].abs().max()) / ((2**b - 1) / 2))
    parts: list[dict[str, torch.Tensor]] = []
    num = den = 0.0
    for n0 in range(0, vocab, slice_cols):
        w = read(n0)
        res: QuantResult = gptq_quantize([w], [option], ph, norm=norm, smax_fixed=[smax])[0]
        packed = pack_exl2(res, "lm_head")
        check_packed(packed, res, "lm_head")
        parts.append(packed)
        if sample is not None:
            s = sample.to(device, torch.float32)
            y, yq = s @ w, s @ res.dense()
            num += float((yq - y).pow(2).sum())
            den += float(y.pow(2).sum())
        del w, res
    out = dict(parts[0])
    for name in ("q_weight", "q_scale"):
        out[f"lm_head.{name}"] = torch.cat([p[f"lm_head.{name}"] for p in parts], dim=1)
    for p in parts[1:]:
        assert torch.equal(p["lm_head.q_scale_max"], out["lm_head.q_scale_max"])
    return out, (num / den) ** 0.5 if den > 0 else 0.0
