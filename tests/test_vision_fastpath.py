"""The pieces of the fast image path, on the CPU: the resize a GPU runs (bit-equal to Pillow's), the
normalization's arithmetic (bit-equal to transformers' processor), grouped window attention against attention
per segment, embeddings identified by a given digest with their rows kept on a device, and the phase timer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.vision_models import random_image

pytest.importorskip("PIL")

@pytest.mark.parametrize("src,dst,mode", [((300, 300), (308, 308), "bicubic"), ((120, 90), (112, 84), "bicubic"),
                                          ((600, 420), (112, 84), "bicubic"), ((30, 20), (84, 56), "bicubic"),
                                          ((200, 60), (196, 56), "bicubic"), ((500, 300), (224, 224), "bilinear"),
                                          ((13, 7), (112, 112), "bilinear")])
def test_device_resize_is_pils(src: tuple[int, int], dst: tuple[int, int], mode: str) -> None:
    from PIL import Image

    from exlpy.vision.pixels import resize_like_pil

    for seed in range(2):
        img = random_image(*src, seed=seed)
        want = np.asarray(img.resize(dst, resample=Image.BICUBIC if mode == "bicubic" else Image.BILINEAR))
        got = resize_like_pil(torch.from_numpy(np.array(img)).permute(2, 0, 1), dst[1], dst[0], mode)
        assert np.array_equal(got.permute(1, 2, 0).numpy(), want)


def test_gpu_style_qwen_pixels_equal_hf() -> None:
    """The Qwen path a GPU takes (resize_like_pil, then the shared normalize / patchify), on the CPU, against
    transformers' PIL processor: bit-equal, as the CPU path (Pillow's resize) is."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from exlpy.vision import qwen2
    from exlpy.vision.pixels import normalize, resize_like_pil

    spec = qwen2.parse_spec("qwen2_5_vl", {"vision_config": {}}, {"max_pixels": 28 * 28 * 64}, 64, "test")
    img = random_image(300, 200, seed=3)
    h, w = qwen2.smart_resize(img.height, img.width, 28, spec.min_pixels, spec.max_pixels)
    x = resize_like_pil(torch.from_numpy(np.array(img)).permute(2, 0, 1), h, w, "bicubic")
    got = qwen2.patchify(spec, normalize(x, spec.rescale, spec.image_mean, spec.image_std))
    ref = Qwen2VLImageProcessorPil(min_pixels=spec.min_pixels, max_pixels=spec.max_pixels)(
        images=[img], return_tensors="pt")["pixel_values"]
    assert torch.equal(got, ref)
    assert torch.equal(qwen2.preprocess(spec, img)[0], ref)


def test_grouped_segment_attention_equals_attention_per_segment() -> None:
    from exlpy.vision.layers import plan_segments, segment_attention

    g = torch.Generator().manual_seed(0)
    bounds = [0, 64, 80, 144, 148, 212, 212, 228]  # full and edge windows interleaved, one empty segment
    q, k, v = (torch.randn(228, 3, 8, generator=g) for _ in range(3))
    want = torch.cat([F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v))).transpose(0, 1)
                      for a, b in zip(bounds[:-1], bounds[1:]) if b > a])
    plan = plan_segments(bounds, q.device)
    assert sorted((c, n) for c, n, _, _ in plan.groups) == [(1, 4), (2, 16), (3, 64)]
    assert sorted((n, idx is None) for _, n, idx, _ in plan.groups) == [(4, True), (16, False), (64, False)]
    assert torch.allclose(segment_attention(q, k, v, plan, 8 ** -0.5), want, atol=1e-6)
    # windows ordered by size (as window_index orders them): every group is a slice, no gathers
    by_size = [0, 64, 128, 192, 208, 224, 228]
    plan = plan_segments(by_size, q.device)
    assert sorted((c, n, idx, a) for c, n, idx, a in plan.groups) == [(1, 4, None, 224), (2, 16, None, 192),
                                                                       (3, 64, None, 0)]
    want = torch.cat([F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v))).transpose(0, 1)
                      for a, b in zip(by_size[:-1], by_size[1:])])
    qkv = torch.stack([q, k, v], 1)  # strided q / k / v, as the tower's views of its fused projection
    got = segment_attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], plan, 8 ** -0.5)
    assert torch.allclose(got, want, atol=1e-6)
    whole = plan_segments([0, 228], q.device)
    assert whole.groups == ((1, 228, None, 0),)  # one segment: no gather
    full = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)).transpose(0, 1)
    assert torch.allclose(segment_attention(q, k, v, whole, 8 ** -0.5), full, atol=1e-6)


