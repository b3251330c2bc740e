"""The calibration forward: exlpy's own modules, loaded one at a time, run over hidden states held in chunks.

`_run` is the one place module forwards are called (the engine may turn them into coroutines; only this
function would change). `Tap`s stand in for a loaded module's linears: they record their input for a Hessian,
can stop the forward right there (nothing after it is needed), and swap in quantized weights. The attribute
names of the linears are listed here only (LINEARS).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from exlpy.errors import NumericalError
from exlpy.model.attention import Attention
from exlpy.model.batch import ForwardBatch, contiguous_batch
from exlpy.model.linear import DenseLinear
from exlpy.model.mlp import MLP
from exlpy.model.module import Module, run_module

LINEARS: dict[type, tuple[str, ...]] = {
    Attention: ("q_proj", "k_proj", "v_proj", "o_proj"),
    MLP: ("gate_proj", "up_proj", "down_proj"),
}
# Fused projections built at load time; the taps need the parts called one by one.
_FUSED = ("qkv_proj", "gate_up_proj")
# The projections whose outputs the residual multiplier scales (Granite, MiniCPM): the loader folds it into their
# weight and bias (exlpy/model/attention.py, mlp.py), so a quantized stand-in must fold it in too.
_RESIDUAL_SCALED = ("o_proj", "down_proj")


def _run(module: Module, x: torch.Tensor, batch: object) -> torch.Tensor:
    """The single call site of module forwards in the converter. `x` must be the module's own (`module_input`):
    the forward may write into it."""
    return run_module(module, x, batch)  # type: ignore[arg-type]


def module_input(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Stored hidden states `x` on `device` as a tensor the module forward may overwrite.

    A forward pass owns its residual stream, and on CUDA the kernels that close a block add into it in place:
    `ops.rms_norm_add` (the post-norm blocks of Gemma 2, Gemma 3 and GLM-4) and `ops.linear_add` (a bias-free
    dense projection). The converter runs a module many times over the same stored states, so states already on
    the device are copied: else the first forward overwrites its inputs with its outputs, the reference outputs
    alias the inputs, and every measured option scores an error of exactly zero (the optimizer then takes the
    cheapest options: ~3.6 bpw at a target of 8). States moved from host memory are a fresh copy already.
    """
    xd = x.to(device, non_blocking=True)
    return xd.clone() if xd is x else xd


class StopForward(Exception):
    """Raised by a tap once the input it records has been seen: the rest of the module is not needed."""


class Tap:
    """One linear of a loaded module: records inputs, optionally stops the forward, runs `inner`."""

    def __init__(self, inner: object, prescale: float = 1.0) -> None:
        self.original = inner
        self.inner = inner
        self.prescale = prescale  # folded into the loaded weight and bias; the quantizer sees the source weight
        self.record: Callable[[torch.Tensor], None] | None = None
        self.stop = False

    @property
    def in_features(self) -> int:
        return self.original.in_features  # type: ignore[attr-defined]

    @property
    def out_features(self) -> int:
        return self.original.out_features  # type: ignore[attr-defined]

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(self.original, "bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.record is not None:
            self.record(x)
        if self.stop:
            raise StopForward
        return self.inner.forward(x)  # type: ignore[attr-defined]

    def set_weight(self, w_kn: torch.Tensor | None, dtype: torch.dtype) -> None:
        """Run with W [K, N] (y = x @ W) instead of the source weight; None restores the source weight."""
        if w_kn is None:
            self.inner = self.original
            return
        p, bias = self.prescale, self.bias
        if bias is not None:  # the output stores the source bias in fp16; the loader scales it by p
            bias = ((bias.float() / p).to(torch.float16).float() * p).to(dtype)
        w = w_kn.t() * p if p != 1.0 else w_kn.t()
        self.inner = DenseLinear(w.to(dtype).contiguous(), bias)

    def reset(self) -> None:
        self.record = None
        self.stop = False


def install_taps(module: Module) -> dict[str, Tap]:
    """Replace the loaded module's linears by taps (the module is unloaded after use, so nothing is restored)."""
    taps = {}
    for name in LINEARS[type(module)]:
        if getattr(module, name, None) is None:
            continue  # a projection this architecture lacks (a non-gated MLP has no gate_proj)
        tap = Tap(getattr(module, name), module.spec.features.residual_scale if name in _RESIDUAL_SCALED else 1.0)
        setattr(module, name, tap)
        taps[name] = tap
    for name in _FUSED:
        if hasattr(module, name):
            setattr(module, name, None)
    return taps


class Hessian:
    """Σ xᵀx / rows in fp32 over every row a linear sees. On CUDA the products run in TF32, which is exact
    for fp16 activations (same 11-bit significand) and keeps the fp32 accumulation."""

    def __init__(self, k: int, device: torch.device) -> None:
        self.h = torch.zeros(k, k, dtype=torch.float32, device=device)
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1])
        tf32 = torch.backends.cuda.matmul.allow_tf32
        try:
            torch.backends.cuda.matmul.allow_tf32 = True
            for a in range(0, x.shape[0], 8192):
                xf = x[a:a + 8192].to(self.h.device, torch.float32)
                self.h.addmm_(xf.t(), xf)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        self.rows += x.shape[0]

    def result(self) -> torch.Tensor:
        return self.h / max(1, self.rows)


