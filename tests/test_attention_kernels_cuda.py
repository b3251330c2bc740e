"""Flash and quantized-cache attention kernels at real shapes on a GPU (8B layer sizes, 2k-32k contexts, GQA 4:1
and 8:1, head_dim 64/128), against fp32 attention on sampled query rows; CUDA-graph replay.

Run without TRITON_INTERPRET (e.g. `TRITON_INTERPRET=0 python -m pytest -q tests/test_attention_kernels_cuda.py`);
kernel modules are imported inside the tests so that collecting this file never fixes Triton's mode for the
interpreter tests collected beside it.
"""

from __future__ import annotations

import os

import pytest
import torch

from exlpy.kernels import ops, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiled kernels: run without "
                       "TRITON_INTERPRET"),
]
DEV = "cuda"
PAGE = 256


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _sample_rows(T: int, n: int = 96) -> torch.Tensor:
    """First, last and random query rows of a block (where causal masks and long ranges are)."""
    g = torch.Generator().manual_seed(T)
    mid = torch.randint(0, T, (n,), generator=g)
    return torch.unique(torch.cat([torch.arange(min(16, T)), mid, torch.arange(max(0, T - 16), T)])).to(DEV)


def _ref_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor,
              scale: float) -> torch.Tensor:
    """fp32 attention of q[rows] ([T, Hq, D], one sequence) over k/v [L, Hk, D], key t visible when t <= pos."""
    G = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(G, dim=1)
    vf = v.float().repeat_interleave(G, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q[rows].float(), kf) * scale
    keep = torch.arange(k.shape[0], device=q.device).view(1, -1) <= pos[rows].view(-1, 1)
    p = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1)
    return torch.einsum("hnl,lhd->nhd", p, vf)


def _pool(n_tokens: int, hk: int, D: int, dtype: torch.dtype, seed: int):
    """A paged pool with room for n_tokens, pages in random order: (k_pool, v_pool, block_table [1, P])."""
    pages = (n_tokens + PAGE - 1) // PAGE
    g = torch.Generator(device=DEV).manual_seed(seed)
    kp = torch.zeros(pages + 5, PAGE, hk, D, device=DEV, dtype=dtype)
    vp = torch.zeros_like(kp)
    bt = (torch.randperm(pages + 5, device=DEV, generator=g)[:pages]).int().view(1, -1)
    return kp, vp, bt


SHAPES = [(32, 8, 128, 2048), (32, 8, 128, 8192), (32, 8, 128, 32768), (32, 4, 128, 8192), (32, 8, 64, 8192),
          (32, 4, 64, 2048)]


@pytest.mark.parametrize("hq,hk,D,T", SHAPES)
def test_flash_prefill_one_forward_contiguous(hq: int, hk: int, D: int, T: int) -> None:
    from exlpy.kernels.flash_attention import flash_attention

    torch.manual_seed(0)
    q = torch.randn(1, T, hq, D, device=DEV, dtype=torch.float16)
    kc = torch.randn(1, T, hk, D, device=DEV, dtype=torch.float16)
    vc = torch.randn(1, T, hk, D, device=DEV, dtype=torch.float16)
    pos = torch.arange(T, device=DEV).view(1, T)
    lens = torch.tensor([T], dtype=torch.int32, device=DEV)
    bt = torch.zeros(1, 1, dtype=torch.int32, device=DEV)
    scale = D ** -0.5
    out = flash_attention(q, kc, vc, bt, T, lens, T, pos, scale)
    rows = _sample_rows(T)
    assert _rel(out[0, rows], _ref_rows(q[0], kc[0], vc[0], pos[0], rows, scale)) < 2e-3
    if T <= 8192:  # the whole output against torch's flash SDPA as well
        qt, kt, vt = (x.transpose(1, 2) for x in (q, kc, vc))
        sd = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale,
                                                              enable_gqa=True).transpose(1, 2)
        assert _rel(out, sd) < 2e-3


@pytest.mark.parametrize("hq,hk,D,T,chunk", [(32, 8, 128, 8192, 2048), (32, 8, 128, 32768, 4096),
                                             (32, 4, 64, 8192, 1536)])
