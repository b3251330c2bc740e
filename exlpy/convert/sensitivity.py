"""How much the model's output cares about each module's error: the weights of the bit-allocation objective.

The measurement scores every option of a module by its own output error (per-token relative squared error of
the hidden state it writes). Summed over modules with equal weights, that treats an error in the first layer
like one in the middle, while the final distribution reacts very differently to them (small models most of
all; HAWQ-V2, Dong et al. 2020, and the layer-wise sensitivity studies since weigh each layer by the loss's
curvature). Here each module's weight is measured directly: per-token Gaussian noise of relative size `eps` is
added to its output on a few calibration rows, the rest of the model runs on, and the mean KL divergence of the
final next-token distribution from the clean one, divided by eps², is the module's sensitivity (KL per unit of
relative squared error, the quantity the measurement reports). The optimizer then minimizes Σ sensitivity x
error, a second-order estimate of the KL of the whole quantized model.

All perturbed streams run together, one module loaded at a time (the same streaming as the measurement), so the
cost is about modules²/2 module forwards over `tokens` positions: seconds on a GPU. The noise is seeded, so a
resumed job computes the same weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from exlpy.convert.forward import States, _run, check_finite, forward_chunks, module_input
from exlpy.convert.layers import is_decoder
from exlpy.model.batch import contiguous_batch
from exlpy.model.module import Module

EPS = 0.05  # relative noise size: small enough for the quadratic regime, large enough to rise above fp16 noise


def _noisy(states: States, eps: float, seed: int) -> States:
    """states + Gaussian noise of norm eps x the row's median hidden-state norm at every token (deterministic).

    The median, not each token's own norm: attention-sink tokens carry states hundreds of times larger than the
    rest, in a few channels, and isotropic noise scaled to them wrecks what the whole row attends to, which no
    quantization error of that layer does; the measured error is a mean over tokens, so the typical token sets
    the scale."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for c in states.chunks:
        noise = torch.randn(c.shape, generator=g, dtype=torch.float32).to(c.device)
        typical = c.float().norm(dim=-1, keepdim=True).median(dim=-2, keepdim=True).values
        scale = eps * typical / noise.norm(dim=-1, keepdim=True).clamp_min(1e-20)
        out.append((c.float() + noise * scale).to(c.dtype))
    return States(out, states.side)


def _log_probs(norm: Module, head: Module, states: States, device: torch.device) -> list[torch.Tensor]:
    out = []
    for c in states.chunks:
        x = module_input(c, device)
        batch = contiguous_batch(x.shape[0], x.shape[1], 0, None, 0, device)
        y = _run(head, _run(norm, x, batch), batch)
        out.append(torch.log_softmax(y.float(), -1))
    return out


# perturb(module, clean input, clean output) -> (perturbed output, its per-token relative squared error)
Perturb = Callable[[Module, States, States], tuple[States, float]]


def token_error(y: States, ref: States) -> float:
    """Mean over tokens of |y - ref|² / |ref|²: the measurement's `err` (exlpy/convert/measure.py)."""
    num = count = 0.0
    for a, b in zip(y.chunks, ref.chunks):
        b = b.float()
        num += float(((a.float() - b).pow(2).sum(-1) / b.pow(2).sum(-1).clamp(min=1e-20)).sum())
        count += b.shape[0] * b.shape[1]
    return num / max(count, 1.0)


def module_sensitivity(modules: list[Module], embedded: States, device: torch.device, eps: float = EPS,
                       perturb: Perturb | None = None) -> dict[str, float]:
    """{decoder key: mean KL per token / relative squared error injected} for the model's `modules` (embedding
    first, final norm and head last); `embedded`: the embedding's output on the rows to use, on the device.

    `perturb`: how a module's output is perturbed; None: seeded noise of relative size eps (error eps²). The
    pipeline's "kl" objective passes the module quantized with the option the plain objective chose, so the
    weight is the KL per unit of error of *that* quantization error at its real size and structure (attention
    sinks, outlier channels), not of isotropic noise."""
    body, norm, head = modules[1:-2], modules[-2], modules[-1]
    clean = embedded
    streams: dict[str, States] = {}  # key -> the stream perturbed at that module's output
    injected: dict[str, float] = {}  # key -> the relative squared error injected there
    for i, m in enumerate(body):
        m.load(device)
        out = forward_chunks(m, clean, device, device, m.key)
        assert out is not None
        for k in streams:
            s = forward_chunks(m, streams[k], device, device, m.key)
            assert s is not None
            streams[k] = s
        if is_decoder(m):
            if perturb is None:
                streams[m.key], injected[m.key] = _noisy(out, eps, 1000 + i), eps**2
            else:
                streams[m.key], injected[m.key] = perturb(m, clean, out)
        clean = out
        m.unload()
    norm.load(device)
    head.load(device)
    ref = _log_probs(norm, head, clean, device)
    sens = {}
    for k, s in streams.items():
        kl = num = 0.0
        for r, lp in zip(ref, _log_probs(norm, head, s, device)):
            check_finite(lp, f"the head (sensitivity of {k})")
            kl += float((r.exp() * (r - lp)).sum())
            num += r.shape[0] * r.shape[1]
        sens[k] = max(kl / max(num, 1) / max(injected[k], 1e-12), 1e-12)
    norm.unload()
    head.unload()
    return sens
