"""Model logits through the fused decode ops (RoPE + KV write, SwiGLU GEMV epilogue) on their Triton paths.

`ops` routes CPU tensors to the references; here the per-layer ops are routed to the registered Triton
implementations (TRITON_INTERPRET, in the child pytest that tests/conftest.py starts for `interpreter` tests)
so the kernels the GPU runs are what produce the logits, which must still match HF transformers, with fp16 and
quantized caches.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config
from exlpy.cache import ExLlamaV2Cache_Q8
from exlpy.kernels import ops, reference
from tests.conftest import rel_err
from tests.hf_models import make_hf_model

pytest.importorskip("triton")

# Attention itself stays on the reference: the interpreter is slow on it and it is not what changed.
_ROUTED = {"rope_store_kv", "store_kv_quant", "quant_attention",
           "norm_linear_swiglu", "norm_linear", "linear_add", "silu_mul", "store_kv",
           "apply_rope", "rms_norm"}


def _route_to_triton(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need TRITON_INTERPRET=1 before triton is imported")
    import exlpy.kernels.triton_ops  # noqa: F401 - registers the kernels

    used: list[str] = []

    def impl(name: str, t: torch.Tensor) -> Callable[..., Any]:
        if name in _ROUTED:
            used.append(name)
            return ops._TRITON[name]
        return getattr(reference, name)

    monkeypatch.setattr(ops, "_impl", impl)
    return used


def _prefill_then_decode(model: ExLlamaV2, cache: Any, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    out = [model.forward(ids[:, :prompt], cache)]
    out += [model.forward(ids[:, i:i + 1], cache) for i in range(prompt, ids.shape[1])]
    return torch.cat(out, dim=1)


def _load(model_dir: Path, cache_cls: Any) -> tuple[ExLlamaV2, Any]:
    config = ExLlamaV2Config(str(model_dir))
    config.max_seq_len = 32
    model = ExLlamaV2(config)
    cache = cache_cls(model, lazy=True)
    model.load(device="cpu")  # CPU tensors for the interpreter, on GPU machines too
    return model, cache


@pytest.mark.interpreter
@pytest.mark.parametrize("overrides", [{}, {"attention_bias": True, "mlp_bias": True}], ids=["llama", "bias"])
def test_triton_fused_decode_matches_hf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        overrides: dict[str, Any]) -> None:
    hf = make_hf_model(tmp_path, "llama", **overrides)  # GQA: 4 query heads over 2 KV heads
    model, cache = _load(tmp_path, ExLlamaV2Cache)
    ids = torch.randint(0, 320, (1, 12), generator=torch.Generator().manual_seed(21))
    with torch.no_grad():
        ref = hf(ids).logits
    used = _route_to_triton(monkeypatch)
    got = _prefill_then_decode(model, cache, ids, 8)
    assert "rope_store_kv" in used
    # Without biases the decode steps take the one-kernel SwiGLU GEMV; with them the biased fallback.
    assert ("norm_linear_swiglu" in used) == (not overrides)
    assert rel_err(got, ref) <= 1e-4


@pytest.mark.interpreter
def test_quantized_cache_same_through_fused_kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A quantized cache is written and read as codes (store_kv_quant, quant_attention): the Triton kernels
    and the reference path agree inside the model."""
    make_hf_model(tmp_path, "llama", seed=3)
    model, cache = _load(tmp_path, ExLlamaV2Cache_Q8)
    ids = torch.randint(0, 320, (1, 11), generator=torch.Generator().manual_seed(22))
    ref = _prefill_then_decode(model, cache, ids, 7)
    cache.current_seq_len = 0
    used = _route_to_triton(monkeypatch)
    got = _prefill_then_decode(model, cache, ids, 7)
    assert "store_kv_quant" in used and "quant_attention" in used
    assert rel_err(got, ref) <= 1e-3
