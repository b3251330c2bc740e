"""Bad multimodal input gets a typed error naming the problem: images that do not decode or are too large,
aliases missing from the prompt, more image tokens than the context holds, images for a text-only model,
embedding ids without their embeddings."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import pytest
import torch

from exlpy.errors import ImageError, InputError, MultimodalError
from tests.vision_models import make_qwen_vl, random_image

pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def vl(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    from exlpy import ExLlamaV2, ExLlamaV2Config, ExLlamaV2Tokenizer, ExLlamaV2VisionTower

    path = tmp_path_factory.mktemp("qwen2vl")
    make_qwen_vl(path, "qwen2_vl", layers=1)
    config = ExLlamaV2Config(str(path))
    model = ExLlamaV2(config)
    model.load()
    tower = ExLlamaV2VisionTower(config)
    tower.load()
    return model, ExLlamaV2Tokenizer(config), tower


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height (its pixel data is a stub: decoding it would fail)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")


def test_bad_images(vl, tmp_path: Path) -> None:  # noqa: ANN001
    model, tok, tower = vl

    def embed(image: object) -> None:
        tower.get_image_embeddings(model=model, tokenizer=tok, image=image)

    with pytest.raises(ImageError, match="does not decode"):
        embed(b"definitely not an image")
    bad = tmp_path / "broken.png"
    bad.write_bytes(png_header(64, 64)[:30])
    with pytest.raises(ImageError, match="broken.png"):
        embed(str(bad))
    with pytest.raises(ImageError, match="does not exist"):
        embed(tmp_path / "missing.jpg")
    with pytest.raises(ImageError, match="megapixels"):
        embed(png_header(12000, 9000))  # 108 MP, refused from the header
    with pytest.raises(ImageError, match="16384"):
        embed(png_header(20000, 100))
    from PIL import Image

    with pytest.raises(ImageError, match="no pixels"):
        embed(Image.new("RGB", (0, 5)))
    with pytest.raises(ImageError, match="PIL image, a file path"):
        embed(123)
    with pytest.raises(ImageError, match="base64"):
        embed("data:image/png;base64,@@@")
    with pytest.raises(ImageError, match="aspect ratio"):
        embed(random_image(2000, 5))
    # the same image as bytes, a path and a data URL all work and give the same ids
    buf = io.BytesIO()
    random_image(64, 48, seed=4).save(buf, format="PNG")
    (tmp_path / "ok.png").write_bytes(buf.getvalue())
    import base64

    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    ids = {tuple(tower.get_image_embeddings(model=model, tokenizer=tok, image=x).get_ids())
           for x in (buf.getvalue(), str(tmp_path / "ok.png"), url)}
    assert len(ids) == 1


def test_alias_missing_from_prompt(vl) -> None:  # noqa: ANN001
    from exlpy import ExLlamaV2Cache
    from exlpy.generator import ExLlamaV2DynamicGenerator

    model, tok, tower = vl
    emb = tower.get_image_embeddings(model=model, tokenizer=tok, image=random_image(56, 56), text_alias="<img>")
    with pytest.raises(MultimodalError, match="'<img>'.*does not appear"):
        tok.encode("no picture here", embeddings=[emb])
    gen = ExLlamaV2DynamicGenerator(model, ExLlamaV2Cache(model, max_seq_len=256), tok)
    with pytest.raises(MultimodalError, match="appears in no prompt"):
        gen.generate("no picture", 2, embeddings=[emb])


def test_more_image_tokens_than_the_context(vl) -> None:  # noqa: ANN001
    from exlpy import ExLlamaV2Cache
    from exlpy.generator import ExLlamaV2DynamicGenerator

    model, tok, tower = vl
    emb = tower.get_image_embeddings(model=model, tokenizer=tok, image=random_image(112, 112), text_alias="<i>")
    gen = ExLlamaV2DynamicGenerator(model, ExLlamaV2Cache(model, max_seq_len=256), tok)
    with pytest.raises(MultimodalError, match="image tokens.*does not fit the context"):
        gen.generate("<i>" * 20 + " describe", 2, embeddings=[emb])


def test_text_only_model_refuses_images(tiny_llama_dir: Path) -> None:
    from exlpy import ExLlamaV2Config, ExLlamaV2VisionTower

    with pytest.raises(MultimodalError, match="text-only model"):
        ExLlamaV2VisionTower(ExLlamaV2Config(str(tiny_llama_dir)))


def test_embedding_ids_need_their_embeddings(vl) -> None:  # noqa: ANN001
    model, tok, tower = vl
    emb = tower.get_image_embeddings(model=model, tokenizer=tok, image=random_image(56, 56), text_alias="<p>")
    ids = tok.encode("a <p> b", embeddings=[emb])
    with pytest.raises(InputError, match="outside the model's vocabulary"):
        model.forward(ids)  # the ids alone, without indexed_embeddings
    other = tower.get_image_embeddings(model=model, tokenizer=tok, image=random_image(56, 56, seed=9))
    with pytest.raises(MultimodalError, match="belongs to none"):
        model.forward(ids, indexed_embeddings=[other])
    with pytest.raises(MultimodalError, match="hidden_size"):
        type(emb)(model, torch.zeros(3, 7))
