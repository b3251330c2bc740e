"""The one dispatch layer between model code and kernels.

Each op takes the same arguments as its torch reference. Triton kernels register themselves here for CUDA
tensors; everything else (CPU, or `EXLPY_NO_TRITON=1`, see exlpy/runtime.py) runs the reference.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from exlpy.kernels import reference
from exlpy.runtime import options

if TYPE_CHECKING:
    from exlpy.quant.experts import ExpertStack

_TRITON: dict[str, Callable[..., Any]] = {}


def register(name: str, fn: Callable[..., Any]) -> None:
    """Register a CUDA implementation of op `name`."""
    _TRITON[name] = fn


_tried_triton = False


def _load_triton() -> None:
    """Import the Triton kernels once, on the first CUDA call; without triton the references serve."""
    global _tried_triton
    _tried_triton = True
    try:
        import exlpy.kernels.triton_ops  # noqa: F401 - registers its kernels on import
    except ImportError:
        pass


def has_cuda_kernels() -> bool:
    """True when the Triton kernels are registered (CUDA-graph capture relies on their sync-free paths)."""
    if not _tried_triton:
        _load_triton()
    return options().triton and "paged_attention" in _TRITON


def _impl(name: str, t: torch.Tensor) -> Callable[..., Any]:
    if t.is_cuda and options().triton:
        if not _tried_triton:
            _load_triton()
        if name in _TRITON:
            fn = _TRITON[name]
            if t.device.index is not None and t.device.index != torch.cuda.current_device():
                # A Triton kernel launches on the *current* device's stream: a tensor on another GPU (a layer
                # split's logits on its last GPU, masked by the generator) would be read out of stream order.
                return functools.partial(_on_device, fn, t.device)
            return fn
    return getattr(reference, name)


def _on_device(fn: Callable[..., Any], device: torch.device, *args: Any, **kwargs: Any) -> Any:
    with torch.cuda.device(device):
        return fn(*args, **kwargs)


# Features some CUDA kernels do not implement: a call that needs one runs the torch reference on the GPU
# (correct, slower). `_FEATURES[op]` lists the ones a registered kernel does implement.
_FEATURES: dict[str, frozenset[str]] = {}


def register_features(name: str, features: frozenset[str]) -> None:
    _FEATURES[name] = features


def _impl_with(name: str, t: torch.Tensor, **features: object) -> Callable[..., Any]:
    """`_impl`, unless a requested feature (a non-zero value) is one the CUDA kernel lacks."""
    impl = _impl(name, t)
    if impl is not getattr(reference, name):
        have = _FEATURES.get(name, frozenset())
        if any(v and k not in have for k, v in features.items()):
            return getattr(reference, name)
    return impl


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _impl("rms_norm", x)(x, weight, eps)


def rms_norm_add(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _impl("rms_norm_add", x)(x, y, weight, eps)


def add_rms_norm(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _impl("add_rms_norm", x)(x, r, weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    return _impl("layer_norm", x)(x, weight, bias, eps)


def act(x: torch.Tensor, kind: str) -> torch.Tensor:
    return _impl("act", x)(x, kind)


def act_mul(gate: torch.Tensor, up: torch.Tensor, kind: str) -> torch.Tensor:
    """act(gate) * up; SiLU takes the SwiGLU kernel."""
    if kind == "silu":
        return silu_mul(gate, up)
    return _impl("act_mul", gate)(gate, up, kind)  # CUDA: GELU (tanh) in one kernel


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl("apply_rope", q)(q, k, cos, sin, positions)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _impl("silu_mul", gate)(gate, up)


def linear_add(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    return _impl("linear_add", x)(x, weight, residual)


def norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor) -> torch.Tensor:
    return _impl("norm_linear", x)(x, norm_weight, eps, weight)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    _impl("store_kv", k)(k_cache, v_cache, slots, k, v)


def rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl("rope_store_kv", q)(q, k, v, cos, sin, positions, k_cache, v_cache, slots)


def norm_linear_swiglu(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor
                       ) -> torch.Tensor:
    return _impl("norm_linear_swiglu", x)(x, norm_weight, eps, weight)


def act_order(x: torch.Tensor, perm: torch.Tensor | None, pad: int) -> torch.Tensor:
    return _impl("act_order", x)(x, perm, pad)


def rms_norm_act_order(x: torch.Tensor, weight: torch.Tensor, eps: float, perm: torch.Tensor | None,
                       pad: int) -> torch.Tensor:
    return _impl("rms_norm_act_order", x)(x, weight, eps, perm, pad)


def quant_matmul(x: torch.Tensor, parts: list[Any], bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                 eps: float = 0.0) -> torch.Tensor:
    """(rms_norm(x)) @ packed EXL2/GPTQ matrices side by side (+ bias, + residual in place); see reference. On
    CUDA: one row the decode GEMV, 2-64 rows the multi-row kernel, longer inputs dequantize + cuBLAS."""
    return _impl("quant_matmul", x)(x, parts, bias, residual, norm_weight, eps)


def _attn_kw(window: int, softcap: float, limits: torch.Tensor | None = None) -> dict[str, Any]:
    # Only non-default features are passed on, so kernels that lack them keep their plain signature.
    kw: dict[str, Any] = {k: v for k, v in (("window", window), ("softcap", softcap)) if v}
    if limits is not None:
        kw["limits"] = limits
    return kw


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    page_size: int, seqlens: torch.Tensor, max_seqlen: int, positions: torch.Tensor,
                    scale: float, key_mask: torch.Tensor | None = None, window: int = 0,
                    softcap: float = 0.0, limits: torch.Tensor | None = None) -> torch.Tensor:
    return _impl_with("paged_attention", q, window=window, softcap=softcap, limits=limits is not None)(
        q, k_cache, v_cache, block_table, page_size, seqlens, max_seqlen, positions, scale, key_mask,
        **_attn_kw(window, softcap, limits))


def flash_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    page_size: int, seqlens: torch.Tensor, max_seqlen: int, positions: torch.Tensor,
                    scale: float, key_mask: torch.Tensor | None = None, window: int = 0,
                    softcap: float = 0.0, limits: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a query block (prefill chunk, verify step) over the cache in place; see reference."""
    return _impl_with("flash_attention", q, window=window, softcap=softcap, limits=limits is not None)(
        q, k_cache, v_cache, block_table, page_size, seqlens, max_seqlen, positions, scale, key_mask,
        **_attn_kw(window, softcap, limits))


