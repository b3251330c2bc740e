"""The proposed attention routing (benchmarks/attend_flash.py) in a whole model: same logits as today's path for
the fp16 cache and for every quantized cache (whose codes it reads in place instead of the fp16 working copy),
also with the Triton kernels themselves running under the interpreter."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run kernels on CPU tensors

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from benchmarks.attend_flash import install
from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config
from exlpy.cache import ExLlamaV2Cache_8bit, ExLlamaV2Cache_Q4, ExLlamaV2Cache_Q6, ExLlamaV2Cache_Q8
from exlpy.kernels import ops
from tests.conftest import rel_err, shared_path

CACHES = [ExLlamaV2Cache, ExLlamaV2Cache_Q4, ExLlamaV2Cache_Q6, ExLlamaV2Cache_Q8, ExLlamaV2Cache_8bit]


@pytest.fixture(scope="module")
def model() -> Iterator[ExLlamaV2]:
    config = ExLlamaV2Config(str(shared_path("models", "tiny-llama-fp16")))
    config.max_seq_len = 64
    config.max_input_len = 16  # prompts go in chunks: later chunks read the earlier ones from the cache
    m = ExLlamaV2(config)
    m.load_autosplit(ExLlamaV2Cache(m, lazy=True))
    yield m
    m.unload()


def _run(model: ExLlamaV2, cache_cls: type, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """Prompt in chunks, then token-by-token decode: all logits."""
    cache = cache_cls(model)
    out = [model.forward(ids[:, :prompt], cache)]
    out += [model.forward(ids[:, i:i + 1], cache) for i in range(prompt, ids.shape[1])]
    return torch.cat(out, 1)


@pytest.fixture
def routed() -> Iterator[Callable[[], None]]:
    uninstall = install()
    yield uninstall
    uninstall()


@pytest.mark.parametrize("cache_cls", CACHES)
def test_routing_matches_todays_attention(model: ExLlamaV2, cache_cls: type, routed: Any) -> None:
    ids = torch.randint(0, 512, (1, 44), generator=torch.Generator().manual_seed(0))
    # fp32 references on the CPU; on a GPU machine the model runs in fp16 through the compiled kernels.
    tol = 1e-4 if model.modules[0].device.type == "cpu" else 2e-2
    new = _run(model, cache_cls, ids, 36)
    routed()  # back to the current attend
    old = _run(model, cache_cls, ids, 36)
    assert rel_err(new, old) < tol
    if cache_cls is not ExLlamaV2Cache:  # the prompt's first chunk sees only fresh K/V: as with the fp16 cache
        fp16 = _run(model, ExLlamaV2Cache, ids, 36)
        assert rel_err(new[:, :16], fp16[:, :16]) < (1e-5 if tol < 1e-3 else tol)


@pytest.mark.slow
@pytest.mark.parametrize("cache_cls", [ExLlamaV2Cache, ExLlamaV2Cache_Q4])
def test_routing_with_triton_kernels(model: ExLlamaV2, cache_cls: type, routed: Any,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The new ops run as their Triton kernels on CPU tensors (interpreter) inside the model."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need TRITON_INTERPRET=1 before triton is imported")
    pytest.importorskip("triton")
    import exlpy.kernels.triton_ops  # noqa: F401 - registers the kernels

    names = {"flash_attention", "quant_attention", "store_kv_quant"}
    plain = ops._impl
    monkeypatch.setattr(ops, "_impl", lambda name, t: ops._TRITON[name] if name in names else plain(name, t))
    ids = torch.randint(0, 512, (1, 22), generator=torch.Generator().manual_seed(1))
    got = _run(model, cache_cls, ids, 20)
    monkeypatch.setattr(ops, "_impl", plain)
    ref = _run(model, cache_cls, ids, 20)
    assert rel_err(got, ref) < 3e-3


@pytest.mark.parametrize("cache_cls", [ExLlamaV2Cache, ExLlamaV2Cache_Q4])
def test_left_padded_batch_with_kernels(model: ExLlamaV2, cache_cls: type, routed: Any,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A left-padded batch (key mask, shifted RoPE positions) over two chunks, kernels under the interpreter."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need TRITON_INTERPRET=1 before triton is imported")
    pytest.importorskip("triton")
    import exlpy.kernels.triton_ops  # noqa: F401 - registers the kernels

    ids = torch.randint(3, 500, (2, 20), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 24, dtype=torch.bool)
    mask[1, :5] = False
    offsets = torch.tensor([0, -5])

    def run() -> torch.Tensor:
        cache = cache_cls(model, batch_size=2, max_seq_len=24)
        a = model.forward(ids[:, :17], cache, input_mask=mask, position_offsets=offsets)
        b = model.forward(ids[:, 17:18], cache, input_mask=mask, position_offsets=offsets)
        return torch.cat([a, b], 1)

    names = {"flash_attention", "quant_attention", "store_kv_quant"}
    plain = ops._impl
    monkeypatch.setattr(ops, "_impl", lambda name, t: ops._TRITON[name] if name in names else plain(name, t))
    got = run()
    monkeypatch.setattr(ops, "_impl", plain)
    routed()
    ref = run()  # today's attention path
    assert rel_err(got[0], ref[0]) < 3e-3 and rel_err(got[1, 5:], ref[1, 5:]) < 3e-3
