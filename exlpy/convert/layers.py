"""What the converter needs to know per module kind: its linears, which share a Hessian, the option table,
and reading the source weights (fp32, checked for NaN/inf)."""

from __future__ import annotations

import torch

from exlpy.convert.forward import LINEARS
from exlpy.convert.qparams import ATTN_KEYS, ATTN_OPTIONS, MLP_KEYS, MLP_OPTIONS, QParams
from exlpy.errors import NumericalError
from exlpy.model.attention import Attention
from exlpy.model.mlp import MLP
from exlpy.model.module import Module
from exlpy.model.moe import MoEMLP
from exlpy.weights.checks import stored_as_float
from exlpy.weights.safetensors_index import SafetensorsIndex

# (linear whose input is recorded, linears quantized with that Hessian), in forward order. Quantizing the first
# group before recording the second's input lets o_proj / down_proj see their quantized inputs.
HESSIAN_GROUPS: dict[type, tuple[tuple[str, tuple[str, ...]], ...]] = {
    Attention: (("q_proj", ("q_proj", "k_proj", "v_proj")), ("o_proj", ("o_proj",))),
    MLP: (("up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))),
}
# An MoE block (exlpy/convert/moe.py) is one slot with the MLP table: an option sets every expert's gate, up, down.
OPTIONS: dict[type, list[dict[str, QParams]]] = {Attention: ATTN_OPTIONS, MLP: MLP_OPTIONS, MoEMLP: MLP_OPTIONS}
assert LINEARS[Attention] == ATTN_KEYS and LINEARS[MLP] == MLP_KEYS


def is_decoder(module: Module) -> bool:
    return type(module) in OPTIONS


def slots(module: Module) -> list[str]:
    """The keys of the module's options: its projections (an MoE block's per-expert projections share them)."""
    if isinstance(module, MoEMLP):
        return list(MLP_KEYS)
    return linears(module)


def slot_of(name: str) -> str:
    """The option key of a projection name from `shapes` ("experts.3.up_proj" -> "up_proj")."""
    return name.rsplit(".", 1)[-1]


def linears(module: Module) -> list[str]:
    """The module's projections the checkpoint has (a non-gated MLP, GPT-2's or StarCoder2's, has no gate; an MoE
    block: experts.E.{gate,up,down}_proj for every expert)."""
    if isinstance(module, MoEMLP):
        return [f"experts.{e}.{p}" for e in range(module.moe.num_experts) for p in MLP_KEYS]
    return [n for n in LINEARS[type(module)] if n != "gate_proj" or module.spec.arch.gated_mlp]


def hessian_groups(module: Module) -> list[tuple[str, tuple[str, ...]]]:
    """HESSIAN_GROUPS of the module's kind, restricted to the projections it has."""
    have = set(linears(module))
    return [(rec, tuple(k for k in keys if k in have)) for rec, keys in HESSIAN_GROUPS[type(module)]]


def shapes(module: Module) -> dict[str, tuple[int, int]]:
    """(K, N) of each linear (y = x @ W, W is K x N) from the tensor headers."""
    out = {}
    for name in linears(module):
        n, k = module.index.info(f"{module.key}.{name}.weight").shape
        out[name] = (k, n)
    return out


def has_bias(module: Module, name: str) -> bool:
    return f"{module.key}.{name}.bias" in module.index


def read_weight(index: SafetensorsIndex, name: str, device: torch.device, rows: slice | None = None
                ) -> torch.Tensor:
    """A source weight (HF layout [N, K]) as fp32 [K, N] on `device`; `rows` picks output features."""
    stored_as_float(index, name)
    if rows is None:
        w = index.get(name)
    elif name in index.views:  # a part of a fused / transposed tensor (exlpy/weights/views.py)
        w = index.get(name)[rows]
    else:  # a slice of rows only (head slices): never the whole tensor in host memory
        from safetensors import safe_open

        info = index.info(name)
        with safe_open(info.file, framework="pt", device="cpu") as f:
            w = f.get_slice(info.name)[rows]  # the name stored in the file (architectures remap names)
    w = w.to(device, torch.float32)
    if not bool(torch.isfinite(w).all()):
        raise NumericalError(f"source tensor {name} holds NaN or inf ({index.info(name).file}); the model "
                             "cannot be quantized from these weights")
    return w.t()


def read_bias(index: SafetensorsIndex, prefix: str) -> torch.Tensor | None:
    name = f"{prefix}.bias"
    if name not in index:
        return None
    stored_as_float(index, name)
    return index.get(name).float()


def module_bits(module: Module, option: dict[str, QParams]) -> int:
    sh = shapes(module)
    return sum(option[slot_of(k)].total_bits(*sh[k], has_bias(module, k)) for k in sh)


def module_numel(module: Module) -> int:
    return sum(k * n for k, n in shapes(module).values())


def check_source(module: Module) -> None:
    """Every source tensor of the module must be finite; the error names the tensor and its file."""
    for prefix in module.tensor_prefixes():
        for name in module.index.names_with_prefix(prefix + "."):
            stored_as_float(module.index, name)
            t = module.index.get(name)
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise NumericalError(f"source tensor {name} holds NaN or inf ({module.index.info(name).file}); "
                                     "the model cannot be quantized from these weights")
