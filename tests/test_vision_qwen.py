"""Qwen2-VL / Qwen2.5-VL against transformers in fp32 on the CPU: pixel values, image features, logits with
images in the prompt, greedy continuations through both generators, and the prefix cache sharing pages of
prompts with the same image."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import rel_err
from tests.vision_models import (
    IDS,
    LoadedVision,
    greedy_dynamic,
    greedy_streaming,
    hf_inputs,
    make_qwen_vl,
    random_image,
)

pytest.importorskip("PIL")
KINDS = ["qwen2_vl", "qwen2_5_vl"]


class Loaded(LoadedVision):
    def __init__(self, path: Path, kind: str) -> None:
        super().__init__(path, make_qwen_vl(path, kind))

    def hf_logits(self, images: list[Any], ids: torch.Tensor) -> torch.Tensor:
        ref = self.proc(images=images, return_tensors="pt")
        with torch.no_grad():
            return self.hf(input_ids=ids, pixel_values=ref["pixel_values"], image_grid_thw=ref["image_grid_thw"],
                           mm_token_type_ids=(ids == IDS["<|image_pad|>"]).int()).logits


@pytest.fixture(scope="module", params=KINDS)
def vl(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Loaded:
    return Loaded(tmp_path_factory.mktemp(request.param), request.param)


@pytest.mark.parametrize("size", [(90, 60), (200, 60), (30, 20), (600, 420)])
def test_pixel_values_match_hf(vl: Loaded, size: tuple[int, int]) -> None:
    # (30, 20): scaled up to min_pixels; (600, 420): scaled down to max_pixels; others rounded to 28.
    img = random_image(*size, seed=size[0])
    px, grid = vl.tower.preprocess(img)
    ref = vl.proc(images=[img], return_tensors="pt")
    assert list(grid) == ref["image_grid_thw"][0].tolist()
    assert px.shape == ref["pixel_values"].shape
    assert (px - ref["pixel_values"]).abs().max().item() < 1e-6


def test_transparent_image_composited_on_white(vl: Loaded) -> None:
    """Transparency is composited onto white (as exllamav2 and this transformers' processors do); the reference gets
    that RGB image, because how transformers treats RGBA varies by version (the GPU image's differed,
    2026-11-26). A fully transparent pixel comes out white."""
    from exlpy.vision.image import to_rgb

    img = random_image(56, 56, seed=3, mode="RGBA")
    img.putpixel((0, 0), (0, 0, 0, 0))
    assert to_rgb(img).getpixel((0, 0)) == (255, 255, 255)
    px, _ = vl.tower.preprocess(img)
    assert (px - vl.proc(images=[to_rgb(img)], return_tensors="pt")["pixel_values"]).abs().max().item() < 1e-6


@pytest.mark.parametrize("size", [(90, 60), (200, 84)])
def test_image_features_match_hf(vl: Loaded, size: tuple[int, int]) -> None:
    img = random_image(*size, seed=1)
    ref = vl.proc(images=[img], return_tensors="pt")
    with torch.no_grad():
        want = vl.hf.model.get_image_features(ref["pixel_values"], ref["image_grid_thw"]).pooler_output[0]
    got = vl.tower.image_features(*vl.tower.preprocess(img))
    assert got.shape == want.shape
    assert rel_err(got, want) < 1e-4


def test_logits_with_images_match_hf(vl: Loaded) -> None:
    imgs = [random_image(90, 60, seed=1), random_image(60, 120, seed=2)]
    embs = [vl.tower.get_image_embeddings(model=vl.model, tokenizer=vl.tokenizer, image=im, text_alias=f"<IMG{i}>")
            for i, im in enumerate(imgs)]
    ids = vl.tokenizer.encode("Compare <IMG0> with<IMG1>: which?", embeddings=embs)
    n0, n1 = (e.length - 2 for e in embs)
    hid, _ = hf_inputs("Compare ", " with", n0)
    hid2, _ = hf_inputs("", ": which?", n1)
    hf_ids = torch.cat([hid, hid2], dim=1)
    assert ids.shape == hf_ids.shape
    want = vl.hf_logits(imgs, hf_ids)
    got = vl.model.forward(ids, indexed_embeddings=embs)
    assert rel_err(got, want) < 1e-4


def _hf_greedy(vl: Loaded, img: Any, before: str, after: str, n: int, new: int) -> list[int]:
    hid, tt = hf_inputs(before, after, n)
    ref = vl.proc(images=[img], return_tensors="pt")
    with torch.no_grad():
        out = vl.hf.generate(input_ids=hid, pixel_values=ref["pixel_values"], image_grid_thw=ref["image_grid_thw"],
                             mm_token_type_ids=tt, max_new_tokens=new, do_sample=False)
    return out[0, hid.shape[1]:].tolist()


def test_greedy_continuations_match_hf(vl: Loaded) -> None:
    from exlpy import ExLlamaV2Cache
    from exlpy.generator import ExLlamaV2DynamicGenerator

    img = random_image(120, 90, seed=5)
    emb = vl.tower.get_image_embeddings(model=vl.model, tokenizer=vl.tokenizer, image=img,
                                        text_alias="{{EMBED_HERE}}")
    ids = vl.tokenizer.encode("Look: {{EMBED_HERE}} what is it?", embeddings=[emb])
    want = _hf_greedy(vl, img, "Look: ", " what is it?", emb.length - 2, 10)
    cache = ExLlamaV2Cache(vl.model, max_seq_len=512)
    assert greedy_dynamic(ExLlamaV2DynamicGenerator(vl.model, cache, vl.tokenizer), ids, emb, 10) == want
    assert greedy_streaming(vl, cache, ids, emb, 10) == want


def test_same_image_shares_cache_pages(vl: Loaded) -> None:
    """Two requests with the same picture (embedded twice, under different aliases) share the prompt's pages."""
    from exlpy import ExLlamaV2Cache
    from exlpy.generator import ExLlamaV2DynamicGenerator, ExLlamaV2Sampler

    img = random_image(120, 90, seed=7)
    a = vl.tower.get_image_embeddings(model=vl.model, tokenizer=vl.tokenizer, image=img, text_alias="[a]")
    b = vl.tower.get_image_embeddings(model=vl.model, tokenizer=vl.tokenizer, image=img.copy(), text_alias="[b]")
    other = vl.tower.get_image_embeddings(model=vl.model, tokenizer=vl.tokenizer, image=random_image(120, 90, 8),
                                          text_alias="[c]")
    assert a.get_ids() == b.get_ids() and a.get_ids() != other.get_ids()
    assert torch.equal(a.embeddings, b.embeddings)
    cache = ExLlamaV2Cache(vl.model, max_seq_len=1024)
    gen = ExLlamaV2DynamicGenerator(vl.model, cache, vl.tokenizer)
    text = "x" * 300  # more than one 256-token page before the question
    settings = ExLlamaV2Sampler.Settings.greedy()
    _, first = gen.generate(f"[a]{text} one?", 4, gen_settings=settings, embeddings=[a], return_last_results=True)
    out, second = gen.generate(f"[b]{text} two?", 4, gen_settings=settings, embeddings=[b],
                               return_last_results=True)
    assert first["cached_tokens"] == 0 and second["cached_tokens"] >= 256
    _, third = gen.generate(f"[c]{text} one?", 4, gen_settings=settings, embeddings=[other],
                            return_last_results=True)
    assert third["cached_tokens"] == 0  # another picture: nothing to share


def test_embedding_cache_skips_the_tower(vl: Loaded, monkeypatch: pytest.MonkeyPatch) -> None:
    img = random_image(64, 64, seed=11)
    vl.tower.get_image_embeddings(model=vl.model, tokenizer=vl.tokenizer, image=img)
    calls = []
    monkeypatch.setattr(vl.tower, "image_features", lambda *a: calls.append(a))
    again = vl.tower.get_image_embeddings(model=vl.model, tokenizer=vl.tokenizer, image=img.copy())
    assert not calls and again.length > 2


def test_image_across_prefill_chunks_matches_hf(vl: Loaded) -> None:
    """A prompt whose image straddles a 256-token prefill chunk: each chunk gets its own M-RoPE rows."""
    from exlpy import ExLlamaV2Cache
    from exlpy.generator import ExLlamaV2DynamicGenerator

    img = random_image(150, 120, seed=9)
    emb = vl.tower.get_image_embeddings(model=vl.model, tokenizer=vl.tokenizer, image=img, text_alias="<image>")
    before = "y" * 250
    ids = vl.tokenizer.encode(f"{before}<image> then?", embeddings=[emb])
    assert ids.shape[1] > 256 + 8
    want = _hf_greedy(vl, img, before, " then?", emb.length - 2, 6)
    gen = ExLlamaV2DynamicGenerator(vl.model, ExLlamaV2Cache(vl.model, max_seq_len=1024), vl.tokenizer,
                                    max_chunk_size=256)
    assert greedy_dynamic(gen, ids, emb, 6) == want


def test_exllamav2_multimodal_example_runs_through_the_alias(tmp_path: Path) -> None:
    """exllamav2's examples/multimodal.py (mode "qwen2"), with only its imports changed by the compat alias and
    the image read from a file instead of a URL."""
    import exlpy.compat

    make_qwen_vl(tmp_path / "model", "qwen2_vl", layers=1)
    random_image(100, 80, seed=12).save(tmp_path / "test_image_1.jpg")
    exlpy.compat.install()
    try:
        from exllamav2 import (
            ExLlamaV2,
            ExLlamaV2Cache,
            ExLlamaV2Config,
            ExLlamaV2Tokenizer,
            ExLlamaV2VisionTower,
        )
        from exllamav2.generator import ExLlamaV2DynamicGenerator, ExLlamaV2Sampler
        from PIL import Image

        config = ExLlamaV2Config(str(tmp_path / "model"))
        config.max_seq_len = 512
        vision_model = ExLlamaV2VisionTower(config)
        vision_model.load(progress=True)
        model = ExLlamaV2(config)
        cache = ExLlamaV2Cache(model, max_seq_len=512, lazy=True)
        model.load_autosplit(progress=True, cache=cache)
        tokenizer = ExLlamaV2Tokenizer(config)
        generator = ExLlamaV2DynamicGenerator(model=model, cache=cache, tokenizer=tokenizer)
        image_embeddings = [vision_model.get_image_embeddings(model=model, tokenizer=tokenizer,
                                                              image=Image.open(tmp_path / "test_image_1.jpg"))]
        placeholders = "\n".join([ie.text_alias for ie in image_embeddings]) + "\n"
        prompt = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n" + placeholders +
                  "Describe the image.<|im_end|>\n<|im_start|>assistant\n")
        output = generator.generate(prompt=prompt, max_new_tokens=20, add_bos=True, encode_special_tokens=True,
                                    decode_special_tokens=True, stop_conditions=[tokenizer.eos_token_id],
                                    gen_settings=ExLlamaV2Sampler.Settings.greedy(), embeddings=image_embeddings)
        assert output.startswith(prompt) and len(output) > len(prompt)
    finally:
        exlpy.compat.uninstall()


