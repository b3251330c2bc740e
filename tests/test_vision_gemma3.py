"""Gemma 3 against transformers in fp32 on the CPU: its language model alone (local / global layers with their
own RoPE bases, q/k norms), pixel values, SigLIP features after the pooling projector, logits with images in the
prompt (an image's tokens attend to each other both ways), and greedy continuations through both generators,
also when an image straddles a prefill chunk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import rel_err
from tests.vision_models import (
    LoadedVision,
    gemma_hf_inputs,
    greedy_dynamic,
    greedy_streaming,
    make_gemma3,
    random_image,
)

pytest.importorskip("PIL")


class Loaded(LoadedVision):
    def __init__(self, path: Path) -> None:
        super().__init__(path, make_gemma3(path))

    def hf_logits(self, images: list[Any], ids: torch.Tensor, tt: torch.Tensor | None) -> torch.Tensor:
        px = self.proc(images=images, return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            return self.hf(input_ids=ids, pixel_values=px, token_type_ids=tt).logits


@pytest.fixture(scope="module")
def g3(tmp_path_factory: pytest.TempPathFactory) -> Loaded:
    return Loaded(tmp_path_factory.mktemp("gemma3"))


def test_text_logits_match_hf(g3: Loaded) -> None:
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))  # past the window of 8
    with torch.no_grad():
        want = g3.hf(input_ids=ids).logits
    assert rel_err(g3.model.forward(ids), want) < 1e-4


@pytest.mark.parametrize("size,mode", [((90, 60), "RGB"), ((56, 56), "RGB"), ((30, 200), "RGBA")])
def test_pixel_values_match_hf(g3: Loaded, size: tuple[int, int], mode: str) -> None:
    """RGBA is composited onto white first (exllamav2's rule; the reference gets that RGB image, as transformers'
    own RGBA handling varies by version)."""
    from exlpy.vision.image import to_rgb

    img = random_image(*size, seed=2, mode=mode)
    px, _ = g3.tower.preprocess(img)
    assert (px - g3.proc(images=[to_rgb(img)], return_tensors="pt")["pixel_values"][0]).abs().max().item() < 1e-6


def test_image_features_match_hf(g3: Loaded) -> None:
    img = random_image(90, 60, seed=1)
    px = g3.proc(images=[img], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        want = g3.hf.model.get_image_features(px).pooler_output[0]
    assert rel_err(g3.tower.image_features(*g3.tower.preprocess(img)), want) < 1e-4


def test_logits_with_images_match_hf(g3: Loaded) -> None:
    imgs = [random_image(90, 60, seed=1), random_image(40, 70, seed=2)]
    embs = [g3.embed(im, f"<IMG{i}>") for i, im in enumerate(imgs)]
    ids = g3.tokenizer.encode("Here: <IMG0> and there<IMG1>, which is which?", embeddings=embs)
    a, ta = gemma_hf_inputs("Here: ", " and there", 4)
    b, tb = gemma_hf_inputs("", ", which is which?", 4)
    hf_ids, tt = torch.cat([a, b], dim=1), torch.cat([ta, tb], dim=1)
    assert ids.shape == hf_ids.shape
    want = g3.hf_logits(imgs, hf_ids, tt)
    got = g3.model.forward(ids, indexed_embeddings=embs)
    assert rel_err(got, want) < 1e-4
    # the bidirectional image attention matters: causal-only attention gives other logits
    assert rel_err(g3.hf_logits(imgs, hf_ids, None), want) > 1e-3


@pytest.mark.parametrize("before", ["Look at this: ", "z" * 253])  # 253: the image straddles a 256-token chunk
def test_greedy_continuations_match_hf(g3: Loaded, before: str) -> None:
    from exlpy import ExLlamaV2Cache
    from exlpy.generator import ExLlamaV2DynamicGenerator

    img = random_image(70, 50, seed=5)
    emb = g3.embed(img, "<image>")
    after = " what is it?"
    ids = g3.tokenizer.encode(before + "<image>" + after, embeddings=[emb])
    hid, tt = gemma_hf_inputs(before, after, 4)
    px = g3.proc(images=[img], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        want = g3.hf.generate(input_ids=hid, pixel_values=px, token_type_ids=tt, max_new_tokens=8,
                              do_sample=False)[0, hid.shape[1]:].tolist()
    cache = ExLlamaV2Cache(g3.model, max_seq_len=1024)
    gen = ExLlamaV2DynamicGenerator(g3.model, cache, g3.tokenizer, max_chunk_size=256)
    assert greedy_dynamic(gen, ids, emb, 8) == want
    assert greedy_streaming(g3, cache, ids, emb, 8) == want


def test_images_through_a_quantized_cache(g3: Loaded) -> None:
    """An image chunk after cached text reads the earlier keys from a Q8 cache (the per-query key limits go to
    the quantized-cache attention too): as close to the cache-free logits as a text prompt's are."""
    from exlpy import ExLlamaV2Cache, ExLlamaV2Cache_Q8

    emb = g3.embed(random_image(90, 60, seed=1), "<image>")
    ids = g3.tokenizer.encode("Look at this: <image> what is it?", embeddings=[emb])
    want = g3.model.forward(ids, indexed_embeddings=[emb])[:, 5:]
    errs = []
    for kind in (ExLlamaV2Cache, ExLlamaV2Cache_Q8):
        cache = kind(g3.model, max_seq_len=256)
        g3.model.forward(ids[:, :5], cache, preprocess_only=True)
        errs.append(rel_err(g3.model.forward(ids[:, 5:], cache, indexed_embeddings=[emb]), want))
    assert errs[0] < 1e-4 and 1e-4 < errs[1] < 5e-2, errs  # the Q8 rows are read, with Q8's error


def test_serving_warmup_runs_image_chunks(g3: Loaded, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Gemma 3 server's warm-up also runs its prefill shapes as chunks holding an image, so the first image
    request compiles no attention variant (the one with per-query key limits) while others stream."""
    from exlpy import ExLlamaV2Cache
    from exlpy.generator import ExLlamaV2DynamicGenerator
    from exlpy.kernels import ops

    with_limits = []
    real = ops.paged_attention
    monkeypatch.setattr(ops, "paged_attention", lambda *a, **k: with_limits.append("limits" in k) or real(*a, **k))
    gen = ExLlamaV2DynamicGenerator(g3.model, ExLlamaV2Cache(g3.model, max_seq_len=256), g3.tokenizer,
                                    max_chunk_size=256, max_batch_size=1)
    gen.warmup(full=True)
    assert any(with_limits) and not all(with_limits)
    assert gen.num_remaining_jobs() == 0 and gen.page_table.num_unreferenced() == gen.num_pages
