"""Mistral 3.1 (Pixtral tower, 2x2 patch merger) against transformers in fp32 on the CPU: pixel values, image
features, logits with images in the prompt (rows of image tokens broken by [IMG_BREAK] / [IMG_END]), and greedy
continuations through both generators."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import rel_err
from tests.vision_models import (
    LoadedVision,
    greedy_dynamic,
    greedy_streaming,
    make_mistral3,
    pixtral_hf_inputs,
    random_image,
)

pytest.importorskip("PIL")


class Loaded(LoadedVision):
    def __init__(self, path: Path) -> None:
        super().__init__(path, make_mistral3(path))

    def processed(self, images: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        ref = self.proc(images=images, return_tensors="pt")
        return ref["pixel_values"], ref["image_sizes"]


@pytest.fixture(scope="module")
def m3(tmp_path_factory: pytest.TempPathFactory) -> Loaded:
    return Loaded(tmp_path_factory.mktemp("mistral3"))


@pytest.mark.parametrize("size", [(90, 60), (300, 200), (20, 40), (112, 112)])  # (300, 200): scaled down
def test_pixel_values_match_hf(m3: Loaded, size: tuple[int, int]) -> None:
    img = random_image(*size, seed=3)
    px, grid = m3.tower.preprocess(img)
    ref, sizes = m3.processed([img])
    assert tuple(sizes[0].tolist()) == (grid[1] * 28, grid[2] * 28)
    assert (px - ref[0]).abs().max().item() < 1e-6


def test_image_features_match_hf(m3: Loaded) -> None:
    img = random_image(90, 60, seed=1)
    px, sizes = m3.processed([img])
    with torch.no_grad():
        want = m3.hf.model.get_image_features(px, sizes, vision_feature_layer=-1).pooler_output[0]
    assert rel_err(m3.tower.image_features(*m3.tower.preprocess(img)), want) < 1e-4


def test_logits_with_images_match_hf(m3: Loaded) -> None:
    imgs = [random_image(90, 60, seed=1), random_image(60, 100, seed=2)]
    embs = [m3.embed(im, f"<IMG{i}>") for i, im in enumerate(imgs)]
    ids = m3.tokenizer.encode("[INST]<IMG0>\n<IMG1>\nCompare them.[/INST]", embeddings=embs,
                              encode_special_tokens=True)
    grids = [m3.tower.preprocess(im)[1] for im in imgs]
    from tests.vision_models import PIXTRAL_IDS

    a = pixtral_hf_inputs("", "\n", grids[0][1], grids[0][2])
    b = pixtral_hf_inputs("", "\nCompare them.", grids[1][1], grids[1][2])
    hf_ids = torch.cat([torch.tensor([[PIXTRAL_IDS["[INST]"]]]), a, b, torch.tensor([[PIXTRAL_IDS["[/INST]"]]])],
                       dim=1)
    assert ids.shape == hf_ids.shape
    # one batch for HF: images of different sizes are padded by its processor
    px, sizes = m3.processed(imgs)
    with torch.no_grad():
        want = m3.hf(input_ids=hf_ids, pixel_values=px, image_sizes=sizes).logits
    assert rel_err(m3.model.forward(ids, indexed_embeddings=embs), want) < 1e-4


def test_greedy_continuations_match_hf(m3: Loaded) -> None:
    from exlpy import ExLlamaV2Cache
    from exlpy.generator import ExLlamaV2DynamicGenerator

    img = random_image(80, 70, seed=5)
    emb = m3.embed(img, "<image>")
    ids = m3.tokenizer.encode("Look: <image> what is it?", embeddings=[emb])
    _, grid = m3.tower.preprocess(img)
    hid = pixtral_hf_inputs("Look: ", " what is it?", grid[1], grid[2])
    px, sizes = m3.processed([img])
    with torch.no_grad():
        want = m3.hf.generate(input_ids=hid, pixel_values=px, image_sizes=sizes, max_new_tokens=8,
                              do_sample=False)[0, hid.shape[1]:].tolist()
    cache = ExLlamaV2Cache(m3.model, max_seq_len=512)
    assert greedy_dynamic(ExLlamaV2DynamicGenerator(m3.model, cache, m3.tokenizer), ids, emb, 8) == want
    assert greedy_streaming(m3, cache, ids, emb, 8) == want


def test_pixtral_12b_llava_logits_match_hf(tmp_path: Path) -> None:
    """Pixtral-12B's layout: LlavaForConditionalGeneration with a Pixtral tower, no patch merger, a projector
    with biases, 16-pixel patches."""
    from exlpy import ExLlamaV2, ExLlamaV2Config, ExLlamaV2Tokenizer, ExLlamaV2VisionTower
    from tests.vision_models import make_llava_pixtral

    hf, proc = make_llava_pixtral(tmp_path)
    config = ExLlamaV2Config(str(tmp_path))
    model = ExLlamaV2(config)
    model.load(device="cpu")  # fp32, against transformers fp32 on the CPU; GPU: test_vision_gpu.py
    tok = ExLlamaV2Tokenizer(config)
    tower = ExLlamaV2VisionTower(config)
    tower.load(device="cpu")
    img = random_image(90, 60, seed=1)
    px, grid = tower.preprocess(img)
    ref = proc(images=[img], return_tensors="pt")
    assert (px - ref["pixel_values"][0]).abs().max().item() < 1e-6
    emb = tower.get_image_embeddings(model=model, tokenizer=tok, image=img, text_alias="<img>")
    ids = tok.encode("Look <img> now", embeddings=[emb])
    hid = pixtral_hf_inputs("Look ", " now", grid[1], grid[2])
    with torch.no_grad():
        want = hf(input_ids=hid, pixel_values=ref["pixel_values"], image_sizes=ref["image_sizes"]).logits
    assert rel_err(model.forward(ids, indexed_embeddings=[emb]), want) < 1e-4
