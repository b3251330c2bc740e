"""Attention of chunks holding Gemma 3 image tokens: per-query key limits (an image token sees the rest of its
image) in the torch references, against a mask built independently from the image ids, and in the flash kernel
(Triton interpreter), over plain and quantized caches, with past chunks, windows and key splits."""

from __future__ import annotations

import os

import pytest
import torch

from exlpy.kernels import ops, reference
from exlpy.vision.attention import ImageSpans, extents


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    err = ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6)).item()
    assert err < tol, f"relative error {err:.3g} >= {tol}"


def _blocks(B: int, T: int, runs: list[tuple[int, int, int]]) -> torch.Tensor:
    """[B, T] image ids (-1: text) with run r = (row, start, end) numbered in order."""
    out = torch.full((B, T), -1, dtype=torch.long)
    for k, (b, s, e) in enumerate(runs):
        out[b, s:e] = k
    return out


def _want_mask(blocks: torch.Tensor, past: torch.Tensor, L: int, window: int) -> torch.Tensor:
    """[B, 1, T, L]: causal over the cache, or the same image both ways, within the window (as transformers' Gemma
    3 for images no longer than the window), keys below the row's length. Built pair by pair, not from limits."""
    B, T = blocks.shape
    out = torch.zeros(B, 1, T, L, dtype=torch.bool)
    for b in range(B):
        for i in range(T):
            p = int(past[b]) + i
            for t in range(min(L, int(past[b]) + T)):
                j = t - int(past[b])
                same = 0 <= j < T and blocks[b, i] >= 0 and blocks[b, j] == blocks[b, i]
                out[b, 0, i, t] = (t <= p or same) and (not window or p - t < window)
    return out


def test_extents_reach_the_last_token_of_each_image() -> None:
    blocks = torch.tensor([[-1, 0, 0, 0, -1, 1, 1, -1], [2, 2, -1, -1, 3, 3, 3, 3]])
    assert extents(blocks).tolist() == [[0, 2, 1, 0, 0, 1, 0, 0], [1, 0, 0, 0, 3, 2, 1, 0]]
    assert extents(torch.full((1, 5), -1)).tolist() == [[0] * 5]
    spans = ImageSpans(blocks)
    pos = torch.arange(8).expand(2, 8) + 10
    assert torch.equal(spans.limits(pos), pos + extents(blocks))
    assert spans.limits(pos) is spans.limits(pos)  # once per forward pass, not per layer


@pytest.mark.parametrize("window", [0, 5])
def test_reference_limits_are_the_image_mask(window: int) -> None:
    g = torch.Generator().manual_seed(3 + window)
    B, T, hk, G, D, page = 2, 12, 2, 2, 16, 8
    past = torch.tensor([5, 0])
    blocks = _blocks(B, T, [(0, 2, 6), (0, 8, 11), (1, 0, 3), (1, 4, 12)])
    L = int((past + T).max())
    kc = torch.randn(B * 3, page, hk, D, generator=g)
    vc = torch.randn(B * 3, page, hk, D, generator=g)
    bt = torch.tensor([[4, 0, 2], [1, 5, 3]], dtype=torch.int32)
    pos = past.view(-1, 1) + torch.arange(T)
    lens = (past + T).int()
    q = torch.randn(B, T, hk * G, D, generator=g)
    lim = ImageSpans(blocks).limits(pos)
    out = reference.paged_attention(q, kc, vc, bt, page, lens, L, pos, 0.3, None, window, 0.0, lim)
    k, v = reference.gather_kv(kc, bt, page, L), reference.gather_kv(vc, bt, page, L)
    want = reference.sdpa(q, k, v, 0.3, _want_mask(blocks, past, L, window))
    _close(out, want, 1e-6)
    causal = reference.paged_attention(q, kc, vc, bt, page, lens, L, pos, 0.3, None, window)
    assert (causal - want).abs().max() > 1e-2  # the images' later tokens do count


def test_self_mask_without_cache() -> None:
    blocks = _blocks(1, 9, [(0, 1, 5)])
    mask = ImageSpans(blocks).self_mask(torch.device("cpu"), 3, None)
    assert torch.equal(mask, _want_mask(blocks, torch.tensor([0]), 9, 3))