@pytest.mark.parametrize("kind", KINDS)
def test_video_matches_hf(tmp_path: Path, kind: str) -> None:
    """Video (five frames: padded to three temporal patches; Qwen2.5-VL at 1 fps): features per temporal patch
    and logits with the video in the prompt (temporal M-RoPE positions, scaled by tokens_per_second for
    Qwen2.5-VL) against transformers fed the same pixel values (its video processor needs torchvision)."""
    from exlpy import ExLlamaV2, ExLlamaV2Config, ExLlamaV2Tokenizer, ExLlamaV2VisionTower

    hf, _ = make_qwen_vl(tmp_path, kind)
    config = ExLlamaV2Config(str(tmp_path))
    model = ExLlamaV2(config)
    model.load(device="cpu")  # fp32, against transformers fp32 on the CPU; GPU: test_vision_gpu.py
    tok = ExLlamaV2Tokenizer(config)
    tower = ExLlamaV2VisionTower(config)
    tower.load(device="cpu")
    frames = [random_image(90, 60, seed=40 + i) for i in range(5)]
    from exlpy.vision import qwen2

    px, grid = qwen2.preprocess_video(tower.vspec, frames)
    assert grid[0] == 3
    thw = torch.tensor([grid])
    with torch.no_grad():
        want = hf.model.get_video_features(px, thw).pooler_output[0]
    assert rel_err(tower.image_features(px, grid), want) < 1e-4
    emb = tower.get_video_embeddings(model=model, tokenizer=tok, video=frames, text_alias="<video>", fps=1.0)
    ids = tok.encode("Watch <video> then answer.", embeddings=[emb])
    n = emb.length - 2
    hid = torch.tensor([list(b"Watch ") + [IDS["<|vision_start|>"]] + [IDS["<|video_pad|>"]] * n +
                        [IDS["<|vision_end|>"]] + list(b" then answer.")])
    assert ids.shape == hid.shape
    with torch.no_grad():
        extra = {"second_per_grid_ts": torch.tensor([2.0])} if kind == "qwen2_5_vl" else {}  # 2 frames at 1 fps
        ref = hf(input_ids=hid, pixel_values_videos=px, video_grid_thw=thw,
                 mm_token_type_ids=(hid == IDS["<|video_pad|>"]).int() * 2, **extra).logits
    assert rel_err(model.forward(ids, indexed_embeddings=[emb]), ref) < 1e-4


