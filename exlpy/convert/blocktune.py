"""Block-wise output tuning (AutoRound, Cheng et al. 2023; in the spirit of OmniQuant's block reconstruction).

GPTQ and learned rounding (gptq.py) minimize each linear's own output error, one linear at a time. This step
looks at the whole module (an attention or MLP block): after its linears are quantized, their stored parameters
are tuned together so that the quantized module's *output* matches the unquantized module's output on the
calibration rows (both on the quantized model's inputs, as the pipeline carries them), through the nonlinear
parts a per-linear objective cannot see (softmax, SwiGLU, the interaction of q/k/v and o_proj).

Everything tuned stays exactly representable in EXL2 (spec §3.5: w = (code - 2^(b-1)) * qscale^2 * smax / 256):
- the weight codes, as AutoRound: code = round(x + V), x the source weight in units of the current scale
  (anchored at the centre of the current code's bin, so V = 0 gives the current codes exactly), V learned in
  (-1, 1): each code can move by one step either way (|V| > 1/2);
- each group-and-column 4-bit scale code qscale (1..16), learned as a real number and rounded;
- each group's fp16 max scale (q_scale_max), learned as a log multiplier and rounded to fp16;
- with `norms` (the default; --no_block_tune_norms turns it off) the block's input-norm weight, as OmniQuant's
  equivalent transforms do: a per-channel log multiplier of the stored weight, rounded to fp16 as EXL2 files store
  norms (moved by signed steps, not over the largest gradient: see LR_NORM). It
  scales the inputs of the block's first projections (q/k/v, gate/up) per channel, jointly with their codes, so it
  can take up quantization error those codes cannot; the tuned norm is written into the output in place of the
  source's.
Rounding uses the straight-through estimator; the other updates are gradient steps normalized by each tensor's largest
gradient, with a linearly decaying step size (AutoRound's signed steps did not work from GPTQ's codes: see LR_*).
Minibatches are calibration rows drawn by a generator seeded from the module's
key (a resumed job tunes exactly as an uninterrupted one); a quarter of the rows is held out, the iterate with
the lowest held-out error is kept, and the module keeps its untuned weights unless that error is lower than
theirs, so on held-out calibration rows the module never gets worse.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from exlpy.convert.forward import States, Tap, _run, module_input
from exlpy.convert.gptq import QuantResult
from exlpy.model.attention import Attention
from exlpy.model.batch import contiguous_batch
from exlpy.model.mlp import MLP
from exlpy.model.module import Module
from exlpy.runtime import options, use_options

# Step sizes over the whole run, in units of each parameter (V: codes, c: scale codes, lm: log max scale). A step
# moves each parameter by lr / steps (decaying linearly to 0) times its gradient over the largest gradient of its
# tensor, so the most-pushed entry can travel lr / 2 in all and the others in proportion. AutoRound's signed
# steps (every entry moves alike) were tried first: from GPTQ's already near-optimal codes they flip a large share
# of the codes at once and the error rose 2 to 4x before recovering (benchmarks/results/convert_quality.md).
LR_ROUND = 2.0  # 8 (B1 in convert_quality.md) gained less in KL at 3.0 and 4.0 bpw than 2
V_MAX = 0.999  # |V| < 1: a code moves one step at most (AutoRound's [-0.5, 0.5] assumes a fractional start)
LR_SCALE = 8.0
LR_SMAX = 0.4
# The input norm's log multiplier moves by signed steps: every channel can travel LR_NORM / 2 over the run (clamped
# to NORM_MAX). Steps over the largest gradient (as for the codes) moved almost only the few outlier channels: mean
# |change| 0.05%, below fp16's resolution, on SmolLM2 (convert_quality.md, fourth round); on layer 5's attention
# signed steps of 0.3 cut the held-out error 7.6% more than tuning without the norm, 0.1 6%, the max-normalized 2.5%.
LR_NORM = 0.3
NORM_MAX = 0.25
NORM_SIGN = True  # False: steps over the largest gradient (the fourth round's N1)
HOLDOUT = 4  # every HOLDOUT-th calibration row is held out for choosing the iterate
CHECKS = 8  # held-out evaluations over the run (the best iterate is kept)


class _Ste(torch.autograd.Function):
    """round() forward, identity backward (straight-through estimator)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]  # noqa: ANN001
        return torch.round(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]  # noqa: ANN001
        return g


