"""`exlpy serve` with a vision-language model: OpenAI image_url parts (data: URLs; local files only with
--allow-local-images; never http), answered as the dynamic generator answers the same prompt."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("PIL")

from fastapi.testclient import TestClient  # noqa: E402

from exlpy.server import create_app  # noqa: E402
from tests.vision_models import make_qwen_vl, random_image  # noqa: E402


def png_url(img: Any) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from exlpy.server.options import model_options
    from exlpy.server.state import load_state

    path = tmp_path_factory.mktemp("qwen25vl")
    make_qwen_vl(path, "qwen2_5_vl", layers=1)
    state = load_state(options=model_options({"model": str(path), "max_seq_len": 1024, "cache_size": 2048,
                                              "allow_local_images": True}), warmup=False)
    with TestClient(create_app(state)) as c:
        yield c, state, path


def chat(client: Any, content: Any, **kw: Any) -> Any:
    return client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                      "max_tokens": 6, "temperature": 0, **kw})


def test_image_part_answers_as_the_generator(served: Any, tmp_path: Path) -> None:
    from exlpy.generator import ExLlamaV2Sampler
    from exlpy.server.vision import serving

    client, state, _ = served
    img = random_image(100, 70, seed=21)
    r = chat(client, [{"type": "text", "text": "What is "}, {"type": "image_url", "image_url": {"url": png_url(img)}},
                      {"type": "text", "text": " here?"}])
    assert r.status_code == 200, r.text
    answer = r.json()["choices"][0]["message"]["content"]
    gen = state.generator
    tower = serving(gen.model).tower
    emb = tower.get_image_embeddings(model=gen.model, tokenizer=gen.tokenizer, image=img, text_alias="<i>")
    prompt = "<|im_start|>user\nWhat is <i> here?<|im_end|>\n<|im_start|>assistant\n"
    ids = gen.tokenizer.encode(prompt, encode_special_tokens=True, embeddings=[emb])
    assert r.json()["usage"]["prompt_tokens"] == ids.shape[1]
    want = gen.generate(prompt, 6, gen_settings=ExLlamaV2Sampler.Settings.greedy(), embeddings=[emb],
                        encode_special_tokens=True, completion_only=True)
    assert answer == want
    # a local file is accepted behind --allow-local-images (this server has it), with the same answer
    img.save(tmp_path / "pic.png")
    r = chat(client, [{"type": "text", "text": "What is "},
                      {"type": "image_url", "image_url": {"url": f"file://{tmp_path / 'pic.png'}"}},
                      {"type": "text", "text": " here?"}])
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == answer


def test_bad_image_parts_are_400(served: Any) -> None:
    client, state, _ = served
    for url, why in (("https://example.com/cat.png", "not fetched"), ("data:image/png;base64,AAAA", "decode"),
                     ("data:text/plain,hello", "base64")):
        r = chat(client, [{"type": "image_url", "image_url": {"url": url}}])
        assert r.status_code == 400 and why in r.text, (url, r.text)
    from exlpy.server.vision import serving

    entry = serving(state.generator.model)
    entry.allow_local_images = False
    try:
        r = chat(client, [{"type": "image_url", "image_url": {"url": "/etc/hostname"}}])
        assert r.status_code == 400 and "--allow-local-images" in r.text
    finally:
        entry.allow_local_images = True


def test_generate_cli_with_image(served: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from exlpy.cli.main import main
    from exlpy.generator import ExLlamaV2Sampler

    _, state, path = served
    random_image(80, 64, seed=33).save(tmp_path / "pic.png")
    assert main(["generate", "Describe it.", "--model", str(path), "--image", str(tmp_path / "pic.png"), "--greedy",
                 "-n", "5", "--no-bos"]) == 0
    out = capsys.readouterr().out
    gen = state.generator
    from exlpy.server.vision import serving

    emb = serving(gen.model).tower.get_image_embeddings(model=gen.model, tokenizer=gen.tokenizer,
                                                         image=str(tmp_path / "pic.png"), text_alias="<i>")
    want = gen.generate("<i>\nDescribe it.", 5, gen_settings=ExLlamaV2Sampler.Settings.greedy(), embeddings=[emb],
                        completion_only=True, stop_conditions=[gen.tokenizer.eos_token_id])
    assert out == "Describe it." + want + "\n"
    assert main(["generate", "x", "--image", str(tmp_path / "pic.png"), "-n", "1"]) == 1  # the text-only demo
    assert "text-only model" in capsys.readouterr().err
