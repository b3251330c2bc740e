"""Flash attention over the cache and the quantized-cache kernels against their torch references: small shapes
on CPU under the Triton interpreter (GPU shapes: test_attention_kernels_cuda.py)."""

from __future__ import annotations

import os

import pytest
import torch

from exlpy.cache import qcodec
from exlpy.errors import ConfigError
from exlpy.kernels import ops, reference

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from exlpy.kernels.flash_attention import (  # noqa: E402
    flash_attention,
    flash_attention_launch,
    plain_operand,
    quant_attention,
    quant_operand,
)
from exlpy.kernels.kv_tiles import hadamard_blocks  # noqa: E402
from exlpy.kernels.quant_kv_store import store_kv_quant  # noqa: E402

pytestmark = pytest.mark.interpreter  # CPU tensors through the kernels: tests/conftest.py runs these in a child

SMALL = (16, 16, 4, 1)  # BLOCK_M, BLOCK_N, warps, stages: several query and key blocks even on tiny shapes


@pytest.fixture(autouse=True)
def _interpreter_only() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need TRITON_INTERPRET=1 before triton is imported")


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    err = ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6)).item()
    assert err < tol, f"relative error {err:.3g} >= {tol}"


def _paged(B: int, pages: int, page: int, hk: int, D: int, g: torch.Generator, dtype=torch.float32):
    """A pool of B * pages + 3 pages, each sequence's pages at random places in it."""
    n = B * pages + 3
    kc = torch.randn(n, page, hk, D, generator=g).to(dtype)
    vc = torch.randn(n, page, hk, D, generator=g).to(dtype)
    bt = torch.randperm(n, generator=g)[:B * pages].view(B, pages).int()
    return kc, vc, bt


@triton.jit
def _hadamard_out(out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i[:, None] * N + i[None, :], hadamard_blocks(N))


def test_in_kernel_hadamard_is_qcodec_rotation() -> None:
    out = torch.empty(64, 64)
    _hadamard_out[(1,)](out, N=64)
    h = qcodec._hadamard("cpu", torch.float32)
    assert torch.allclose(out, torch.block_diag(h, h), atol=1e-7)


@pytest.mark.parametrize("G,D", [(1, 16), (3, 24), (4, 32)])
def test_flash_prefill_contiguous_rows_with_different_pasts(G: int, D: int) -> None:
    g = torch.Generator().manual_seed(G * 100 + D)
    B, S, hk, T = 2, 41, 2, 19
    kc, vc = torch.randn(B, S, hk, D, generator=g), torch.randn(B, S, hk, D, generator=g)
    past = torch.tensor([13, 2])
    pos = past.view(-1, 1) + torch.arange(T)
    lens = (past + T).int()
    q = torch.randn(B, T, hk * G, D, generator=g)
    bt = torch.arange(B).int().view(B, 1)
    ref = reference.paged_attention(q, kc, vc, bt, S, lens, int(lens.max()), pos, 0.3)
    out = flash_attention_launch(q, plain_operand(kc), plain_operand(vc), bt, S, lens, int(lens.max()), pos, 0.3,
                                 config=SMALL)
    _close(out, ref, 1e-5)