def test_deferred_non_finite_rows_fail_the_job_not_the_generator(vl: Loaded) -> None:
    """Rows checked without waiting (a GPU tower's): a job whose image rows hold NaN ends with MultimodalError at
    its prefill, its pages stay uncomputed, and the next job with a good image runs and matches transformers;
    model.forward raises the same error."""
    from exlpy import ExLlamaV2Cache
    from exlpy.errors import MultimodalError
    from exlpy.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler
    from exlpy.vision.embedding import ExLlamaV2MMEmbedding, RowCheck

    img = random_image(120, 90, seed=5)
    good = vl.embed(img, "<good>")
    rows = good.embeddings.clone()
    rows[3, 1] = float("nan")
    bad = ExLlamaV2MMEmbedding(vl.model, rows, "<bad>", thw_grid=good.thw_grid, pre_tokens=1, post_tokens=1,
                               digest=b"nan rows", row_check=RowCheck(rows, defer=True))
    gen = ExLlamaV2DynamicGenerator(vl.model, ExLlamaV2Cache(vl.model, max_seq_len=512), vl.tokenizer)
    ids = vl.tokenizer.encode("Look: <bad> what is it?", embeddings=[bad])
    gen.enqueue(ExLlamaV2DynamicJob(ids, max_new_tokens=2, gen_settings=ExLlamaV2Sampler.Settings.greedy(),
                                    embeddings=[bad], stop_conditions=[]))
    errors = []
    while gen.num_remaining_jobs():
        errors += [r["error"] for r in gen.iterate() if "error" in r]
    assert len(errors) == 1 and isinstance(errors[0], MultimodalError) and "finite" in str(errors[0])
    with pytest.raises(MultimodalError, match="finite"):
        vl.model.forward(ids, indexed_embeddings=[bad])
    ids = vl.tokenizer.encode("Look: <good> what is it?", embeddings=[good])
    want = _hf_greedy(vl, img, "Look: ", " what is it?", good.length - 2, 3)
    assert greedy_dynamic(gen, ids, good, 3) == want