def test_embedding_digest_and_device_rows() -> None:
    from types import SimpleNamespace

    from exlpy.errors import MultimodalError
    from exlpy.vision.embedding import ExLlamaV2MMEmbedding

    model = SimpleNamespace(config=SimpleNamespace(hidden_size=8))
    rows = torch.randn(5, 8)
    a = ExLlamaV2MMEmbedding(model, rows, digest=b"image-1", device_rows=rows.half())
    b = ExLlamaV2MMEmbedding(model, rows.clone(), digest=b"image-1")
    c = ExLlamaV2MMEmbedding(model, rows.clone(), digest=b"image-2")
    assert a.first_index == b.first_index != c.first_index  # ids by the given digest, not by the rows
    assert a.rows_on(torch.device("cpu"), torch.float16) is a._on_device[("cpu", torch.float16)]
    assert torch.equal(b.rows_on(torch.device("cpu"), torch.float16), rows.half())
    with pytest.raises(MultimodalError, match="device_rows"):
        ExLlamaV2MMEmbedding(model, rows, device_rows=rows[:2])
    with pytest.raises(MultimodalError, match="finite"):
        bad = rows.clone()
        bad[1, 1] = float("nan")
        ExLlamaV2MMEmbedding(model, rows, device_rows=bad)


def test_phase_timer_sums_marks_per_name() -> None:
    from exlpy.vision.timing import PhaseTimer, mark

    mark("ignored")  # no active timer: nothing happens
    with PhaseTimer("cpu") as t:
        for _ in range(3):
            mark("a")
            mark("b")
    mark("after")
    phases = t.phases()
    assert list(phases) == ["a", "b"] and all(d >= 0 and d == h for d, h in phases.values())


def test_deferred_row_check_raises_at_first_use() -> None:
    """Rows checked without waiting (as a GPU tower's are): making the embedding passes, the first forward use
    (embed_rows) and reading `embeddings` raise MultimodalError; finite rows pass everywhere."""
    from types import SimpleNamespace

    from exlpy.errors import MultimodalError
    from exlpy.vision.embedding import ExLlamaV2MMEmbedding, RowCheck
    from exlpy.vision.mm import embed_rows

    model = SimpleNamespace(config=SimpleNamespace(hidden_size=8))
    bad = torch.randn(4, 8)
    bad[2, 3] = float("inf")
    check = RowCheck(bad, defer=True)
    assert check.pending
    emb = ExLlamaV2MMEmbedding(model, bad, digest=b"deferred-bad", row_check=check)
    ids = torch.tensor([[1, 2] + emb.get_ids()])
    with pytest.raises(MultimodalError, match="finite"):
        embed_rows(ids, torch.zeros(1, ids.shape[1], 8), [emb])
    with pytest.raises(MultimodalError, match="finite"):
        emb.embeddings  # noqa: B018 - the property checks
    good = torch.randn(4, 8)
    ok = ExLlamaV2MMEmbedding(model, good, digest=b"deferred-good", row_check=RowCheck(good, defer=True))
    h = embed_rows(torch.tensor([[5] + ok.get_ids()]), torch.zeros(1, 5, 8), [ok])
    assert torch.equal(h[0, 1:], good) and not h[0, 0].any()
    assert not RowCheck(good).pending  # off the GPU: answered at once unless deferred
    with pytest.raises(MultimodalError, match="finite"):  # rows off the GPU are still checked when made
        ExLlamaV2MMEmbedding(model, bad, digest=b"eager-bad")
    with pytest.raises(MultimodalError, match="RowCheck"):
        ExLlamaV2MMEmbedding(model, good, row_check=True)  # type: ignore[arg-type]