def test_flash_chunked_prefill_paged(hq: int, hk: int, D: int, T: int, chunk: int) -> None:
    """The dynamic generator's way: chunks written into scattered 256-token pages, each chunk reading all
    earlier chunks' K/V through the block table."""
    torch.manual_seed(1)
    k = torch.randn(T, hk, D, device=DEV, dtype=torch.float16)
    v = torch.randn(T, hk, D, device=DEV, dtype=torch.float16)
    q = torch.randn(T, hq, D, device=DEV, dtype=torch.float16)
    kp, vp, bt = _pool(T, hk, D, torch.float16, 1)
    t = torch.arange(T, device=DEV)
    slots = (bt[0, t // PAGE].long() * PAGE + t % PAGE).view(1, T)
    scale = D ** -0.5
    for a in range(0, T, chunk):
        e = min(T, a + chunk)
        ops.store_kv(kp, vp, slots[:, a:e], k[None, a:e], v[None, a:e])
        lens = torch.tensor([e], dtype=torch.int32, device=DEV)
        out = ops.paged_attention(q[None, a:e], kp, vp, bt, PAGE, lens, e, t[None, a:e], scale)
        rows = _sample_rows(e - a, 32) + a
        assert _rel(out[0, rows - a], _ref_rows(q, k, v, t, rows, scale)) < 2e-3, (a, e)


@pytest.mark.parametrize("paged", [False, True])
def test_flash_tma_tiles_8k(paged: bool) -> None:
    """The TMA variant (EXLPY_FLASH_TMA=1) on an 8k block, over a contiguous cache and over shuffled pages."""
    from exlpy.kernels.flash_attention import flash_attention_launch, plain_operand

    torch.manual_seed(6)
    T, hq, hk, D = 8192, 32, 8, 128
    q = torch.randn(1, T, hq, D, device=DEV, dtype=torch.float16)
    k = torch.randn(T, hk, D, device=DEV, dtype=torch.float16)
    v = torch.randn(T, hk, D, device=DEV, dtype=torch.float16)
    t = torch.arange(T, device=DEV)
    if paged:
        kc, vc, bt = _pool(T, hk, D, torch.float16, 6)
        rows = bt[0, t // PAGE].long() * PAGE + t % PAGE
        kc.view(-1, hk, D)[rows], vc.view(-1, hk, D)[rows] = k, v
        page = PAGE
    else:
        kc, vc, bt, page = k[None], v[None], torch.zeros(1, 1, dtype=torch.int32, device=DEV), T
    lens = torch.tensor([T], dtype=torch.int32, device=DEV)
    out = flash_attention_launch(q, plain_operand(kc), plain_operand(vc), bt, page, lens, T, t[None], D ** -0.5,
                                 tma=True)
    rows = _sample_rows(T)
    assert _rel(out[0, rows], _ref_rows(q[0], k, v, t, rows, D ** -0.5)) < 2e-3


@pytest.mark.parametrize("T", [1, 4, 8])
def test_flash_short_blocks_split_keys(T: int) -> None:
    """Decode and verify-sized blocks of two sequences of different lengths (32k and 5k) in one paged pool."""
    from exlpy.kernels.flash_attention import flash_attention

    torch.manual_seed(2)
    hq, hk, D = 32, 8, 128
    lens_l = [32768, 5000]
    kp, vp, bt = _pool(2 * 32768, hk, D, torch.float16, 2)
    bt = bt.view(2, -1)
    kp.normal_()
    vp.normal_()
    q = torch.randn(2, T, hq, D, device=DEV, dtype=torch.float16)
    lens = torch.tensor(lens_l, dtype=torch.int32, device=DEV)
    pos = lens.long().view(-1, 1) - T + torch.arange(T, device=DEV)
    out = flash_attention(q, kp, vp, bt, PAGE, lens, max(lens_l), pos, 0.088)
    for b, L in enumerate(lens_l):
        k = reference.gather_kv(kp, bt[b:b + 1], PAGE, L)[0]
        v = reference.gather_kv(vp, bt[b:b + 1], PAGE, L)[0]
        rows = torch.arange(T, device=DEV)
        assert _rel(out[b], _ref_rows(q[b], k, v, pos[b], rows, 0.088)) < 2e-3


def test_flash_bf16_and_key_mask() -> None:
    from exlpy.kernels.flash_attention import flash_attention

    torch.manual_seed(3)
    B, T, S, hq, hk, D = 2, 512, 1536, 32, 8, 128
    kc = torch.randn(B, S, hk, D, device=DEV, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(B, T, hq, D, device=DEV, dtype=torch.bfloat16)
    past = torch.tensor([1000, 300], device=DEV)
    pos = past.view(-1, 1) + torch.arange(T, device=DEV)
    lens = (past + T).int()
    mask = torch.rand(B, S, device=DEV) > 0.2
    mask[:, 0] = True
    bt = torch.arange(B, device=DEV).int().view(B, 1)
    out = flash_attention(q, kc, vc, bt, S, lens, S, pos, 0.1, mask)
    ref = reference.paged_attention(q.float(), kc.float(), vc.float(), bt, S, lens, int(lens.max()), pos, 0.1,
                                    mask)
    assert _rel(out, ref) < 1e-2


def _quant_pool(n_tokens: int, hk: int, D: int, k_bits: int, v_bits: int, fp8: bool):
    pages = (n_tokens + PAGE - 1) // PAGE + 5  # as many pages as _pool's: its block tables index all of them
    E = hk * D
    kq = torch.zeros(pages, PAGE, E * k_bits // 8, dtype=torch.uint8, device=DEV)
    vq = torch.zeros(pages, PAGE, E * v_bits // 8, dtype=torch.uint8, device=DEV)
    ks = None if fp8 else torch.zeros(pages, PAGE, E // 32, dtype=torch.float16, device=DEV)
    vs = None if fp8 else torch.zeros(pages, PAGE, E // 32, dtype=torch.float16, device=DEV)
    return kq, ks, vq, vs


FORMATS = [(4, 4, False), (8, 4, False), (8, 8, False), (8, 8, True)]  # Q4, Q6, Q8, FP8


@pytest.mark.parametrize("k_bits,v_bits,fp8", FORMATS)
@pytest.mark.parametrize("hq,hk,D", [(32, 8, 128), (32, 4, 64)])
def test_quant_cache_32k_decode_and_verify(k_bits: int, v_bits: int, fp8: bool, hq: int, hk: int, D: int) -> None:
    torch.manual_seed(4)
    L = 32768
    kq, ks, vq, vs = _quant_pool(L, hk, D, k_bits, v_bits, fp8)
    bt = torch.randperm(kq.shape[0], device=DEV)[:L // PAGE].int().view(1, -1)
    t = torch.arange(L, device=DEV)
    slots = (bt[0, t // PAGE].long() * PAGE + t % PAGE).view(1, L)
    k = torch.randn(1, L, hk, D, device=DEV, dtype=torch.float16)
    v = torch.randn(1, L, hk, D, device=DEV, dtype=torch.float16)
    ref_codes = [x.clone() if x is not None else None for x in (kq, ks, vq, vs)]
    reference.store_kv_quant(*ref_codes, slots, k, v, k_bits, v_bits)
    ops.store_kv_quant(kq, ks, vq, vs, slots, k, v, k_bits, v_bits)
    # The kernel's fp32 rotation may round differently from cuBLAS at exact code boundaries: rare +-1 codes.
    assert (kq != ref_codes[0]).float().mean().item() < 1e-3 and (vq != ref_codes[2]).float().mean().item() < 1e-3
    for T in (1, 4):
        q = torch.randn(1, T, hq, D, device=DEV, dtype=torch.float16)
        lens = torch.tensor([L], dtype=torch.int32, device=DEV)
        pos = (L - T + torch.arange(T, device=DEV)).view(1, T)
        out = ops.quant_attention(q, kq, ks, vq, vs, bt, PAGE, lens, L, pos, D ** -0.5, k_bits, v_bits)
        ref = reference.quant_attention(q.float(), kq, ks, vq, vs, bt, PAGE, lens, L, pos, D ** -0.5, k_bits,
                                        v_bits)
        assert _rel(out, ref) < 5e-3, T


def test_graph_replay_of_flash_and_quant_steps() -> None:
    """A verify step (T=4, two sequences) captured once and replayed with new lengths, positions and K/V."""
    torch.manual_seed(5)
    B, T, hq, hk, D, cap = 2, 4, 32, 8, 128, 4096
    kp, vp, bt = _pool(B * cap, hk, D, torch.float16, 5)
    bt = bt.view(B, -1)
    kq, ks, vq, vs = _quant_pool(B * cap, hk, D, 4, 4, False)
    q = torch.randn(B, T, hq, D, device=DEV, dtype=torch.float16)
    knew = torch.randn(B, T, hk, D, device=DEV, dtype=torch.float16)
    vnew = torch.randn_like(knew)
    pos = torch.zeros(B, T, dtype=torch.long, device=DEV)
    lens = torch.zeros(B, dtype=torch.int32, device=DEV)
    slots = torch.zeros(B, T, dtype=torch.long, device=DEV)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        ops.store_kv(kp, vp, slots, knew, vnew)
        ops.store_kv_quant(kq, ks, vq, vs, slots, knew, vnew, 4, 4)
        a = ops.paged_attention(q, kp, vp, bt, PAGE, lens, cap, pos, 0.1)
        b = ops.quant_attention(q, kq, ks, vq, vs, bt, PAGE, lens, cap, pos, 0.1, 4, 4, None, knew, vnew)
        return a, b

    def set_inputs(lengths: list[int]) -> None:
        L = torch.tensor(lengths, device=DEV)
        pos.copy_(L.view(-1, 1) - T + torch.arange(T, device=DEV))
        lens.copy_(L.int())
        slots.copy_(bt.gather(1, pos // PAGE).long() * PAGE + pos % PAGE)
        q.normal_()
        knew.normal_()
        vnew.normal_()

    kp.normal_()
    vp.normal_()
    set_inputs([100, 200])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_a, out_b = step()
    for lengths in ([3000, 17], [4096, 1500]):
        set_inputs(lengths)
        graph.replay()
        ref_a, ref_b = step()  # eager, same inputs (writing the same rows again)
        assert torch.equal(out_a, ref_a) and torch.equal(out_b, ref_b)


@pytest.mark.parametrize("D,window,softcap", [(256, 4096, 50.0), (256, 0, 50.0), (96, 2047, 0.0), (128, 512, 0.0)])
def test_flash_window_softcap_real_shapes(D: int, window: int, softcap: float) -> None:
    """Gemma-2 (head 256, window 4096, cap 50), Phi-3 (head 96, window 2047) shapes: a 1k chunk after 5k cached
    tokens in a paged cache, against fp32 attention over the gathered keys."""
    from exlpy.kernels.flash_attention import flash_attention

    g = torch.Generator(device=DEV).manual_seed(D + window)
    hq, hk, past, T = 16, 8, 5120, 1024
    L = past + T
    pages = L // PAGE
    kc = torch.randn(pages + 3, PAGE, hk, D, device=DEV, dtype=torch.float16, generator=g)
    vc = torch.randn_like(kc)
    bt = torch.randperm(pages + 3, device=DEV)[:pages].view(1, -1).int()
    q = torch.randn(1, T, hq, D, device=DEV, dtype=torch.float16, generator=g) * 2
    pos = torch.arange(past, L, device=DEV).view(1, -1)
    lens = torch.tensor([L], device=DEV, dtype=torch.int32)
    out = flash_attention(q, kc, vc, bt, PAGE, lens, L, pos, D ** -0.5, None, window, softcap)
    ref = reference.paged_attention(q.float(), kc.float(), vc.float(), bt, PAGE, lens, L, pos, D ** -0.5, None,
                                    window, softcap)
    assert _rel(out, ref) < 2e-2
    # the same through the dispatch layer, one decode token (the decode kernel)
    one = ops.paged_attention(q[:, -1:], kc, vc, bt, PAGE, lens, L, pos[:, -1:], D ** -0.5, None, window, softcap)
    assert _rel(one, ref[:, -1:]) < 2e-2
