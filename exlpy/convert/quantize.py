"""Quantization (spec §4.6): each decoder module with its chosen options, then the head in vocabulary slices.

Inputs are the previous module's *quantized* outputs. Inside a module the linears are quantized in forward
order, and the input of o_proj / down_proj is recorded after the linears before them were quantized, so every
Hessian describes the inputs the quantized model will really see.
"""

from __future__ import annotations

import torch

from exlpy.convert.forward import Hessian, States, _run, forward_chunks, install_taps, run_chunk
from exlpy.convert.gptq import QuantResult, gptq_quantize, prepare_hessian
from exlpy.convert.layers import check_source, hessian_groups, read_bias, read_weight
from exlpy.convert.packing import check_packed, pack_exl2
from exlpy.convert.qparams import HEAD_OPTIONS, QParams
from exlpy.model.batch import contiguous_batch
from exlpy.model.module import Module


def quantize_module(module: Module, states: States, device: torch.device, store: torch.device,
                    option: dict[str, QParams], damp: float, norm: float, act_order: str = "auto"
                    ) -> tuple[dict[str, torch.Tensor], States, float]:
    """(packed tensors, quantized outputs, relative error of the first chunk's output) of a loaded module."""
    check_source(module)
    taps = install_taps(module)
    dtype = module.dtype(device)
    tensors: dict[str, torch.Tensor] = {}
    for rec, keys in hessian_groups(module):
        h = Hessian(taps[rec].in_features, device)
        taps[rec].record, taps[rec].stop = h.add, True
        forward_chunks(module, states, device, None, module.key)
        taps[rec].reset()
        hm = h.result()
        del h
        ws = [read_weight(module.index, f"{module.key}.{k}.weight", device) for k in keys]
        results = quantize_best_order(ws, [option[k] for k in keys], hm, damp, norm, f"{module.key}.{rec}",
                                      act_order)
        del ws, hm
        for k, res in zip(keys, results):
            prefix = f"{module.key}.{k}"
            packed = pack_exl2(res, prefix, read_bias(module.index, prefix))
            check_packed(packed, res, prefix)
            tensors.update(packed)
            taps[k].set_weight(res.dense(), dtype)
    out = forward_chunks(module, states, device, store, module.key)
    assert out is not None
    # Relative error against the unquantized module on the first chunk: the figure the summary reports.
    yq = out.chunks[0].to(device).float()
    for t in taps.values():
        t.set_weight(None, dtype)
    y = run_chunk(module, states, 0, device).float()
    rfn = float(((yq - y).flatten(1).norm(dim=1) / y.flatten(1).norm(dim=1).clamp(min=1e-20)).mean())
    return tensors, out, rfn


def proxy_error(ws: list[torch.Tensor], results: list[QuantResult], h: torch.Tensor) -> float:
    """Σ over items of tr(ΔWᵀ H ΔW) / tr(Wᵀ H W): the relative output error on the calibration inputs."""
    num = den = 0.0
    for w, r in zip(ws, results):
        d = r.dense() - w
        num += float((h @ d * d).sum())
        den += float((h @ w * w).sum())
    return num / max(den, 1e-30)


def quantize_best_order(ws: list[torch.Tensor], options: list[QParams], h: torch.Tensor, damp: float, norm: float,
                        key: str, act_order: str = "auto") -> list[QuantResult]:
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
    return best


def head_hessian(norm_module: Module, states: States, device: torch.device) -> Hessian:
    """Hessian of the head's input: the final norm's output over the calibration rows."""
    h = Hessian(norm_module.spec.hidden_size, device)
    for x in states.chunks:
        xd = x.to(device)
        h.add(_run(norm_module, xd, contiguous_batch(xd.shape[0], xd.shape[1], 0, None, 0, device)))
    return h


def quantize_head(index: object, weight_name: str, h: torch.Tensor, head_bits: int, device: torch.device,
                  slice_cols: int, damp: float, norm: float, sample: torch.Tensor | None = None,
                  norm_rows: bool = False) -> tuple[dict[str, torch.Tensor], float]:
    """The head in slices of `slice_cols` vocabulary columns (a multiple of 32), so its GPU memory stays that of
    one decoder matrix. The group max scales are shared by every slice, fixed from the whole matrix first.
    `sample`: normed hidden states [T, K] to report the head's relative output error on. `norm_rows`: the
    config's `norm_head` (Index): the head the model computes with has its vocabulary rows L2-normalized, which
    the loader does only for an unquantized head, so the quantized one is made from the normalized rows."""
    vocab, k = index.info(weight_name).shape  # type: ignore[attr-defined]

    def read(n0: int) -> torch.Tensor:
        w = read_weight(index, weight_name, device, slice(n0, n0 + slice_cols))  # type: ignore[arg-type]
        return w / w.norm(dim=0, keepdim=True).clamp_min(1e-12) if norm_rows else w

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
