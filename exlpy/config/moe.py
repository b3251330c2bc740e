"""Mixture-of-experts settings of a config.json, parsed once into `MoESpec` (spec §1-2).

Routing as each architecture defines it: softmax of the router logits in fp32, the top k experts per token,
their weights renormalised where the architecture or config says so (Mixtral: to sum 1; Qwen3-MoE: to sum 1
per `norm_topk_prob`; DBRX: divided by their L_p norm, p = `moe_normalize_expert_weights`). Which layers are
sparse: all of them, except where Qwen3-MoE's `mlp_only_layers` / `decoder_sparse_step` leave a dense MLP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from exlpy.config.arch import ArchParams
from exlpy.config.values import MAX_DIM, as_int
from exlpy.errors import ConfigError

MAX_EXPERTS = 4096


class Reader(Protocol):
    path: str

    def get(self, keys: str | tuple[str, ...], typ: type, default: Any = ...) -> Any: ...


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int  # experts per token
    expert_size: int  # intermediate features of one expert
    norm_p: float  # the top-k weights divided by their L_p norm (1: their sum), 0: used as they are
    sparse_layers: tuple[bool, ...]  # per layer: an MoE block (True) or the dense MLP (False)


def _explicit_null(r: Reader, key: str) -> bool:
    """Whether config.json sets the (possibly nested, "a.b") key to null, rather than leaving it out."""
    node: Any = getattr(r, "data", {})
    *outer, leaf = key.split(".")
    for part in outer:
        node = node.get(part) if isinstance(node, dict) else None
    return isinstance(node, dict) and leaf in node and node[leaf] is None


def parse_moe(r: Reader, arch: ArchParams, layers: int, intermediate: int) -> MoESpec | None:
    """The MoE settings of an MoE architecture, None for a dense one."""
    if not arch.moe:
        return None
    n = as_int(r.get(("num_local_experts", "num_experts", "ffn_config.moe_num_experts"), int), "num_local_experts",
               r.path, 1, MAX_EXPERTS)
    k = as_int(r.get(("num_experts_per_tok", "ffn_config.moe_top_k"), int), "num_experts_per_tok", r.path, 1,
               MAX_EXPERTS)
    if k > n:
        raise ConfigError(f"{r.path}: num_experts_per_tok ({k}) exceeds the number of experts ({n})")
    size = as_int(r.get("moe_intermediate_size", int, intermediate), "moe_intermediate_size", r.path, 1, MAX_DIM)
    norm_p = 1.0 if arch.moe_renormalize else 0.0
    key = arch.moe_renormalize_key
    if key is not None:
        value = r.get(key, object, None)
        if value is None and _explicit_null(r, key):  # DBRX's moe_normalize_expert_weights: null, no renorm
            norm_p = 0.0
        elif isinstance(value, bool):  # Qwen3-MoE's norm_topk_prob
            norm_p = 1.0 if value else 0.0
        elif isinstance(value, (int, float)) and value > 0:
            norm_p = float(value)
        elif value is not None:
            raise ConfigError(f"{r.path}: '{key}' should be true/false or a positive p of an L_p norm, got "
                              f"{value!r:.60}")
    sparse = [True] * layers
    if arch.moe_dense_layers:
        only = r.get("mlp_only_layers", list, [])
        if any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < layers for i in only):
            raise ConfigError(f"{r.path}: 'mlp_only_layers' must list layer indices in [0, {layers}), got "
                              f"{only!r:.60}")
        step = as_int(r.get("decoder_sparse_step", int, 1), "decoder_sparse_step", r.path, 1, layers + 1)
        sparse = [i not in only and (i + 1) % step == 0 for i in range(layers)]
    return MoESpec(n, k, size, norm_p, tuple(sparse))