def quant_attention(q: torch.Tensor, k_codes: torch.Tensor, k_scales: torch.Tensor | None, v_codes: torch.Tensor,
                    v_scales: torch.Tensor | None, block_table: torch.Tensor, page_size: int, seqlens: torch.Tensor,
                    max_seqlen: int, positions: torch.Tensor, scale: float, k_bits: int, v_bits: int,
                    key_mask: torch.Tensor | None = None, k_new: torch.Tensor | None = None,
                    v_new: torch.Tensor | None = None, window: int = 0, softcap: float = 0.0,
                    limits: torch.Tensor | None = None) -> torch.Tensor:
    """`flash_attention` over a quantized cache read at its own width (any query length), with this step's own
    K/V optionally taken unquantized from k_new/v_new; see reference."""
    return _impl_with("quant_attention", q, window=window, softcap=softcap, limits=limits is not None)(
        q, k_codes, k_scales, v_codes, v_scales, block_table, page_size, seqlens, max_seqlen, positions, scale,
        k_bits, v_bits, key_mask, k_new, v_new, **_attn_kw(window, softcap, limits))


def store_kv_quant(k_codes: torch.Tensor, k_scales: torch.Tensor | None, v_codes: torch.Tensor,
                   v_scales: torch.Tensor | None, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   k_bits: int, v_bits: int) -> None:
    """Quantize k/v [B,T,Hkv,D] into a quantized cache's rows `slots`; see reference."""
    _impl("store_kv_quant", k)(k_codes, k_scales, v_codes, v_scales, slots, k, v, k_bits, v_bits)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
         is_causal: bool = False, softcap: float = 0.0) -> torch.Tensor:
    return _impl_with("sdpa", q, softcap=softcap)(q, k, v, scale, mask, is_causal, **_attn_kw(0, softcap))


