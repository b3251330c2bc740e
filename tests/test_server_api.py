"""OpenAI endpoints of `exlpy serve` in-process (FastAPI TestClient) on the bundled demo model."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from exlpy.server import create_app  # noqa: E402
from tests.test_server_helpers import (  # noqa: E402
    NO_EOS,
    chat_tokenizer,
    demo,
    make_state,
    prompt_ids,
    reference_greedy,
    single_torch_thread,  # noqa: F401  (autouse fixture)
    sse_events,
)


@pytest.fixture
def client() -> Any:
    with TestClient(create_app(make_state())) as c:
        yield c


def complete(client: Any, **body: Any) -> dict[str, Any]:
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_models_and_health(client: Any) -> None:
    m = client.get("/v1/models").json()
    assert m["object"] == "list" and m["data"][0]["id"] == "aidreams260K" and m["data"][0]["max_model_len"] == 128
    h = client.get("/health")
    assert h.status_code == 200 and h.json()["status"] == "ok" and h.json()["cache_pages_free"] == 16


def test_greedy_completion_equals_generator_output(client: Any) -> None:
    prompt = "Once upon a time"
    out = complete(client, prompt=prompt, max_tokens=24, temperature=0, logit_bias=NO_EOS)
    expect = reference_greedy(prompt_ids(prompt), 24, banned_eos=True)
    assert out["choices"][0]["text"] == expect and len(expect) > 10
    assert out["choices"][0]["finish_reason"] == "length"
    n_prompt = prompt_ids(prompt).shape[1]
    assert out["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 24, "total_tokens": n_prompt + 24}
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
    # A token-id prompt is used as given.
    ids = prompt_ids(prompt)[0].tolist()
    assert complete(client, prompt=ids, max_tokens=24, temperature=0, logit_bias=NO_EOS)["choices"][0]["text"] \
        == expect


def test_stream_chunks_concatenate_to_non_stream_text(client: Any) -> None:
    body = {"prompt": "The gentle hum of", "max_tokens": 30, "temperature": 0}
    whole = complete(client, **body)
    r = client.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert len(chunks) > 3
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == whole["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert events[-2]["choices"] == [] and events[-2]["usage"] == whole["usage"]


def test_chat_with_template(tmp_path: Path) -> None:
    tok = chat_tokenizer(tmp_path)
    messages = [{"role": "user", "content": "Echoes of"}]
    rendered = tok.apply_chat_template(messages)
    ids = tok.encode(rendered, add_bos=False, encode_special_tokens=True)
    assert ids[0, 0].item() == 1  # the template's BOS became the BOS token
    expect = reference_greedy(ids, 20, banned_eos=True)
    with TestClient(create_app(make_state(tokenizer=tok))) as c:
        body = {"messages": messages, "max_tokens": 20, "temperature": 0, "logit_bias": NO_EOS}
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
        assert out["choices"][0]["message"] == {"role": "assistant", "content": expect}
        assert out["usage"]["prompt_tokens"] == ids.shape[1]
        # Content given as parts is the same conversation.
        parts = {**body, "messages": [{"role": "user", "content": [{"type": "text", "text": "Echoes of"}]}]}
        assert c.post("/v1/chat/completions", json=parts).json()["choices"][0]["message"]["content"] == expect
        events = sse_events(c.post("/v1/chat/completions", json={**body, "stream": True}).text)
        assert events[-1] == "[DONE]"
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert events[0]["object"] == "chat.completion.chunk"
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1])
        assert text == expect
        assert events[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}


def test_chat_without_template_is_400(client: Any) -> None:
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "chat_template" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "messages"


def test_stop_strings(client: Any) -> None:
    body = {"prompt": "Echoes of", "max_tokens": 40, "temperature": 0, "logit_bias": NO_EOS}
    full = complete(client, **body)["choices"][0]["text"]
    stop = full[12:15]
    cut = full.index(stop)
    for s in (stop, ["zzzz", stop]):
        out = complete(client, **body, stop=s)["choices"][0]
        assert out["text"] == full[:cut] and out["finish_reason"] == "stop"
    events = sse_events(client.post("/v1/completions", json={**body, "stop": stop, "stream": True}).text)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == full[:cut]


def test_seed_reproducibility(client: Any) -> None:
    body = {"prompt": "In the quiet", "max_tokens": 25, "temperature": 1.0, "top_p": 0.95, "logit_bias": NO_EOS}
    a = complete(client, **body, seed=7)["choices"][0]["text"]
    assert complete(client, **body, seed=7)["choices"][0]["text"] == a
    texts = {complete(client, **body, seed=s)["choices"][0]["text"] for s in range(1, 5)}
    assert len(texts) > 1  # the seed does change the draw


def test_logit_bias_changes_the_greedy_token(client: Any) -> None:
    first = complete(client, prompt="Once", max_tokens=1, temperature=0, logprobs=0)
    tok_text = first["choices"][0]["logprobs"]["tokens"][0]
    pieces = demo()[1].get_id_to_piece_list(True)
    tid = pieces.index(tok_text)
    other = complete(client, prompt="Once", max_tokens=1, temperature=0, logit_bias={str(tid): -100})
    assert other["choices"][0]["text"] != first["choices"][0]["text"]


def test_logprobs_completions_and_chat(client: Any, tmp_path: Path) -> None:
    out = complete(client, prompt="Vectors align, and", max_tokens=10, temperature=1.0, seed=3, logprobs=3,
                   logit_bias=NO_EOS)["choices"][0]
    lp = out["logprobs"]
    assert len(lp["tokens"]) == 10 and "".join(lp["tokens"]) == out["text"]
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])
    for t, v, alts in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert v <= 0 and 1 <= len(alts) <= 3
        assert sum(math.exp(x) for x in alts.values()) <= 1.0 + 1e-5
        if t in alts:
            assert abs(alts[t] - v) < 1e-5
        assert max(alts.values()) >= v - 1e-6
    with TestClient(create_app(make_state(tokenizer=chat_tokenizer(tmp_path)))) as c:
        body = {"messages": [{"role": "user", "content": "Why"}], "max_tokens": 6, "temperature": 0.8, "seed": 1,
                "logprobs": True, "top_logprobs": 2, "logit_bias": NO_EOS}
        r = c.post("/v1/chat/completions", json=body).json()["choices"][0]
        content = r["logprobs"]["content"]
        assert len(content) == 6 and "".join(e["token"] for e in content) == r["message"]["content"]
        for e in content:
            assert e["logprob"] <= 0 and e["bytes"] == list(e["token"].encode())
            assert 1 <= len(e["top_logprobs"]) <= 2
        assert c.post("/v1/chat/completions", json={**body, "logprobs": False}).status_code == 400


@pytest.mark.parametrize("body, param, words", [
    ({"n": 17}, "n", "[1, 16]"),
    ({"n": 0}, "n", "[1, 16]"),
    ({"n": 3, "best_of": 2}, "best_of", ">= n"),
    ({"best_of": 2, "stream": True}, "best_of", "streaming"),
    ({"temperature": -1}, "temperature", "temperature"),
    ({"temperature": "hot"}, "temperature", "temperature"),
    ({"top_p": 1.5}, "top_p", "top_p"),
    ({"min_p": -0.1}, "min_p", "min_p"),
    ({"frequency_penalty": 3}, "frequency_penalty", "frequency_penalty"),
    ({"max_tokens": 0}, "max_tokens", "echo"),
    ({"max_tokens": -1}, "max_tokens", ">= 0"),
    ({"logprobs_mode": "odd"}, "logprobs_mode", "raw_logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs", "[0, 20]"),
    ({"logit_bias": {"9999": 5}}, "logit_bias", "9999"),
    ({"logit_bias": {"x": 5}}, "logit_bias", "'x'"),
    ({"logprobs": 50}, "logprobs", "logprobs"),
    ({"prompt": list(range(3, 203))}, "prompt", "200 tokens"),
    ({"prompt": [1, 600]}, "prompt", "600"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": [[1], [1, 600]]}, "prompt[1]", "600"),
    ({"prompt": ["a", [1, 2]]}, "prompt", "prompt"),
])
def test_bad_requests_answer_400_naming_the_field(client: Any, body: dict[str, Any], param: str,
                                                  words: str) -> None:
    r = client.post("/v1/completions", json={"prompt": "Once", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"] and err["type"] == "invalid_request_error"


def test_max_tokens_is_capped_by_the_context(client: Any) -> None:
    out = complete(client, prompt="Once", max_tokens=128, temperature=0, logit_bias=NO_EOS)
    n = prompt_ids("Once").shape[1]
    assert out["usage"]["completion_tokens"] == 128 - n and out["choices"][0]["finish_reason"] == "length"