def test_padded_mlp_matches_hf(vl: Loaded) -> None:
    """Qwen2.5-VL's tower with its MLP width padded (as on GPUs: zero rows of gate / up, zero columns of down)
    computes the same features as transformers."""
    if vl.tower.kind != "qwen2_5_vl":
        pytest.skip("Qwen2-VL's MLP is not gated and not padded")
    img = random_image(200, 84, seed=1)
    ref = vl.proc(images=[img], return_tensors="pt")
    with torch.no_grad():
        want = vl.hf.model.get_image_features(ref["pixel_values"], ref["image_grid_thw"]).pooler_output[0]
    inner = vl.tower.tower
    try:
        inner.mlp_align = 128
        vl.tower.load(device="cpu")
        assert inner.w["visual.blocks.0.mlp.gate_up.weight"].shape[0] == 2 * 128  # 48 padded to 128, twice
        assert inner.w["visual.blocks.0.mlp.down_proj.weight"].shape == (32, 128)
        got = vl.tower.image_features(*vl.tower.preprocess(img))
    finally:
        inner.mlp_align = None
        vl.tower.load(device="cpu")
    assert inner.w["visual.blocks.0.mlp.down_proj.weight"].shape == (32, 48)
    assert rel_err(got, want) < 1e-4


def test_preprocessing_beside_the_hash_gives_the_same_embedding(vl: Loaded, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """The GPU order of get_image_embeddings (the image hashed on a thread while its preprocessing is queued, then
    the cache lookup), run on the CPU: the same rows and ids as the plain order, and a cached image still skips
    the tower."""
    from exlpy.vision.tower import ExLlamaV2VisionTower

    img = random_image(100, 70, seed=21)
    plain = vl.embed(img, "<plain>")
    vl.tower._cache.clear()
    monkeypatch.setattr(ExLlamaV2VisionTower, "_launches_preprocessing", property(lambda self: True))
    early = vl.embed(img.copy(), "<early>")
    assert torch.equal(early.embeddings, plain.embeddings) and early.get_ids() == plain.get_ids()
    calls = []
    monkeypatch.setattr(vl.tower, "image_features", lambda *a: calls.append(a))
    again = vl.embed(img.copy(), "<again>")
    assert not calls and again.get_ids() == plain.get_ids()
