"""Measurement and quantization of mixture-of-experts blocks (Mixtral, Qwen3-MoE): every expert quantized, the
router kept as it is stored (fp16 in the output, like the norms).

A block is one slot of the optimizer with the MLP option table: an option gives every expert's gate, up and down
the same QParams (exllamav2's choice too). What differs per expert is its calibration: expert e's gate|up Hessian
comes from the tokens the router sends to it, and its down Hessian from act(gate_e) * up_e on those tokens (in
the quantize stage with e's gate and up already quantized, as for a dense MLP). The router leaves some experts
few tokens, so each expert's Hessian is blended with the same statistic over every token of the layer, weighted
as PRIOR_ROWS routed rows: a well-fed expert is calibrated on its own tokens, one that no token reached on the
layer's whole input instead of on nothing. The tokens each expert got are reported (measurement and quantization
entries of the job, the summary's minimum).

The block runs its own forward for every figure (reference outputs, errors, the quantized outputs passed on), with
its dense expert stacks (`MoEMLP.w_gate_up / w_down`) overwritten by the quantized experts' weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from exlpy.convert.forward import States, forward_chunks, run_chunk
from exlpy.convert.gptq import QuantResult, gptq_quantize, prepare_hessian
from exlpy.convert.layers import check_source, module_bits, read_weight
from exlpy.convert.measure import output_errors
from exlpy.convert.packing import check_packed
from exlpy.convert.qparams import MLP_KEYS, MLP_OPTIONS, QParams, distinct
from exlpy.errors import NumericalError
from exlpy.kernels import reference
from exlpy.model.moe import MoEMLP

PRIOR_ROWS = 64  # weight, in routed rows, of the layer-wide statistic blended into each expert's Hessian


def _act(module: MoEMLP, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return reference.act_mul(g, u, module.act)


class _Blend:
    """Σ xᵀx over an expert's routed rows and over all rows, then (routed + PRIOR_ROWS · all / rows) / (routed
    rows + PRIOR_ROWS): the expert's Hessian with the layer-wide one as its prior."""

    def __init__(self, k: int, device: torch.device) -> None:
        self.own = torch.zeros(k, k, dtype=torch.float32, device=device)
        self.all = torch.zeros(k, k, dtype=torch.float32, device=device)
        self.rows = self.total = 0

    def add(self, x: torch.Tensor, mask: torch.Tensor) -> None:
        xf = x.float()
        self.all.addmm_(xf.t(), xf)
        self.total += x.shape[0]
        mine = xf[mask]
        self.own.addmm_(mine.t(), mine)
        self.rows += mine.shape[0]

    def result(self) -> torch.Tensor:
        prior = self.all / max(1, self.total)
        return (self.own + PRIOR_ROWS * prior) / (self.rows + PRIOR_ROWS)


