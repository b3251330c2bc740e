"""Strict request validation of `exlpy serve`: no lax coercion, unknown roles, non-text content parts, empty stop
strings and budgets past the context are each a 400 naming the field; and a Hypothesis fuzz run of request
bodies and keys: every answer is 200 or an OpenAI-shaped 4xx (401 exactly when the key is wrong), never a 500."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from exlpy.server import create_app  # noqa: E402
from exlpy.server.options import AccessOptions  # noqa: E402
from tests.test_server_helpers import (  # noqa: E402
    chat_tokenizer,
    make_state,
    single_torch_thread,  # noqa: E402, F401  (autouse fixture)
)

KEY = "sk-fuzz"


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Any:
    state = make_state(pages=4, tokenizer=chat_tokenizer(tmp_path_factory.mktemp("v")))
    state.access = AccessOptions(api_keys=(KEY,))
    with TestClient(create_app(state)) as c:
        c.headers["Authorization"] = f"Bearer {KEY}"
        yield c


def _error(r: Any, param: str, words: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert err["type"] == "invalid_request_error"


CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "Once", "max_tokens": 2}


@pytest.mark.parametrize("field, value", [("stream", "yes"), ("stream", 1), ("n", "2"), ("n", 2.0),
                                          ("max_tokens", "5"), ("temperature", "0.5"), ("echo", "false"),
                                          ("seed", 1.5), ("stop", 5), ("logprobs", True)])
def test_no_lax_coercion(client: Any, field: str, value: Any) -> None:
    r = client.post("/v1/completions", json={**COMPLETION, field: value})
    assert r.status_code == 400, (field, value, r.text)
    assert r.json()["error"]["param"] == field


def test_chat_fields_are_strict_too(client: Any) -> None:
    _error(client.post("/v1/chat/completions", json={**CHAT, "logprobs": "true"}), "logprobs", "boolean")
    _error(client.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": 5}]}),
           "messages", "content")


def test_unknown_roles_are_refused(client: Any) -> None:
    body = {**CHAT, "messages": [{"role": "system", "content": "Be brief"}, {"role": "wizard", "content": "Hi"}]}
    _error(client.post("/v1/chat/completions", json=body), "messages[1].role", "unknown role 'wizard'")
    for role in ("system", "developer", "user"):
        ok = client.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": role, "content": "Hi"}]})
        assert ok.status_code == 200, (role, ok.text)


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                  {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                                  {"type": "file", "file": {"file_id": "f"}}])
def test_non_text_content_parts_are_refused(client: Any, part: dict[str, Any]) -> None:
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]
    r = client.post("/v1/chat/completions", json={**CHAT, "messages": msgs})
    why = ("text-only model" if part["type"] == "image_url"
           else f"content parts of type {part['type']!r} are not supported")
    _error(r, "messages[0].content[1]", why)  # images: tests/test_vision_server.py
    _error(client.post("/tokenize", json={"messages": msgs}), "messages[0].content[1]", part["type"])


def test_text_content_parts_are_joined(client: Any) -> None:
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    as_parts = client.post("/tokenize", json={"messages": [{"role": "user", "content": parts}]}).json()
    as_text = client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hello there"}]}).json()
    assert as_parts["tokens"] == as_text["tokens"]
    _error(client.post("/tokenize", json={"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
           "messages[0].content[0]", "needs a `text`")


def test_empty_stop_strings_are_refused(client: Any) -> None:
    _error(client.post("/v1/completions", json={**COMPLETION, "stop": [""]}), "stop[0]", "empty string")
    _error(client.post("/v1/completions", json={**COMPLETION, "stop": ["ok", ""]}), "stop[1]", "empty string")
    _error(client.post("/v1/completions", json={**COMPLETION, "stop": ""}), "stop", "empty string")
    _error(client.post("/v1/chat/completions", json={**CHAT, "stop": [""]}), "stop[0]", "empty string")
    assert client.post("/v1/completions", json={**COMPLETION, "stop": ["\n"]}).status_code == 200


def test_budgets_past_the_context_are_refused(client: Any) -> None:
    # The demo model's context is 128 tokens: more than that can never fit (400, as OpenAI and vLLM answer);
    # up to the context the budget is capped to what the prompt leaves.
    _error(client.post("/v1/completions", json={**COMPLETION, "max_tokens": 100_000}), "max_tokens",
           "more than the whole context of this model (128 tokens")
    _error(client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 129}), "max_tokens", "whole context")
    _error(client.post("/v1/chat/completions", json={**{k: v for k, v in CHAT.items() if k != "max_tokens"},
                                                     "max_completion_tokens": 10**9}),
           "max_completion_tokens", "whole context")
    r = client.post("/v1/completions", json={**COMPLETION, "max_tokens": 128, "logit_bias": {"2": -100}})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


# --- fuzz -------------------------------------------------------------------------------------------------------
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 300), st.floats(allow_nan=False, width=32),
                     st.text(max_size=8))
_content = st.one_of(st.text(max_size=20), st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "input_audio", "x"]), "text": st.text(max_size=10)}), max_size=3),
    _scalars)
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "robot", ""]),
                                  "content": _content})
_fields = {"max_tokens": _scalars, "temperature": _scalars, "top_p": _scalars, "n": _scalars, "stream": _scalars,
           "stop": st.one_of(_scalars, st.lists(st.text(max_size=4), max_size=3)), "seed": _scalars,
           "logprobs": _scalars, "top_k": _scalars}
_chat = st.fixed_dictionaries({"messages": st.lists(_message, max_size=3)},
                              optional={k: v for k, v in _fields.items()})
_completion = st.fixed_dictionaries({"prompt": st.one_of(st.text(max_size=20), st.lists(st.integers(-5, 600),
                                                                                       max_size=5), _scalars)},
                                    optional={**_fields, "echo": _scalars})
_keys = st.sampled_from([None, KEY, KEY + "x", "", "Bearer", KEY.upper()])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(["/v1/chat/completions", "/v1/completions"]), chat=_chat, completion=_completion,
       key=_keys, via=st.sampled_from(["authorization", "x-api-key"]))
def test_fuzz_requests_and_keys(client: Any, route: str, chat: dict[str, Any], completion: dict[str, Any],
                                key: str | None, via: str) -> None:
    body = chat if route.endswith("chat/completions") else completion
    headers = {"Authorization": ""}
    if key is not None:
        headers = {"Authorization": f"Bearer {key}"} if via == "authorization" else {"Authorization": "",
                                                                                      "x-api-key": key}
    r = client.post(route, content=json.dumps(body), headers={**headers, "content-type": "application/json"})
    if key != KEY:
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        return
    assert r.status_code in (200, 400), (body, r.status_code, r.text)
    if r.status_code == 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    elif body.get("stream") is not True:
        assert r.json()["choices"]