class _Fp16Ste(torch.autograd.Function):
    """fp16 rounding forward, identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]  # noqa: ANN001
        return x.half().float()

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]  # noqa: ANN001
        return g


@dataclass
class _Linear:
    """The tunable parameters of one quantized linear, in GPTQ's sorted row order."""

    res: QuantResult
    w: torch.Tensor  # [K, N] source (target) weights, sorted rows
    gidx: torch.Tensor  # [K] group of each row
    zero: torch.Tensor  # [K, 1] 2^(bits-1)
    maxq: torch.Tensor  # [K, 1] 2^bits - 1
    anchor: torch.Tensor  # [K, N] u0 - w / s0: w / s + anchor is the current code minus zero u0 while s = s0
    v: torch.Tensor  # [K, N] rounding offsets
    c: torch.Tensor  # [G, N] scale codes as reals
    lm: torch.Tensor  # [G] log multiplier of the group max scales
    inv: torch.Tensor  # [K] the sorted order's inverse (rows back to the original order)

    @staticmethod
    def make(res: QuantResult, w: torch.Tensor) -> _Linear:
        dev = res.dq_sorted.device
        k = res.codes.shape[0]
        gidx = torch.empty(k, dtype=torch.int64, device=dev)
        zero = torch.empty(k, 1, device=dev)
        maxq = torch.empty(k, 1, device=dev)
        r0 = 0
        for g, (bits, rows) in enumerate(res.groups):
            gidx[r0:r0 + rows] = g
            zero[r0:r0 + rows] = float(2 ** (bits - 1))
            maxq[r0:r0 + rows] = float(2**bits - 1)
            r0 += rows
        ws = w.to(dev, torch.float32)[res.perm]
        s0 = (res.qscale.float() ** 2 * (res.scale_max.float()[:, None] / 256))[gidx]
        u0 = res.codes.float() - zero
        ratio = ws / s0
        x = u0  # the centre of the current code's bin: a code changes only once V has moved it by 1/2
        z = torch.zeros_like(ws)
        return _Linear(res, ws, gidx, zero, maxq, x - ratio, z.requires_grad_(True),
                       res.qscale.float().clone().requires_grad_(True),
                       torch.zeros(len(res.groups), device=dev, requires_grad=True), torch.argsort(res.perm))

    def params(self) -> list[torch.Tensor]:
        return [self.v, self.c, self.lm]

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(integer codes minus zero [K, N], scale codes [G, N], fp16-valued max scales [G]), differentiable."""
        qs = _Ste.apply(self.c.clamp(1, 16))
        sm = _Fp16Ste.apply(self.res.scale_max.float() * torch.exp(self.lm))
        s = (qs * qs * (sm[:, None] / 256))[self.gidx]
        u = _Ste.apply(self.w / s + self.anchor + self.v)
        u = torch.minimum(torch.maximum(u, -self.zero), self.maxq - self.zero)
        return u, qs, sm

    def dense_sorted(self) -> torch.Tensor:
        u, qs, sm = self.parts()
        return u * (qs * qs * (sm[:, None] / 256))[self.gidx]

    def dense(self) -> torch.Tensor:
        """[K, N] in original row order (y = x @ W), differentiable."""
        return self.dense_sorted()[self.inv]

    def result(self) -> QuantResult:
        """The tuned quantization, with the reader's exact arithmetic."""
        with torch.no_grad():
            u, qs, sm = self.parts()
            smax16 = sm.half()
            qscale = qs.long()
            s = (qscale.float() ** 2 * (smax16.float()[:, None] / 256))[self.gidx]
            codes = (u + self.zero).to(torch.uint8)
            dq = (codes.float() - self.zero) * s
        r = self.res
        return QuantResult(r.qparams, r.perm, r.groups, codes, qscale, smax16, dq)


class _TunedInner:
    """Stands in for a tap's linear during tuning: y = x @ W(θ) (+ bias), in the module's compute dtype."""

    def __init__(self, lin: _Linear, tap: Tap, dtype: torch.dtype) -> None:
        self.lin, self.tap, self.dtype = lin, tap, dtype
        bias = tap.bias
        p = tap.prescale
        # The stored bias is the source bias in fp16, scaled by p at load (as Tap.set_weight has it).
        self.bias = ((bias.float() / p).to(torch.float16).float() * p).to(dtype) if bias is not None else None
        self.weight: torch.Tensor | None = None

    def refresh(self) -> None:
        w = self.lin.dense().t()
        self.weight = (w * self.tap.prescale if self.tap.prescale != 1.0 else w).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)