def test_attention_of_an_image_chunk_reads_nothing_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer's attention of a prompt chunk with images runs one kernel call with the shared limits, and the
    model code around the kernel calls reads no tensor back to the host (on a GPU each read waits for the queued
    work: the cost this path used to pay per layer, with a mask, a K/V gather and cuDNN's masked attention). The
    kernel calls run the torch references here (which may read on the CPU); on GPUs they are Triton kernels."""
    from torch.overrides import TorchFunctionMode

    from exlpy.model import attention as attn_mod
    from exlpy.vision.attention import ImageSpans as Spans
    from exlpy.vision.mm import MMInputs

    reads = {"item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu",
             "argwhere", "unique", "masked_select"}

    def bool_index(args: tuple) -> bool:  # x[mask] / x[mask] = y: a nonzero() inside, read back on a GPU
        idx = args[1] if len(args) > 1 else None
        parts = idx if isinstance(idx, tuple) else (idx,)
        return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)

    class HostReads(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []
            self.paused = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            name = getattr(func, "__name__", "")
            if self.paused:
                pass
            elif name in reads or (name in ("__getitem__", "__setitem__") and bool_index(args)):
                self.seen.append(name)
            return func(*args, **(kwargs or {}))

    mode = HostReads()
    calls: list[str] = []
    limits: list[torch.Tensor | None] = []

    def kernel(name: str):  # noqa: ANN202 - the dispatch entry `name`, counted, with the mode paused inside
        real = getattr(ops, name)

        def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls.append(name)
            if name == "paged_attention":
                limits.append(kwargs.get("limits"))
            mode.paused += 1
            try:
                return real(*args, **kwargs)
            finally:
                mode.paused -= 1
        return run

    for name in ("rope_store_kv", "apply_rope", "store_kv", "paged_attention", "sdpa"):
        monkeypatch.setattr(ops, name, kernel(name))
    uploads: list[int] = []
    real_on = Spans.on

    def on(self, device):  # noqa: ANN001, ANN202
        if str(device) not in self._device:
            uploads.append(1)
        return real_on(self, device)

    monkeypatch.setattr(Spans, "on", on)
    g = torch.Generator().manual_seed(5)
    B, T, hk, G, D, page, layers = 1, 20, 2, 2, 16, 16, 3
    blocks = _blocks(B, T, [(0, 4, 12)])
    pos = torch.arange(T).view(1, T)
    batch = type("Batch", (), {})()
    batch.mm = MMInputs([], blocks=blocks)
    batch.positions, batch.rope_pos, batch.rope_positions = pos, pos, None
    batch.cache = type("Cache", (), {})()
    kc, vc = torch.zeros(2, page, hk, D), torch.zeros(2, page, hk, D)
    batch.cache.layer_kv = lambda i: (kc, vc)
    batch.block_table = torch.tensor([[1, 0]], dtype=torch.int32)
    t = torch.arange(T)
    batch.slots = (batch.block_table[:, t // page].long() * page + t % page).view(1, T)
    batch.page_size, batch.seqlens, batch.max_seqlen = page, torch.tensor([T], dtype=torch.int32), T
    batch.key_mask, batch.past_len, batch.q_len, batch.batch_size = None, 0, T, B
    batch.segments = None  # one pass of one q_len, not a mixed pass (model/batch.py mixed_batch)
    cos, sin = torch.ones(64, D), torch.zeros(64, D)
    with mode:
        for layer in range(layers):
            q, k, v = (torch.randn(B, T, h, D, generator=g) for h in (hk * G, hk, hk))
            out = attn_mod.attend(q, k, v, batch, layer, 0.25, (cos, sin), window=8 if layer % 2 else 0)
            assert out.shape == q.shape
    assert mode.seen == []
    assert calls == ["rope_store_kv", "paged_attention"] * layers  # as a text chunk: no mask, no gather
    assert limits[0] is not None and all(c is limits[0] for c in limits)
    assert uploads == [1]


# The flash kernel itself, on CPU tensors under the Triton interpreter.
interp = pytest.mark.interpreter


@pytest.fixture
def _interpreter() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need TRITON_INTERPRET=1 before triton is imported")


@interp
@pytest.mark.parametrize("page,window,splits", [(16, 0, None), (16, 6, 1), (24, 0, 3), (40, 9, 2)])
def test_flash_kernel_limits(_interpreter: None, page: int, window: int, splits: int | None) -> None:
    """Two chunks into a paged cache (pages of whole and split key blocks, one page holding it all), images in
    each, both rows; with a sliding window and with the key range split over programs."""
    from exlpy.kernels.flash_attention import flash_attention_launch, plain_operand

    g = torch.Generator().manual_seed(page + window)
    B, hk, G, D, L = 2, 2, 2, 32, 40
    pages = -(-L // page)
    kc = torch.randn(B * pages + 1, page, hk, D, generator=g)
    vc = torch.randn(B * pages + 1, page, hk, D, generator=g)
    bt = torch.randperm(B * pages + 1, generator=g)[:B * pages].view(B, pages).int()
    k, v = torch.randn(B, L, hk, D, generator=g), torch.randn(B, L, hk, D, generator=g)
    q = torch.randn(B, L, hk * G, D, generator=g) * 2
    t = torch.arange(L)
    reference.store_kv(kc, vc, bt[:, t // page].long() * page + t % page, k, v)
    blocks = _blocks(B, L, [(0, 3, 11), (0, 26, 38), (1, 0, 4), (1, 14, 30)])
    for a, e in ((0, 18), (18, 40)):
        pos = t[a:e].expand(B, -1)
        lens = torch.full((B,), e, dtype=torch.int32)
        lim = ImageSpans(blocks[:, a:e]).limits(pos)
        ref = reference.paged_attention(q[:, a:e], kc, vc, bt, page, lens, e, pos, 0.25, None, window, 0.0, lim)
        out = flash_attention_launch(q[:, a:e], plain_operand(kc), plain_operand(vc), bt, page, lens, e, pos, 0.25,
                                     config=(16, 16, 4, 1), splits=splits, window=window, limits=lim)
        _close(out, ref, 1e-5)


@interp
def test_quant_kernel_limits_with_fresh_rows(_interpreter: None) -> None:
    """A Q8 cache with this step's own K/V taken unquantized (the path a quantized cache's prefill takes)."""
    from exlpy.kernels.flash_attention import quant_attention

    g = torch.Generator().manual_seed(9)
    B, hk, G, D, page, pages, T = 1, 2, 2, 64, 16, 3, 20
    n = B * pages + 1
    kq, vq = (torch.zeros(n, page, hk * D, dtype=torch.uint8) for _ in range(2))
    ks, vs = (torch.zeros(n, page, hk * D // 32, dtype=torch.float16) for _ in range(2))
    bt = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    L = 40
    t = torch.arange(L)
    k_all, v_all = torch.randn(B, L, hk, D, generator=g), torch.randn(B, L, hk, D, generator=g)
    ops.store_kv_quant(kq, ks, vq, vs, bt[:, t // page].long() * page + t % page, k_all, v_all, 8, 8)
    pos = (L - T + torch.arange(T)).view(1, T)
    lim = ImageSpans(_blocks(B, T, [(0, 2, 9), (0, 12, 20)])).limits(pos)
    k_new, v_new = k_all[:, L - T:], v_all[:, L - T:]
    lens = torch.tensor([L], dtype=torch.int32)
    q = torch.randn(B, T, hk * G, D, generator=g)
    args = (q, kq, ks, vq, vs, bt, page, lens, L, pos, 0.2, 8, 8, None, k_new, v_new)
    ref = reference.quant_attention(*args, limits=lim)
    _close(quant_attention(*args, limits=lim), ref, 3e-3)
    assert (reference.quant_attention(*args) - ref).abs().max() > 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("window", [0, 100])  # 100: a window shorter than the image
def test_flash_kernel_limits_at_gemma3_shape_on_gpu(window: int) -> None:
    """Gemma-3-4B's attention shape (8 query heads on 4 KV heads of 256) for a 358-token chunk with one
    256-token image after 50 text tokens, into 256-token pages behind 40 cached tokens: the CUDA kernel (through the
    dispatch) against the fp32 reference."""
    from tests.conftest import HALF_PRECISION_TOL

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(window)
    hk, G, D, page, past, T = 4, 2, 256, 256, 40, 358
    L = past + T
    kc = torch.randn(4, page, hk, D, generator=g).half().cuda()
    vc = torch.randn(4, page, hk, D, generator=g).half().cuda()
    bt = torch.tensor([[3, 0]], dtype=torch.int32).cuda()  # pages of positions 0-255 and 256-511
    q = torch.randn(1, T, hk * G, D, generator=g).half().cuda()
    pos = (past + torch.arange(T)).view(1, T).cuda()
    lens = torch.tensor([L], dtype=torch.int32).cuda()
    lim = ImageSpans(_blocks(1, T, [(0, 50, 306)])).limits(pos)
    out = ops.paged_attention(q, kc, vc, bt, page, lens, L, pos, D ** -0.5, None, window, 0.0, lim)
    ref = reference.paged_attention(q.float(), kc.float(), vc.float(), bt, page, lens, L, pos, D ** -0.5, None,
                                    window, 0.0, lim)
    _close(out, ref, HALF_PRECISION_TOL[torch.float16])