def embed_slice(ids: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """Rows [start, start + n) of an embedding table held by one tensor-parallel GPU, zero rows for ids
    outside them (the vocabulary-parallel lookup before its all-reduce); see reference."""
    return _impl("embed_slice", weight)(ids, weight, start)


def host_all_reduce(tensors: list[torch.Tensor], state: Any, spin: int | None = None) -> None:
    """In-place sum of one tensor per GPU through pinned host memory (tensor parallelism without P2P); see
    kernels/host_allreduce.py and the reference."""
    impl = _impl("host_all_reduce", tensors[0])
    if spin is None:
        impl(tensors, state)
    else:
        impl(tensors, state, spin)


def host_all_reduce_norm(tensors: list[torch.Tensor], weights: list[torch.Tensor], eps: float, state: Any,
                         spin: int | None = None) -> list[torch.Tensor]:
    """`host_all_reduce` with the next block's RMSNorm of the sum in the same kernel: returns the normed
    tensors; see kernels/host_allreduce.py and the reference."""
    impl = _impl("host_all_reduce_norm", tensors[0])
    return impl(tensors, weights, eps, state) if spin is None else impl(tensors, weights, eps, state, spin)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    return _impl("apply_token_bitmask", logits)(logits, bitmask)


def sample_top(logits: torch.Tensor, params: torch.Tensor, rng: torch.Tensor, k_max: int,
               whole_vocab: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl("sample_top", logits)(logits, params, rng, k_max, whole_vocab)


def sample_top_candidates(logits: torch.Tensor, params: torch.Tensor, rng: torch.Tensor, k_max: int,
                          whole_vocab: bool = True) -> tuple[torch.Tensor, ...]:
    return _impl("sample_top_candidates", logits)(logits, params, rng, k_max, whole_vocab)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, ranks: torch.Tensor, adapters: torch.Tensor, q_len: int,
                norm_weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    return _impl("lora_shrink", x)(x, a, ranks, adapters, q_len, norm_weight, eps)


def lora_expand(y: torch.Tensor, u: torch.Tensor, b: torch.Tensor, ranks: torch.Tensor, adapters: torch.Tensor,
                q_len: int, bounds: tuple[int, ...] = ()) -> torch.Tensor:
    return _impl("lora_expand", y)(y, u, b, ranks, adapters, q_len, bounds)


def lora_expand_swiglu(gu: torch.Tensor, u: torch.Tensor, b: torch.Tensor, ranks: torch.Tensor,
                       adapters: torch.Tensor, q_len: int, down_a: torch.Tensor | None = None,
                       down_ranks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    return _impl("lora_expand_swiglu", gu)(gu, u, b, ranks, adapters, q_len, down_a, down_ranks)


def moe_experts(h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor, kind: str, residual: torch.Tensor | None = None) -> torch.Tensor:
    """Routed experts of an MoE block (same result as reference.moe_experts; + residual when given): the pairs
    sorted by expert on the device, one grouped launch for every expert's gate|up with the activation, one for
    down, the k outputs of each token summed. Nothing is read on the host and no shape depends on the routing
    (CUDA-graph safe)."""
    order, counts = moe_sort(ids, w_gate_up.shape[0])
    a = moe_gate_up(h, order, counts, w_gate_up, ids.shape[1], kind)
    return moe_combine(moe_down(a, order, counts, w_down), weights, residual)


def moe_route(logits: torch.Tensor, top_k: int, norm_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl("moe_route", logits)(logits, top_k, norm_p)


def moe_combine(y: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    return _impl("moe_combine", y)(y, weights, residual)


def moe_sort(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl("moe_sort", ids)(ids, num_experts)


def moe_gate_up(x: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor, top_k: int,
                kind: str) -> torch.Tensor:
    return _impl_with("moe_gate_up", x, **{kind: True})(x, order, counts, w_gate_up, top_k, kind)


def moe_down(a: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    return _impl("moe_down", a)(a, order, counts, w_down)


def moe_experts_exl2(h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate: ExpertStack,
                     up: ExpertStack, down: ExpertStack, kind: str, residual: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """`moe_experts` over EXL2 experts (exlpy/quant/experts.py): the same sort and combine, with gate|up and down
    as one grouped launch each reading the routed experts' packed weights. CUDA-graph safe as the dense one."""
    order, counts = moe_sort(ids, gate.num_experts)
    a = moe_gate_up_exl2(h, order, counts, gate, up, ids.shape[1], kind)
    return moe_combine(moe_down_exl2(a, order, counts, down), weights, residual)


def moe_gate_up_exl2(x: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, gate: ExpertStack,
                     up: ExpertStack, top_k: int, kind: str) -> torch.Tensor:
    return _impl_with("moe_gate_up_exl2", x, **{kind: True})(x, order, counts, gate, up, top_k, kind)


def moe_down_exl2(a: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, down: ExpertStack) -> torch.Tensor:
    return _impl("moe_down_exl2", a)(a, order, counts, down)


def gptq_block(w: torch.Tensor, u: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: torch.Tensor,
               codes: torch.Tensor, err: torch.Tensor, rtn: bool = False) -> None:
    """One block of GPTQ rows (the converter's inner loop), in place; see `reference.gptq_block`. The Triton kernel
    only with EXLPY_GPTQ_KERNEL=1 until it has run on a GPU (bit-identical to the reference under the interpreter
    and compiled without FMAs for sm_90a, 2026-11-26); the reference otherwise, on every device."""
    if not options().gptq_kernel:
        reference.gptq_block(w, u, scale, zero, maxq, codes, err, rtn)
        return
    _impl("gptq_block", w)(w, u, scale, zero, maxq, codes, err, rtn)
