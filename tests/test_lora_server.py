"""`exlpy serve --lora NAME=DIR`: adapters listed in /v1/models, chosen by the request's `model`, unknown names
answered 404 in OpenAI's error shape; outputs equal the dynamic generator's with the same adapter."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Tokenizer  # noqa: E402
from exlpy.cli.main import build_parser  # noqa: E402
from exlpy.demo import DEMO_MODEL_DIR  # noqa: E402
from exlpy.errors import ConfigError  # noqa: E402
from exlpy.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler  # noqa: E402
from exlpy.server import create_app, state_from_generator  # noqa: E402
from exlpy.server.lora import load_adapters, parse_specs  # noqa: E402
from tests.lora_util import write_adapter  # noqa: E402
from tests.test_server_helpers import single_torch_thread  # noqa: E402, F401  (autouse fixture)

N = 12


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lora_srv")
    cfg = ExLlamaV2Config(DEMO_MODEL_DIR)
    model = ExLlamaV2(cfg)
    model.load(device="cpu")
    tok = ExLlamaV2Tokenizer(cfg)
    d = Path(DEMO_MODEL_DIR)
    specs = [f"poet={write_adapter(root / 'poet', d, r=8, seed=1, std=0.3)}",
             f"coder={write_adapter(root / 'coder', d, r=16, seed=2, std=0.3, targets=['q_proj', 'down_proj'])}"]
    adapters = load_adapters(model, specs, "aidreams260K")
    return {"model": model, "tok": tok, "adapters": adapters}


def _reference(served: dict[str, Any], prompt: str, loras: list[Any]) -> str:
    """The dynamic generator's own greedy text with the server's settings (EOS biased away, as below)."""
    m, tok = served["model"], served["tok"]
    g = ExLlamaV2DynamicGenerator(m, ExLlamaV2Cache(m, max_seq_len=256), tok, max_chunk_size=256)
    bias = torch.zeros(512)
    bias[2] = -100.0
    j = ExLlamaV2DynamicJob(tok.encode(prompt, add_bos=True), N, loras=loras,
                            gen_settings=ExLlamaV2Sampler.Settings.greedy(token_bias=bias),
                            stop_conditions=sorted(tok.stop_token_ids))
    g.enqueue(j)
    text = ""
    while g.num_remaining_jobs():
        text += "".join(r["text"] for r in g.iterate() if r["stage"] == "streaming")
    return text


def _client(served: dict[str, Any]) -> TestClient:
    m, tok = served["model"], served["tok"]
    gen = ExLlamaV2DynamicGenerator(m, ExLlamaV2Cache(m, max_seq_len=16 * 256), tok, max_chunk_size=256)
    state = state_from_generator(gen, "aidreams260K")
    state.adapters = served["adapters"]
    return TestClient(create_app(state))


def test_models_list_adapters_and_requests_pick_them(served: dict[str, Any]) -> None:
    with _client(served) as c:
        data = c.get("/v1/models").json()["data"]
        assert [d["id"] for d in data] == ["aidreams260K", "poet", "coder"]
        assert all(d["parent"] == "aidreams260K" and d["object"] == "model" for d in data[1:])
        body = {"prompt": "Once", "max_tokens": N, "temperature": 0, "logit_bias": {"2": -100}}
        results: dict[str | None, Any] = {}

        def ask(model: str | None) -> None:
            results[model] = c.post("/v1/completions", json={**body, **({"model": model} if model else {})})

        threads = [threading.Thread(target=ask, args=(m,)) for m in ("poet", "coder", "aidreams260K", None)]
        for t in threads:  # concurrent requests for both adapters and the base model share the generator
            t.start()
        for t in threads:
            t.join()
        texts = {}
        for model, r in results.items():
            assert r.status_code == 200, r.text
            assert r.json()["model"] == (model or "aidreams260K")
            texts[model] = r.json()["choices"][0]["text"]
    assert texts["aidreams260K"] == texts[None] == _reference(served, "Once", [])
    for name in ("poet", "coder"):
        assert texts[name] == _reference(served, "Once", [served["adapters"][name]]) != texts[None], name


def test_unknown_model_is_404_in_openai_shape(served: dict[str, Any]) -> None:
    with _client(served) as c:
        for path, extra in (("/v1/completions", {"prompt": "Once"}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
            r = c.post(path, json={"model": "gpt-4o", "max_tokens": 2, **extra})
            assert r.status_code == 404
            err = r.json()["error"]
            assert err["code"] == "model_not_found" and err["param"] == "model"
            assert err["type"] == "invalid_request_error" and "gpt-4o" in err["message"] and "poet" in err["message"]


def test_lora_arguments(tmp_path: Path) -> None:
    args = build_parser().parse_args(["serve", "--lora", "a=/x", "--lora", "b=/y"])
    assert args.lora == ["a=/x", "b=/y"]
    assert build_parser().parse_args(["serve"]).lora is None  # None: not given (a config file may list them)
    d = write_adapter(tmp_path / "a", Path(DEMO_MODEL_DIR), r=4)
    assert parse_specs([f"a={d}"], "base") == [("a", str(d))]
    for bad, match in ((["a"], "expected NAME=DIR"), ([f"={d}"], "expected NAME=DIR"),
                       ([f"a={d}", f"a={d}"], "already served"), ([f"base={d}"], "already served"),
                       ([f"a={tmp_path / 'none'}"], "not a directory")):
        with pytest.raises(ConfigError, match=match):
            parse_specs(bad, "base")