class _TunedNorm:
    """The block's input-norm weight during tuning: the weight the output file would hold (the source's in fp16,
    as the compiler copies it, minus the architecture's constant for Gemma) times exp(l) per channel, rounded to
    fp16 (STE); `refresh` puts the weight the loader would make of it into the module."""

    def __init__(self, module: Module, dtype: torch.dtype) -> None:
        assert module.norm_w is not None  # type: ignore[attr-defined]
        self.module, self.dtype = module, dtype
        self.name = f"{module.norm_key}.weight"  # type: ignore[attr-defined]
        self.const = float(module.spec.arch.norm_constant_bias)
        dev = module.norm_w.device  # type: ignore[attr-defined]
        self.w0 = module.index.get(self.name).to(torch.float16).to(dev, torch.float32) + self.const
        self.log = torch.zeros_like(self.w0, requires_grad=True)

    def stored(self) -> torch.Tensor:
        """The tensor the file holds, as fp32 values of fp16, differentiable."""
        return _Fp16Ste.apply(self.w0 * torch.exp(self.log) - self.const)

    def refresh(self) -> None:
        self.module.norm_w = (self.stored() + self.const).to(self.dtype)  # type: ignore[attr-defined]

    def result(self) -> torch.Tensor:
        with torch.no_grad():
            return self.stored().half()


def norm_tunable(module: Module) -> bool:
    """Whether the block has an input norm of its own whose weight tuning may change (a parallel block's MLP reads
    the attention's normed input; a non-parallel MLP without `mlp_pre` has none)."""
    return (tunable(module) and getattr(module, "norm_key", None) is not None
            and getattr(module, "norm_w", None) is not None)


@dataclass
class BlockTuning:
    """What `tune_block` made: the linears' quantizations, the tuned input-norm weight as the file stores it
    (fp16, `norm_name`; None when the norm was not tuned or the tuned block was not kept) and the held-out block
    errors before and after."""

    results: dict[str, QuantResult]
    before: float
    after: float
    norm: torch.Tensor | None = None
    norm_name: str | None = None


def tunable(module: Module) -> bool:
    """Blocks the tuner handles: a dense attention or MLP that is not half of a parallel block (Cohere), whose
    MLP reads the attention's normed input from the batch."""
    return isinstance(module, (Attention, MLP)) and not getattr(module, "parallel", False)


def _normal_tensors(obj: object, seen: set[int], depth: int = 0) -> None:
    """Replace the inference-mode tensors a loaded module holds (norm weights, RoPE tables) by normal copies:
    autograd cannot save inference tensors for the backward pass. Copies hold the same values."""
    if depth > 3 or id(obj) in seen or isinstance(obj, (Tap, type)):
        return
    seen.add(id(obj))
    d = getattr(obj, "__dict__", None)
    if d is None:
        return
    for key, v in list(d.items()):
        if isinstance(v, torch.Tensor):
            if v.is_inference():
                d[key] = v.clone()
        elif isinstance(v, dict):
            for kk, vv in list(v.items()):
                if isinstance(vv, torch.Tensor) and vv.is_inference():
                    v[kk] = vv.clone()
                elif isinstance(vv, tuple) and all(isinstance(t, torch.Tensor) for t in vv):
                    v[kk] = tuple(t.clone() if t.is_inference() else t for t in vv)
        elif hasattr(v, "__dict__"):
            _normal_tensors(v, seen, depth + 1)


