"""The attention routing in a whole model (exlpy/model/attention.py `attend`): quantized caches are read as codes
in place, prompts in chunks read earlier chunks from the cache, and the kernels themselves (Triton's interpreter on
CPU tensors) give the same logits as the references inside the model."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config
from exlpy.cache import ExLlamaV2Cache_8bit, ExLlamaV2Cache_Q4, ExLlamaV2Cache_Q6, ExLlamaV2Cache_Q8
from exlpy.kernels import ops
from tests.conftest import rel_err, shared_path

CACHES = [ExLlamaV2Cache_Q4, ExLlamaV2Cache_Q6, ExLlamaV2Cache_Q8, ExLlamaV2Cache_8bit]
KERNELS = {"paged_attention", "quant_attention", "store_kv_quant"}


@pytest.fixture(scope="module")
def model() -> Iterator[ExLlamaV2]:
    config = ExLlamaV2Config(str(shared_path("models", "tiny-llama-fp16")))
    config.max_seq_len = 64
    config.max_input_len = 16  # prompts go in chunks: later chunks read the earlier ones from the cache
    m = ExLlamaV2(config)
    m.load(device="cpu")
    yield m
    m.unload()


def _run(model: ExLlamaV2, cache_cls: type, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """Prompt in chunks, then token-by-token decode: all logits."""
    cache = cache_cls(model)
    out = [model.forward(ids[:, :prompt], cache)]
    out += [model.forward(ids[:, i:i + 1], cache) for i in range(prompt, ids.shape[1])]
    return torch.cat(out, 1)


@pytest.mark.parametrize("cache_cls", CACHES)
def test_quantized_caches_read_codes_in_place(model: ExLlamaV2, cache_cls: type) -> None:
    ids = torch.randint(0, 512, (1, 44), generator=torch.Generator().manual_seed(0))
    fp16 = _run(model, ExLlamaV2Cache, ids, 36)
    quant = _run(model, cache_cls, ids, 36)
    # The prompt's first chunk sees only this step's own (unquantized) K/V: exactly the fp16 cache's logits.
    assert rel_err(quant[:, :16], fp16[:, :16]) < 1e-5
    # Later positions read codes: close to the fp16 cache, not equal (a random tiny model amplifies the
    # quantization noise; the kernels' own accuracy is pinned by test_attention_kernels*.py).
    err = rel_err(quant, fp16)
    assert 0 < err < 0.15
    cache = cache_cls(model)
    assert cache.graph_safe and not any(t.is_floating_point() and t.dim() == 4 for t in cache.all_tensors())


def _with_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Route the attention ops to their Triton kernels for CPU tensors (Triton's interpreter)."""
    import exlpy.kernels.triton_ops  # noqa: F401 - registers the kernels

    plain = ops._impl
    monkeypatch.setattr(ops, "_impl", lambda name, t: ops._TRITON[name] if name in KERNELS else plain(name, t))


@pytest.mark.interpreter
@pytest.mark.slow
@pytest.mark.parametrize("cache_cls", [ExLlamaV2Cache, ExLlamaV2Cache_Q4])
def test_routing_with_triton_kernels(model: ExLlamaV2, cache_cls: type, monkeypatch: pytest.MonkeyPatch) -> None:
    """The attention ops run as their Triton kernels on CPU tensors (interpreter) inside the model."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need TRITON_INTERPRET=1 before triton is imported")
    pytest.importorskip("triton")
    ids = torch.randint(0, 512, (1, 22), generator=torch.Generator().manual_seed(1))
    ref = _run(model, cache_cls, ids, 20)
    _with_kernels(monkeypatch)
    got = _run(model, cache_cls, ids, 20)
    assert rel_err(got, ref) < 3e-3


@pytest.mark.interpreter
@pytest.mark.parametrize("cache_cls", [ExLlamaV2Cache, ExLlamaV2Cache_Q4])
def test_left_padded_batch_with_kernels(model: ExLlamaV2, cache_cls: type, monkeypatch: pytest.MonkeyPatch) -> None:
    """A left-padded batch (key mask, shifted RoPE positions) over two chunks, kernels under the interpreter."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need TRITON_INTERPRET=1 before triton is imported")
    pytest.importorskip("triton")
    ids = torch.randint(3, 500, (2, 20), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 24, dtype=torch.bool)
    mask[1, :5] = False
    offsets = torch.tensor([0, -5])

    def run() -> torch.Tensor:
        cache = cache_cls(model, batch_size=2, max_seq_len=24)
        a = model.forward(ids[:, :17], cache, input_mask=mask, position_offsets=offsets)
        b = model.forward(ids[:, 17:18], cache, input_mask=mask, position_offsets=offsets)
        return torch.cat([a, b], 1)

    ref = run()
    _with_kernels(monkeypatch)
    got = run()
    # Row 1's first 5 positions are padding: their queries see no key, and their outputs are undefined.
    assert rel_err(got[0], ref[0]) < 3e-3 and rel_err(got[1, 5:], ref[1, 5:]) < 3e-3