# Pages of whole key blocks (table entries read in groups of 8 or 2 pages), and pages that split key blocks.
@pytest.mark.parametrize("page,group", [(16, 8), (16, 2), (24, 8)])
def test_flash_chunked_prefill_into_paged_cache(page: int, group: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks written one after the other; each chunk's queries read the earlier chunks' K/V from the pages
    (table entries read `group` pages at a time), or not."""
    from exlpy.kernels import flash_attention as fa

    monkeypatch.setattr(fa, "GROUP_PAGES", group)
    g = torch.Generator().manual_seed(page)
    B, hk, G, D, L = 2, 1, 4, 32, 70
    kc, vc, bt = _paged(B, 5, page, hk, D, g)
    k, v = torch.randn(B, L, hk, D, generator=g), torch.randn(B, L, hk, D, generator=g)
    q = torch.randn(B, L, hk * G, D, generator=g)
    t = torch.arange(L)
    slots = bt[:, t // page].long() * page + t % page
    whole = reference.sdpa(q, k, v, 0.25, (t.view(1, -1) <= t.view(-1, 1)).view(1, 1, L, L))
    for a, e in ((0, 30), (30, 47), (47, 70)):
        reference.store_kv(kc, vc, slots[:, a:e], k[:, a:e], v[:, a:e])
        pos = t[a:e].expand(B, -1)
        lens = torch.full((B,), e, dtype=torch.int32)
        out = flash_attention_launch(q[:, a:e], plain_operand(kc), plain_operand(vc), bt, page, lens, e, pos, 0.25,
                                     config=(64, 16, 4, 1))
        _close(out, whole[:, a:e], 1e-5)


@pytest.mark.parametrize("paged", [False, True])
def test_flash_tma_tiles(paged: bool) -> None:
    """Interior tiles as tensor-descriptor (TMA) copies, boundary tiles as masked loads."""
    g = torch.Generator().manual_seed(11)
    B, hk, G, D, page, T = 2, 2, 4, 32, 16, 20
    if paged:
        kc, vc, bt = _paged(B, 5, page, hk, D, g)
    else:
        page = 90
        kc, vc = torch.randn(B, page, hk, D, generator=g), torch.randn(B, page, hk, D, generator=g)
        bt = torch.arange(B).int().view(B, 1)
    lens = torch.tensor([70, 45], dtype=torch.int32)
    pos = lens.long().view(-1, 1) - T + torch.arange(T)
    q = torch.randn(B, T, hk * G, D, generator=g)
    ref = reference.paged_attention(q, kc, vc, bt, page, lens, 70, pos, 0.3)
    out = flash_attention_launch(q, plain_operand(kc), plain_operand(vc), bt, page, lens, 70, pos, 0.3,
                                 config=SMALL, tma=True)
    _close(out, ref, 1e-5)


def test_flash_key_mask_padding_rows_and_splits() -> None:
    g = torch.Generator().manual_seed(7)
    B, hk, G, D, page, T = 3, 2, 2, 16, 16, 6
    kc, vc, bt = _paged(B, 3, page, hk, D, g)
    lens = torch.tensor([40, 9, 0], dtype=torch.int32)  # the last row is batch padding: nothing to see
    pos = (lens.long().view(-1, 1) - T + torch.arange(T)).clamp(min=0)
    mask = torch.rand(B, 3 * page, generator=g) > 0.3
    mask[:, 0] = True
    q = torch.randn(B, T, hk * G, D, generator=g)
    ref = reference.paged_attention(q, kc, vc, bt, page, lens, 40, pos, 0.3, mask)
    for splits in (1, 3):
        out = flash_attention_launch(q, plain_operand(kc), plain_operand(vc), bt, page, lens, 40, pos, 0.3, mask,
                                     config=SMALL, splits=splits)
        assert torch.isfinite(out).all()
        _close(out[:2], ref[:2], 1e-5)


def test_flash_fp16_and_default_configs() -> None:
    """The public entry with its own tables: a verify-sized block (split keys) and a prefill-sized one."""
    g = torch.Generator().manual_seed(8)
    hk, G, D, page = 2, 4, 64, 256
    kc, vc, bt = _paged(1, 1, page, hk, D, g, torch.float16)
    for T, L in ((3, 200), (40, 90)):
        q = torch.randn(1, T, hk * G, D, generator=g).half()
        pos = (L - T + torch.arange(T)).view(1, T)
        lens = torch.tensor([L], dtype=torch.int32)
        ref = reference.paged_attention(q.float(), kc.float(), vc.float(), bt, page, lens, L, pos, 0.125)
        _close(flash_attention(q, kc, vc, bt, page, lens, L, pos, 0.125), ref, 2e-3)


def _quant_cache(B: int, pages: int, page: int, E: int, k_bits: int, v_bits: int, fp8: bool):
    n = B * pages + 1
    kq = torch.zeros(n, page, E * k_bits // 8, dtype=torch.uint8)
    vq = torch.zeros(n, page, E * v_bits // 8, dtype=torch.uint8)
    ks = None if fp8 else torch.zeros(n, page, E // 32, dtype=torch.float16)
    vs = None if fp8 else torch.zeros(n, page, E // 32, dtype=torch.float16)
    return kq, ks, vq, vs


FORMATS = [(4, 4, False), (8, 4, False), (8, 8, False), (8, 8, True)]  # Q4, Q6 (K8 V4), Q8, FP8


@pytest.mark.parametrize("k_bits,v_bits,fp8", FORMATS)
def test_store_kv_quant_matches_qcodec(k_bits: int, v_bits: int, fp8: bool) -> None:
    g = torch.Generator().manual_seed(k_bits + v_bits + fp8)
    hk, D, page = 2, 32, 8
    kq, ks, vq, vs = _quant_cache(1, 4, page, hk * D, k_bits, v_bits, fp8)
    k, v = torch.randn(3, 4, hk, D, generator=g), torch.randn(3, 4, hk, D, generator=g)
    slots = torch.randperm(kq.shape[0] * page, generator=g)[:12].view(3, 4)
    slots[1, 2] = -1  # a padding row writes nothing
    ref = [t.clone() if t is not None else None for t in (kq, ks, vq, vs)]
    reference.store_kv_quant(*ref, slots, k, v, k_bits, v_bits)
    store_kv_quant(kq, ks, vq, vs, slots, k, v, k_bits, v_bits)
    assert torch.equal(kq, ref[0]) and torch.equal(vq, ref[2])
    if not fp8:
        assert torch.equal(ks, ref[1]) and torch.equal(vs, ref[3])


@pytest.mark.parametrize("k_bits,v_bits,fp8", FORMATS)
@pytest.mark.parametrize("T", [1, 5])
def test_quant_attention_reads_codes_in_place(k_bits: int, v_bits: int, fp8: bool, T: int) -> None:
    g = torch.Generator().manual_seed(T * 10 + k_bits)
    B, hk, G, D, page, pages = 2, 2, 4, 64, 16, 4
    kq, ks, vq, vs = _quant_cache(B, pages, page, hk * D, k_bits, v_bits, fp8)
    bt = torch.randperm(kq.shape[0], generator=g)[:B * pages].view(B, pages).int()
    lens = torch.tensor([50, 37], dtype=torch.int32)
    t = torch.arange(pages * page)
    slots = torch.where(t < lens.view(-1, 1), bt[:, t // page].long() * page + t % page, -1)
    k_all, v_all = torch.randn(B, pages * page, hk, D, generator=g), torch.randn(B, pages * page, hk, D, generator=g)
    ops.store_kv_quant(kq, ks, vq, vs, slots, k_all, v_all, k_bits, v_bits)
    pos = lens.long().view(-1, 1) - T + torch.arange(T)
    q = torch.randn(B, T, hk * G, D, generator=g)
    ref = reference.quant_attention(q, kq, ks, vq, vs, bt, page, lens, 50, pos, 0.2, k_bits, v_bits)
    # K and V tiles are fp16 in the kernel: the reference dequantizes to fp32. One key range, then split keys
    # (the entry's own choice for these short blocks).
    out = flash_attention_launch(q, quant_operand(kq, ks, k_bits), quant_operand(vq, vs, v_bits), bt, page,
                                 lens, 50, pos, 0.2, config=(16, 16, 4, 1), splits=1)
    _close(out, ref, 3e-3)
    _close(quant_attention(q, kq, ks, vq, vs, bt, page, lens, 50, pos, 0.2, k_bits, v_bits), ref, 3e-3)
    # This step's own K/V unquantized (exllamav2's fresh rows in its fp16 working copy).
    rows = pos.unsqueeze(-1).unsqueeze(-1).expand(-1, -1, hk, D)
    k_new, v_new = k_all.gather(1, rows), v_all.gather(1, rows)
    ref_new = reference.quant_attention(q, kq, ks, vq, vs, bt, page, lens, 50, pos, 0.2, k_bits, v_bits,
                                        k_new=k_new, v_new=v_new)
    assert ((ref_new - ref).abs().max() > 1e-3).item()  # the fresh rows do change the result
    out = flash_attention_launch(q, quant_operand(kq, ks, k_bits), quant_operand(vq, vs, v_bits), bt, page,
                                 lens, 50, pos, 0.2, None, k_new, v_new, config=(16, 16, 4, 1), splits=3)
    _close(out, ref_new, 3e-3)


def test_quant_attention_rejects_unsupported_head_dim() -> None:
    kq, ks, vq, vs = _quant_cache(1, 1, 8, 96, 8, 8, False)
    q = torch.randn(1, 1, 2, 48)
    with pytest.raises(ConfigError, match="head_dim"):
        quant_attention(q, kq, ks, vq, vs, torch.zeros(1, 1, dtype=torch.int32), 8,
                        torch.tensor([3], dtype=torch.int32), 3, torch.tensor([[2]]), 0.1, 8, 8)


@pytest.mark.parametrize("page,window,softcap,splits", [(24, 0, 1.5, None), (16, 9, 0.7, 4), (70, 33, 0.0, 2)])
def test_flash_sliding_window_and_softcap(page: int, window: int, softcap: float, splits: int | None) -> None:
    """Chunked prefill with a sliding window (Gemma 2, Cohere 2, Phi-3, StarCoder2) and soft-capped scores:
    paged caches (whole and split key blocks), a contiguous one (page 70), with and without a key split."""
    g = torch.Generator().manual_seed(page + window)
    B, hk, G, D, L = 2, 1, 4, 32, 70
    kc, vc, bt = _paged(B, triton.cdiv(L, page), page, hk, D, g)
    k, v = torch.randn(B, L, hk, D, generator=g), torch.randn(B, L, hk, D, generator=g)
    q = torch.randn(B, L, hk * G, D, generator=g) * 3
    t = torch.arange(L)
    slots = bt[:, t // page].long() * page + t % page
    reference.store_kv(kc, vc, slots, k, v)
    for a, e in ((0, 30), (30, 47), (47, 70)):
        pos = t[a:e].expand(B, -1)
        lens = torch.full((B,), e, dtype=torch.int32)
        ref = reference.paged_attention(q[:, a:e], kc, vc, bt, page, lens, e, pos, 0.25, None, window, softcap)
        out = flash_attention_launch(q[:, a:e], plain_operand(kc), plain_operand(vc), bt, page, lens, e, pos, 0.25,
                                     config=(64, 16, 4, 1), splits=splits, window=window, softcap=softcap)
        _close(out, ref, 1e-5)