class States:
    """Hidden states of the calibration rows, in chunks of rows, on the device or in (pinned) host memory.

    `side`: in a parallel block (Cohere), per chunk the normed input the attention computed, which the MLP
    beside it reads instead of the attention's output (the model hands it over in `batch.block_inputs`)."""

    def __init__(self, chunks: list[torch.Tensor], side: list[torch.Tensor] | None = None) -> None:
        self.chunks = chunks
        self.side = side

    @property
    def rows(self) -> int:
        return sum(c.shape[0] for c in self.chunks)

    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.chunks + (self.side or []))

    def to_dict(self, prefix: str = "", host: bool = True) -> dict[str, torch.Tensor]:
        """The tensors by name (`prefix` + chunk_i / side_i), in host memory (`host=False`: where they are, for
        `Job.checkpoint_async`)."""
        out = {f"{prefix}chunk_{i}": c for i, c in enumerate(self.chunks)}
        out.update({f"{prefix}side_{i}": c for i, c in enumerate(self.side or [])})
        return {k: v.contiguous().cpu() for k, v in out.items()} if host else out

    @staticmethod
    def from_dict(d: dict[str, torch.Tensor], store: torch.device, prefix: str = "") -> States:
        """The states saved by to_dict(prefix) (a checkpoint may hold several sets under different prefixes)."""
        n = sum(k.startswith(f"{prefix}chunk_") for k in d)
        side = [_store(d[f"{prefix}side_{i}"], store) for i in range(n)] if f"{prefix}side_0" in d else None
        return States([_store(d[f"{prefix}chunk_{i}"], store) for i in range(n)], side)


def _store(x: torch.Tensor, store: torch.device) -> torch.Tensor:
    if store.type == "cpu" and x.is_cuda:
        out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        out.copy_(x)
        return out
    return x.to(store)


def check_finite(x: torch.Tensor, where: str) -> None:
    if not bool(torch.isfinite(x).all()):
        bad = "NaN" if bool(torch.isnan(x).any()) else "inf"
        raise NumericalError(f"{bad} in the hidden states after {where} during calibration (the source weights "
                             "or the calibration data overflow this layer)")


def _parallel_layer(module: Module, kind: type) -> int | None:
    """The layer index when `module` is the `kind` half of a parallel block, else None."""
    return module.layer_idx if isinstance(module, kind) and module.parallel else None  # type: ignore[attr-defined]


def _chunk_batch(module: Module, states: States, i: int, xd: torch.Tensor, device: torch.device) -> ForwardBatch:
    """The batch of chunk i: a parallel block's MLP gets the attention's normed input of that chunk."""
    batch = contiguous_batch(xd.shape[0], xd.shape[1], 0, None, 0, device)
    layer = _parallel_layer(module, MLP)
    if layer is not None:
        assert states.side is not None, f"{module.key}: the attention beside this MLP left no normed input"
        batch.block_inputs[layer] = states.side[i].to(device, non_blocking=True)
    return batch


def run_chunk(module: Module, states: States, i: int, device: torch.device) -> torch.Tensor:
    """`module`'s output on chunk i, on the device."""
    xd = module_input(states.chunks[i], device)
    return _run(module, xd, _chunk_batch(module, states, i, xd, device))


def forward_chunks(module: Module, states: States, device: torch.device, store: torch.device | None,
                   where: str) -> States | None:
    """Run `module` over every chunk. store=None: outputs are dropped (a recording pass, or one that stops at
    a tap). Otherwise outputs are kept on `store` and checked for NaN/inf; a parallel block's attention also
    keeps its normed inputs for the MLP beside it (`States.side`)."""
    outs, side, finite = [], [], []
    keep_side = _parallel_layer(module, Attention)
    for i, x in enumerate(states.chunks):
        xd = module_input(x, device)
        batch = _chunk_batch(module, states, i, xd, device)
        with contextlib.suppress(StopForward):
            y = _run(module, xd, batch)
            if store is not None:
                finite.append(torch.isfinite(y).all())  # read once after the loop: no host sync per chunk
                outs.append(_store(y, store))
                if keep_side is not None:
                    side.append(_store(batch.block_inputs.pop(keep_side), store))
    if finite and not bool(torch.stack(finite).all()):
        for y in outs:
            check_finite(y.to(device), where)  # raises for the first bad chunk, naming NaN or inf
    return States(outs, side if keep_side is not None else None) if store is not None else None


def iter_outputs(module: Module, states: States, device: torch.device) -> Iterator[torch.Tensor]:
    """Outputs chunk by chunk, on the device (for error measurement against a reference)."""
    for i in range(len(states.chunks)):
        yield run_chunk(module, states, i, device)