def _expert_hessians(module: MoEMLP, states: States, e: int, device: torch.device,
                     gate_up: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None
                     ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """(gate|up Hessian, down Hessian or None without `gate_up`, tokens routed to e) over every chunk; `gate_up`
    maps h to e's (gate, up) outputs on all tokens (down's inputs then are act(gate) * up)."""
    k_in = module.spec.hidden_size
    gu = _Blend(k_in, device)
    dn: _Blend | None = None
    for i in range(len(states.chunks)):
        x = states.chunks[i].to(device)
        h = module.normed(x)
        _, ids = module.route(h)
        mask = (ids == e).any(-1)
        tf32 = torch.backends.cuda.matmul.allow_tf32
        try:
            torch.backends.cuda.matmul.allow_tf32 = True  # exact for fp16 inputs, fp32 accumulation
            gu.add(h, mask)
            if gate_up is not None:
                g, u = gate_up(h)
                a = _act(module, g, u)
                if dn is None:
                    dn = _Blend(a.shape[-1], device)
                dn.add(a, mask)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
    return gu.result(), None if dn is None else dn.result(), gu.rows


def _weights(module: MoEMLP, e: int, device: torch.device) -> list[torch.Tensor]:
    """Expert e's source gate, up, down as fp32 [K, N]."""
    return [read_weight(module.index, f"{module.key}.experts.{e}.{p}.weight", device) for p in MLP_KEYS]


def _set_expert(module: MoEMLP, e: int, proj: str, w_kn: torch.Tensor) -> None:
    """Expert e's `proj` in the block's dense stacks := W [K, N] (down with the residual multiplier the loader
    folds in)."""
    assert module.w_gate_up is not None and module.w_down is not None
    inter = module.moe.expert_size
    dt = module.w_gate_up.dtype
    if proj == "gate_proj":
        module.w_gate_up[e, :inter] = w_kn.t().to(dt)
    elif proj == "up_proj":
        module.w_gate_up[e, inter:] = w_kn.t().to(dt)
    else:
        module.w_down[e] = (w_kn.t() * module.spec.features.residual_scale).to(dt)


def _dense_gate_up(module: MoEMLP, e: int) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """h -> expert e's (gate, up) outputs through the block's current stacks."""
    assert module.w_gate_up is not None
    inter = module.moe.expert_size
    w = module.w_gate_up[e]
    return lambda h: (h @ w[:inter].t(), h @ w[inter:].t())


def _cache_device(module: MoEMLP, device: torch.device) -> torch.device:
    """Where the measurement keeps every expert's dequantized options: the device while they take under a
    quarter of its free memory, else host memory (Mixtral-8x7B or Qwen3-30B-A3B: about 30 GB per layer)."""
    if device.type != "cuda":
        return device
    sizes = {p: k * n for p, (k, n) in zip(MLP_KEYS, ((module.spec.hidden_size, module.moe.expert_size),) * 2 +
                                           ((module.moe.expert_size, module.spec.hidden_size),))}
    need = module.moe.num_experts * 2 * sum(len(distinct(MLP_OPTIONS, p)) * sizes[p] for p in MLP_KEYS)
    free, _ = torch.cuda.mem_get_info(device)
    return device if need < free // 4 else torch.device("cpu")


def measure_moe(module: MoEMLP, states: States, device: torch.device, store: torch.device, damp: float,
                norm: float) -> tuple[list[dict[str, Any]], States]:
    """The measurement entries of a loaded MoE block (every option of the MLP table applied to all its experts)
    and its reference outputs (the next inputs)."""
    check_source(module)
    if module.w_gate_up is None:
        raise NumericalError(f"{module.key}: the experts are not dense; convert from the fp16/bf16/fp32 model")
    ref = forward_chunks(module, states, device, store, module.key)
    assert ref is not None
    # Expert by expert: its Hessians, then every distinct option of a slot in one batched GPTQ pass per Hessian
    # (as the dense measurement does). The dequantized results wait on `cache` until the options using them run.
    n, dt = module.moe.num_experts, module.w_gate_up.dtype
    cache = _cache_device(module, device)
    quantized: dict[tuple[int, str, QParams], torch.Tensor] = {}
    tokens = []
    for e in range(n):
        h_gu, h_dn, rows = _expert_hessians(module, states, e, device, _dense_gate_up(module, e))
        assert h_dn is not None
        tokens.append(rows)
        key = f"{module.key}.experts.{e}"
        hessians = (prepare_hessian(h_gu, damp, f"{key}.gate_proj"), prepare_hessian(h_dn, damp, f"{key}.down_proj"))
        del h_gu, h_dn
        wg, wu, wd = _weights(module, e, device)
        for items, ph in zip(([("gate_proj", wg), ("up_proj", wu)], [("down_proj", wd)]), hessians):
            jobs = [(proj, w, o) for proj, w in items for o in distinct(MLP_OPTIONS, proj)]
            results = gptq_quantize([w for _, w, _ in jobs], [o for _, _, o in jobs], ph, norm=norm)
            for (proj, _, o), res in zip(jobs, results):
                quantized[(e, proj, o)] = res.dense().to(cache, dt)
        del wg, wu, wd, hessians
    entries = []
    for option in MLP_OPTIONS:
        for e in range(n):
            for proj in MLP_KEYS:
                _set_expert(module, e, proj, quantized[(e, proj, option[proj])].to(device))
        rfn, err = output_errors(module, states, ref, device)
        entry: dict[str, Any] = {"accuracy": max(1e-6, 1.0 - rfn), "err": err,
                                 "total_bits": module_bits(module, option), "expert_tokens": tokens}
        entry.update({k: option[k].to_dict() for k in MLP_KEYS})
        entries.append(entry)
    if max(e["accuracy"] for e in entries) < 0.1:
        raise NumericalError(f"Measurement/inference error (1): the best option of {module.key} keeps less than "
                             "10% accuracy")
    return entries, ref


def quantize_moe(module: MoEMLP, states: States, device: torch.device, store: torch.device,
                 option: dict[str, QParams], damp: float, norm: float, act_order: str = "auto"
                 ) -> tuple[dict[str, torch.Tensor], States, float, list[int]]:
    """(packed tensors of every expert, quantized outputs, relative error of the first chunk's output, tokens
    routed to each expert) of a loaded MoE block."""
    from exlpy.convert import quantize as q  # the dense path's act-order choice and packing (tests spy there)

    check_source(module)
    y0 = run_chunk(module, states, 0, device).float()  # the unquantized output, before the stacks change
    tensors: dict[str, torch.Tensor] = {}
    tokens = []
    for e in range(module.moe.num_experts):
        wg, wu, wd = _weights(module, e, device)
        h_gu, _, rows = _expert_hessians(module, states, e, device, None)
        tokens.append(rows)
        key = f"{module.key}.experts.{e}"
        g, u = q.quantize_best_order([wg, wu], [option["gate_proj"], option["up_proj"]], h_gu, damp, norm,
                                     f"{key}.gate_proj", act_order)
        _pack(q, tensors, key, {"gate_proj": g, "up_proj": u})
        gq, uq = g.dense().to(device), u.dense().to(device)
        dt = module.w_gate_up.dtype if module.w_gate_up is not None else torch.float32
        _, h_dn, _ = _expert_hessians(module, states, e, device,
                                      lambda h, gq=gq, uq=uq, dt=dt: (h @ gq.to(dt), h @ uq.to(dt)))
        assert h_dn is not None
        d = q.quantize_best_order([wd], [option["down_proj"]], h_dn, damp, norm, f"{key}.down_proj", act_order)[0]
        _pack(q, tensors, key, {"down_proj": d})
        for proj, res in (("gate_proj", g), ("up_proj", u), ("down_proj", d)):
            _set_expert(module, e, proj, res.dense())
    out = forward_chunks(module, states, device, store, module.key)
    assert out is not None
    yq = out.chunks[0].to(device).float()
    rfn = float(((yq - y0).flatten(1).norm(dim=1) / y0.flatten(1).norm(dim=1).clamp(min=1e-20)).mean())
    return tensors, out, rfn, tokens


def _pack(q: Any, tensors: dict[str, torch.Tensor], key: str, results: dict[str, QuantResult]) -> None:
    for proj, res in results.items():
        prefix = f"{key}.{proj}"
        packed = q.pack_exl2(res, prefix, None)
        check_packed(packed, res, prefix)
        tensors.update(packed)
