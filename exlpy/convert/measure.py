"""Measurement (spec §4.3): every option of a module's table, quantized and run on the calibration rows.

Each linear is quantized once per distinct option of its slot (all options of the matrices that share an input
in one batched GPTQ pass), then every combination of the table runs the module's own forward with those weights
and is scored against the unquantized output: `accuracy` = 1 - mean relative Frobenius error (exllamav2's
figure) and `err` = mean relative squared error per token, which adds up over layers and is what the optimizer
minimizes.
"""

from __future__ import annotations

from typing import Any

import torch

from exlpy.convert.forward import Hessian, States, forward_chunks, install_taps, iter_outputs
from exlpy.convert.gptq import gptq_quantize, prepare_hessian
from exlpy.convert.layers import OPTIONS, check_source, has_bias, hessian_groups, read_weight, shapes
from exlpy.convert.qparams import QParams, distinct
from exlpy.errors import NumericalError
from exlpy.model.module import Module


def output_errors(module: Module, states: States, ref: States, device: torch.device) -> tuple[float, float]:
    """(mean relative Frobenius error per row, exllamav2's figure; mean relative squared error per token).

    The optimizer uses the per-token figure: a row's norm is dominated by its first token, whose hidden state
    grows hundreds of times larger than the others' in the middle layers (an attention sink), so per-row
    errors measure little but that one token and make the layers after the sink look nearly free to quantize.
    """
    rel: list[torch.Tensor] = []
    tok: list[torch.Tensor] = []
    for y, r in zip(iter_outputs(module, states, device), ref.chunks):
        r = r.to(device).float()
        d = y.float() - r
        rel.append(d.flatten(1).norm(dim=1) / r.flatten(1).norm(dim=1).clamp(min=1e-20))
        tok.append((d.pow(2).sum(-1) / r.pow(2).sum(-1).clamp(min=1e-20)).flatten())
    e = torch.cat(rel)
    t = torch.cat(tok)
    if not bool(torch.isfinite(e).all()) or not bool(torch.isfinite(t).all()):
        raise NumericalError(f"Measurement/inference error (1): the quantized {module.key} gives non-finite "
                             "outputs")
    return float(e.mean()), float(t.mean())


def measure_module(module: Module, states: States, device: torch.device, store: torch.device, damp: float,
                   norm: float) -> tuple[list[dict[str, Any]], States]:
    """The measurement entries of a loaded decoder module, and its reference outputs (the next inputs)."""
    check_source(module)
    kind = type(module)
    taps = install_taps(module)
    hessians = {}
    for rec, _ in hessian_groups(module):
        hessians[rec] = Hessian(taps[rec].in_features, device)
        taps[rec].record = hessians[rec].add
    ref = forward_chunks(module, states, device, store, module.key)
    assert ref is not None
    for t in taps.values():
        t.reset()
    options = OPTIONS[kind]
    dtype = module.dtype(device)
    dense: dict[tuple[str, QParams], torch.Tensor] = {}
    for rec, keys in hessian_groups(module):
        ph = prepare_hessian(hessians.pop(rec).result(), damp, f"{module.key}.{rec}")
        ws, opts, names = [], [], []
        for k in keys:
            w = read_weight(module.index, f"{module.key}.{k}.weight", device)
            for o in distinct(options, k):
                ws.append(w)
                opts.append(o)
                names.append(k)
        for name, o, res in zip(names, opts, gptq_quantize(ws, opts, ph, norm=norm)):
            dense[(name, o)] = res.dense().to(dtype)
        del ws, ph
    sh = shapes(module)
    entries = []
    for option in options:
        for k, t in taps.items():
            t.set_weight(dense[(k, option[k])], dtype)
        rfn, err = output_errors(module, states, ref, device)
        entry: dict[str, Any] = {"accuracy": max(1e-6, 1.0 - rfn), "err": err,
                                 "total_bits": sum(option[k].total_bits(*sh[k], has_bias(module, k)) for k in sh)}
        entry.update({k: option[k].to_dict() for k in sh})
        entries.append(entry)
    if max(e["accuracy"] for e in entries) < 0.1:
        raise NumericalError(f"Measurement/inference error (1): the best option of {module.key} keeps less than "
                             "10% accuracy")
    return entries, ref