def test_image_digest_and_text_rows() -> None:
    """The digest of an image equals itself through the array the image path takes out once and through the
    hashing thread; another image differs. text_rows picks the embedding table's rows (scaled) by host ids."""
    from types import SimpleNamespace

    from exlpy.vision.image import digest_soon, image_array, image_digest
    from exlpy.vision.tower import text_rows

    img = random_image(64, 48, seed=1)
    arr = image_array(img)
    assert arr.shape == (48, 64, 3) and arr.dtype == np.uint8
    d = image_digest(img)
    assert image_digest(img, arr) == d == digest_soon(img, arr).result()
    assert image_digest(random_image(64, 48, seed=2)) != d
    w = torch.randn(10, 4)
    model = SimpleNamespace(modules=[SimpleNamespace(weight=w, scale=1.0)])
    assert torch.equal(text_rows(model, [7, 2, 7]), w[[7, 2, 7]])
    model.modules[0].scale = 2.0
    assert torch.equal(text_rows(model, [3]), w[[3]] * 2.0)


@pytest.mark.interpreter
def test_qwen_tower_kernels_on_its_layouts() -> None:
    """The Triton kernels the Qwen2.5-VL tower calls on GPUs, in its layouts, against the references the CPU runs:
    RoPE in place on q and k of the fused qkv [N, 3, H, 80] (a half of 40, not a power of two) with per-patch
    tables, RMSNorm over a width that is not a power of two, SwiGLU over the strided halves of gate|up."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need TRITON_INTERPRET=1 before triton is imported")
    pytest.importorskip("triton")
    from exlpy.kernels import reference
    from exlpy.kernels.activation import silu_mul
    from exlpy.kernels.rmsnorm import rms_norm
    from exlpy.kernels.rope import apply_rope

    g = torch.Generator().manual_seed(0)
    n, heads, d = 6, 2, 80
    qkv = torch.randn(n, 3, heads, d, generator=g)
    cos, sin = torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)
    pos = torch.arange(n).view(1, -1)
    want_q, want_k = reference.apply_rope(qkv[:, 0].unsqueeze(0).clone(), qkv[:, 1].unsqueeze(0).clone(), cos, sin,
                                          pos)
    v = qkv[:, 2].clone()
    apply_rope(qkv[:, 0].unsqueeze(0), qkv[:, 1].unsqueeze(0), cos, sin, pos)
    assert torch.allclose(qkv[:, 0], want_q[0], atol=1e-5) and torch.allclose(qkv[:, 1], want_k[0], atol=1e-5)
    assert torch.equal(qkv[:, 2], v)  # v untouched
    x, w = torch.randn(n, 40, generator=g), torch.randn(40, generator=g)
    assert torch.allclose(rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), atol=1e-5)
    gate, up = torch.randn(n, 2 * 24, generator=g).chunk(2, dim=-1)
    assert torch.allclose(silu_mul(gate, up), reference.silu_mul(gate, up), atol=1e-5)


def test_window_index_orders_windows_by_size_within_frames() -> None:
    """Qwen2.5-VL's windows: every merge block once, each window's blocks as transformers groups them, windows of
    a frame largest first (so equal sizes are adjacent), frames kept apart (full attention is per frame)."""
    from exlpy.vision.qwen2 import window_index

    grid, m = (2, 10, 14), 2  # 2 frames of 5 x 7 merge blocks, windows of 2 x 2 blocks: 3 x 4 windows a frame
    units, bounds = window_index(grid, m, 56, 14)
    assert sorted(units.tolist()) == list(range(2 * 5 * 7))
    sizes = [(b - a) // (m * m) for a, b in zip(bounds[:-1], bounds[1:])]
    frame = 5 * 7
    assert sum(sizes[:12]) == frame and sum(sizes[12:]) == frame  # each frame's windows together
    assert sizes[:12] == sorted(sizes[:12], reverse=True) and sizes[:12] == [4] * 6 + [2] * 5 + [1]
    at = 0
    for size in sizes:  # a window: blocks of one 2 x 2 tile of one frame, in row-major order
        w = units[at:at + size]
        rows, cols, frames = (w % frame) // 7, w % 7, w // frame
        assert len(set(frames.tolist())) == 1 and len(set((rows // 2).tolist())) == 1
        assert len(set((cols // 2).tolist())) == 1 and w.tolist() == sorted(w.tolist())
        at += size