def _forward(module: Module, x: torch.Tensor, device: torch.device) -> torch.Tensor:
    xd = module_input(x, device).clone()
    return _run(module, xd, contiguous_batch(xd.shape[0], xd.shape[1], 0, None, 0, device))


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of the relative squared error of the output (the measurement's per-token error)."""
    y, ref = y.float(), ref.float()
    return ((y - ref).pow(2).sum(-1) / ref.pow(2).sum(-1).clamp_min(1e-20)).mean()


def tune_block(module: Module, taps: dict[str, Tap], results: dict[str, QuantResult], targets: dict[str, torch.Tensor],
               states: States, device: torch.device, steps: int, tokens: int, norms: bool = False) -> BlockTuning:
    """Tune the quantized linears `results` of the loaded `module` (its linears replaced by `taps`) on the
    calibration `states` for `steps` normalized-gradient steps (LR_*) of about `tokens` tokens each, with the
    block's input-norm weight when `norms` (and the block has one: `norm_tunable`). `targets`: each linear's source
    weights [K, N]. Returns the tuned results (and norm) when they lower the held-out error, else `results`
    unchanged and no norm. The taps are left running the returned weights, and the module its returned norm (the
    tuned one, or the source's as loaded)."""
    dtype = module.dtype(device)
    rows = [c[r] for c in states.chunks for r in range(c.shape[0])]
    held = [i for i in range(len(rows)) if len(rows) > 1 and i % HOLDOUT == HOLDOUT - 1]
    train = [i for i in range(len(rows)) if i not in held] or list(range(len(rows)))
    held = held or train
    per_step = max(1, min(len(train), tokens // max(1, rows[0].shape[0])))
    gen = torch.Generator().manual_seed(zlib.crc32(module.key.encode()))

    def eval_err(ids: list[int], refs: list[torch.Tensor]) -> float:
        total = 0.0
        for a in range(0, len(ids), per_step * 4):
            x = torch.stack([rows[i] for i in ids[a:a + per_step * 4]])
            total += float(_rel_err(_forward(module, x, device), refs[a // (per_step * 4)])) * x.shape[0]
        return total / len(ids)

    # Torch's reference ops on a GPU too: the Triton kernels have no backward pass.
    with torch.inference_mode(False), torch.enable_grad(), use_options(replace(options(), triton=False)):
        _normal_tensors(module, set())
        for t in taps.values():
            t.set_weight(None, dtype)
        with torch.no_grad():  # the unquantized module's outputs: what the quantized one should give
            ref = {i: _forward(module, rows[i][None], device)[0].clone() for i in range(len(rows))}
        held_refs = [torch.stack([ref[i] for i in held[a:a + per_step * 4]]) for a in range(0, len(held),
                                                                                          per_step * 4)]
        lins = {k: _Linear.make(r, targets[k]) for k, r in results.items()}
        inners = {k: _TunedInner(lin, taps[k], dtype) for k, lin in lins.items()}
        for k, inner in inners.items():
            taps[k].inner = inner
        source_norm = getattr(module, "norm_w", None)
        norm = _TunedNorm(module, dtype) if norms and norm_tunable(module) else None

        def refresh() -> None:
            for inner in inners.values():
                inner.refresh()
            if norm is not None:
                norm.refresh()

        def state() -> dict[str, list[torch.Tensor]]:
            out = {k: [p.detach().clone() for p in lin.params()] for k, lin in lins.items()}
            return out | ({"": [norm.log.detach().clone()]} if norm is not None else {})

        with torch.no_grad():
            refresh()
            before = best = eval_err(held, held_refs)
        snapshot = state()
        check_every = max(1, steps // CHECKS)
        for step in range(steps):
            decay = 1.0 - step / steps
            pick = torch.randperm(len(train), generator=gen)[:per_step].tolist()
            x = torch.stack([rows[train[i]] for i in pick])
            y_ref = torch.stack([ref[train[i]] for i in pick])
            refresh()
            loss = _rel_err(_forward(module, x, device), y_ref)
            tuned = [p for lin in lins.values() for p in lin.params()] + ([norm.log] if norm is not None else [])
            grads = torch.autograd.grad(loss, tuned, allow_unused=True)
            with torch.no_grad():
                gi = iter(grads)
                for lin in lins.values():
                    for p, lr, lo, hi in ((lin.v, LR_ROUND, -V_MAX, V_MAX), (lin.c, LR_SCALE, 1.0, 16.0),
                                          (lin.lm, LR_SMAX, -0.1, 0.1)):
                        g = next(gi)
                        if g is not None:
                            d = g / g.abs().amax().clamp_min(1e-30)
                            p.sub_(d, alpha=lr / steps * decay).clamp_(lo, hi)
                if norm is not None:
                    g = next(gi)
                    if g is not None:
                        d = g.sign() if NORM_SIGN else g / g.abs().amax().clamp_min(1e-30)
                        norm.log.sub_(d, alpha=LR_NORM / steps * decay).clamp_(-NORM_MAX, NORM_MAX)
                if (step + 1) % check_every == 0 or step + 1 == steps:
                    refresh()
                    err = eval_err(held, held_refs)
                    if err < best:
                        best = err
                        snapshot = state()
        with torch.no_grad():
            for k, lin in lins.items():
                for p, saved in zip(lin.params(), snapshot[k]):
                    p.copy_(saved)
            if norm is not None:
                norm.log.copy_(snapshot[""][0])
            kept = best < before
            out = {k: lin.result() for k, lin in lins.items()} if kept else results
            tuned_norm = norm.result() if norm is not None and kept else None
            if tuned_norm is not None:
                assert norm is not None
                module.norm_w = (tuned_norm.float() + norm.const).to(dtype)  # type: ignore[attr-defined]
            elif norm is not None:
                module.norm_w = source_norm  # type: ignore[attr-defined]
    for k, r in out.items():
        taps[k].set_weight(r.dense(), dtype)
    name = norm.name if norm is not None and tuned_norm is not None else None
    return BlockTuning(out, before, best, tuned_norm, name)
