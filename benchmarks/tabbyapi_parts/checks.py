"""The checks driven against a running TabbyAPI with the OpenAI client (and httpx for its admin routes): models,
chat, completions, streaming, n=2, structured output, tools, concurrency, banned strings, token healing, CFG,
LoRA load/unload, model unload/load, quantized caches, a draft model; each recorded with its result and time."""

from __future__ import annotations

import json
import re
import time
import traceback
from collections.abc import Callable
from typing import Any

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
WEATHER_ASK = {"role": "user", "content": "What is the weather in Paris?"}
WEATHER_RESULT = json.dumps({"city": "Paris", "temperature_c": 18, "sky": "clear"})
# TabbyAPI 79126f9 finds a tool format's start tag inside each streamed chunk (endpoints/OAI/utils/chat_completion.py,
# _chat_stream_collector: `split_re.search(text)` per generation), i.e. it expects the tag as one token, as in
# Mistral's tokenizer; SmolLM2's splits "[TOOL_CALLS]" into 8 tokens, one chunk each. A stop string that begins
# with the tag makes the generator hold back the partly written tag (exllamav2's rule, spec: "output held while the
# text ends with a prefix of a stop string") and release it whole with the next token. It never matches: the
# call's regex puts the function's name, not "[", after the tag.
MISTRAL_HOLD = "[TOOL_CALLS]["


def mistral_call_regex(tool: dict[str, Any]) -> str:
    """A regex for one call of `tool` in TabbyAPI's `mistral` format, `[TOOL_CALLS]name[ARGS]{"arg": "Value"}`,
    its string arguments bounded (a random-weight model fills an unbounded string until max_tokens)."""
    fn = tool["function"]
    props = fn["parameters"]["properties"]
    assert all(v.get("type") == "string" for v in props.values()), "string arguments only"
    args = ", ".join(f'"{k}": "[A-Z][a-z]{{1,11}}"' for k in props)
    return r"\[TOOL_CALLS\]" + re.escape(fn["name"]) + r"\[ARGS\]\{" + args + r"\}"


def check_tool_call(calls: list[Any] | None, finish: str | None, content: str | None) -> Any:
    """The first call of a reply: `get_weather` with JSON arguments its parameters' schema allows, and the reply
    finished as a tool call (`finish_reason` "tool_calls", no text besides the call)."""
    import jsonschema

    assert calls, f"no tool call; finish {finish}, content {content!r}"
    fn = calls[0].function
    assert fn.name == WEATHER_TOOL["function"]["name"], fn
    jsonschema.validate(json.loads(fn.arguments), WEATHER_TOOL["function"]["parameters"])
    assert finish == "tool_calls" and not (content or "").strip(), (finish, content)
    return fn


class Skipped(Exception):
    """A check that cannot apply to this model or set-up (the reason is recorded)."""


class Checks:
    """The checks' rows, written to the results file after each one (a run stopped from outside keeps what it
    did). Past `deadline` (time.monotonic()) a check is not started: it is recorded as skipped."""

    def __init__(self, deadline: float = float("inf"), on_row: Callable[[], None] = lambda: None) -> None:
        self.rows: list[tuple[str, str, float, str]] = []  # name, ok / failed / skipped, seconds, detail
        self.deadline, self.on_row = deadline, on_row
        self.current: str | None = None
        self.t0 = 0.0  # when the current check started

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, fn: Callable[[], str]) -> bool:
        t0 = self.t0 = time.perf_counter()
        self.current = name
        try:
            if self.left() <= 0:
                raise Skipped("not started: the run's time budget (--budget) was spent")
            detail, result = fn(), "ok"
        except Skipped as e:
            detail, result = str(e), "skipped"
        except Exception as e:  # a failing check is a finding, not the end of the run
            detail, result = f"{type(e).__name__}: {e}"[:400], "failed"
            traceback.print_exc()
        dt_s = time.perf_counter() - t0
        self.add(name, result, dt_s, detail)
        return result == "ok"

    def add(self, name: str, result: str, dt_s: float, detail: str) -> None:
        self.current = None
        self.rows.append((name, result, dt_s, detail.replace("\n", " ").replace("|", "\\|")[:300]))
        print(f"[{result}] {name} ({dt_s:.1f} s): {detail[:200]}", flush=True)
        self.on_row()


def post_stream(base: str, path: str, body: dict[str, Any], timeout: float = 900) -> list[Any]:
    """POST to an admin endpoint that answers with server-sent events (model/load) or JSON."""
    import httpx

    with httpx.stream("POST", base + path, json=body, timeout=timeout) as r:
        text = "".join(r.iter_text())
        if r.status_code != 200:
            raise RuntimeError(f"{path}: HTTP {r.status_code}: {text[:300]}")
    events = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:") and
              line[5:].strip() not in ("", "[DONE]")]
    return events or [json.loads(text)]


def drive(base: str, model_name: str, draft_name: str | None, tool_format: str | None, checks: Checks,
          random_weights: bool = False, only: list[str] | None = None) -> None:
    """Each check in turn; `only`: the checks whose names contain one of these (case-insensitive)."""
    import httpx
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="none", timeout=600)
    chat = [{"role": "user", "content": "Name three colours."}]

    def models() -> str:
        ids = [m.id for m in client.models.list().data]
        assert model_name in ids, ids
        return f"/v1/models lists {ids}"

    def chat_completion() -> str:
        r = client.chat.completions.create(model=model_name, messages=chat, max_tokens=24, temperature=0)
        text = r.choices[0].message.content
        assert text, r
        return f"finish {r.choices[0].finish_reason}: {text!r}"

    def completion() -> str:
        r = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=24, temperature=0)
        assert r.choices[0].text, r
        return f"finish {r.choices[0].finish_reason}: {r.choices[0].text!r}"

    def streaming() -> str:
        parts = []
        for ev in client.chat.completions.create(model=model_name, messages=chat, max_tokens=24, stream=True,
                                                 temperature=0):
            if ev.choices and ev.choices[0].delta.content:
                parts.append(ev.choices[0].delta.content)
        assert len(parts) > 1, parts
        return f"{len(parts)} chunks: {''.join(parts)!r}"

    def n2() -> str:
        r = client.completions.create(model=model_name, prompt="The sky is", max_tokens=8, n=2, temperature=1.0)
        assert len(r.choices) == 2, r
        return f"n=2: {[c.text for c in r.choices]}"

    def json_schema() -> str:
        if random_weights:
            # formatron's JSON grammar leaves strings and whitespace unbounded, which a random-weight model fills
            # until max_tokens; a bounded regex goes through the same filter path and must end by EOS when done.
            r = client.chat.completions.create(
                model=model_name, max_tokens=60, temperature=0,
                messages=[{"role": "user", "content": "Give a person's name and age as JSON."}],
                extra_body={"regex_pattern": r'\{"name": "(Ada|Bob)", "age": [1-9][0-9]?\}'})
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
            obj = json.loads(text)
            assert set(obj) == {"name", "age"} and isinstance(obj["age"], int) and finish == "stop", (text, finish)
            return f"random weights, so a bounded regex through formatron: finish {finish}, valid JSON {text!r}"
        r = client.chat.completions.create(
            model=model_name, max_tokens=120, temperature=0,
            messages=[{"role": "user", "content": "Give a person's name and age as JSON."}],
            extra_body={"json_schema": SCHEMA})  # TabbyAPI's field (its response_format takes the bare schema)
        text = r.choices[0].message.content
        obj = json.loads(text)
        assert set(obj) == {"name", "age"} and isinstance(obj["age"], int), obj
        return f"valid JSON: {text!r}"

    def tools() -> str:
        if not tool_format:
            raise Skipped("no --tool-format: TabbyAPI parses tool calls only with model.tool_format set")
        request: dict[str, Any] = {"model": model_name, "max_tokens": 60, "temperature": 0, "tools": [WEATHER_TOOL],
                                   "tool_choice": "required", "messages": [WEATHER_ASK]}
        if tool_format == "mistral":
            # TabbyAPI does not enforce tool_choice (it reads only "none"), so the call is made by its own regex
            # constraint; the stop string never matches but holds back a partly written tag (see MISTRAL_HOLD).
            request["extra_body"] = {"regex_pattern": mistral_call_regex(WEATHER_TOOL), "stop": [MISTRAL_HOLD]}
        r = client.chat.completions.create(**request)
        choice = r.choices[0]
        call = check_tool_call(choice.message.tool_calls, choice.finish_reason, choice.message.content)
        streamed = stream_tool_call(request)
        # The follow-up turn: the call and its result go back; the template renders both, the model answers.
        follow = [WEATHER_ASK, choice.message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": WEATHER_RESULT}]
        r2 = client.chat.completions.create(model=model_name, max_tokens=16, temperature=0, tools=[WEATHER_TOOL],
                                            messages=follow)
        c2 = r2.choices[0]
        reply = c2.message.content or (c2.message.tool_calls and f"another call {c2.message.tool_calls[0].function}")
        assert reply and c2.finish_reason in ("stop", "length", "tool_calls"), r2
        # What that turn's prompt held, rendered by TabbyAPI's own template code (its /v1/token/encode takes
        # messages): the call as the model wrote it and the tool's result.
        enc = httpx.post(base + "/v1/token/encode", json={"text": follow, "template_vars": {"tools": [WEATHER_TOOL]}},
                         timeout=60)
        assert enc.status_code == 200, enc.text
        prompt = httpx.post(base + "/v1/token/decode", json={"tokens": enc.json()["tokens"]}, timeout=60).json()["text"]
        assert WEATHER_RESULT in prompt and call.name in prompt, prompt
        return (f"{tool_format} format, finish {choice.finish_reason}: {call.name}({call.arguments}) "
                f"[id {choice.message.tool_calls[0].id}]; streamed: {streamed}; follow-up with the tool result "
                f"({enc.json()['length']} prompt tokens, call and result in it), finish {c2.finish_reason}: "
                f"{reply!r}")

    def stream_tool_call(request: dict[str, Any]) -> str:
        """The same request streamed: TabbyAPI sends the parsed calls in the last chunk."""
        calls, finish, content = [], None, ""
        for ev in client.chat.completions.create(**request, stream=True):
            if not ev.choices:
                continue
            delta = ev.choices[0].delta
            calls += delta.tool_calls or []
            content += delta.content or ""
            finish = ev.choices[0].finish_reason or finish
        call = check_tool_call(calls, finish, content or None)
        return f"finish {finish}, {call.name}({call.arguments})"

    def concurrent() -> str:
        from concurrent.futures import ThreadPoolExecutor

        def one(i: int) -> str:
            r = client.completions.create(model=model_name, prompt=f"Story {i}: Once upon a time", max_tokens=16,
                                          temperature=0)
            return r.choices[0].text

        t0 = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(one, range(4)))
        assert all(texts), texts
        return f"4 requests at once, all answered in {time.perf_counter() - t0:.1f} s"

    def banned_strings() -> str:
        base = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=16,
                                         temperature=0).choices[0].text
        words = sorted((w.strip(",.") for w in base.split()), key=len, reverse=True)
        if not words or len(words[0]) < 2:
            raise Skipped(f"no word to ban in the greedy text {base!r}")
        word = words[0]
        r = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=16, temperature=0,
                                      extra_body={"banned_strings": [word]})
        text = r.choices[0].text
        assert word.lower() not in text.lower() and text, (word, text)
        return f"banned {word!r}: {text!r}"

    def token_healing() -> str:
        r = client.completions.create(model=model_name, prompt="The capital of France is Par", max_tokens=8,
                                      temperature=0, extra_body={"token_healing": True})
        assert r.choices[0].text, r
        return f"'...Par' + {r.choices[0].text!r}"

    def cfg() -> str:
        card = httpx.get(base + "/v1/model", timeout=10).json()
        if (card.get("parameters") or {}).get("max_batch_size", 1) <= 1:
            raise Skipped("TabbyAPI disables CFG without paged attention (its compatibility mode: no CUDA device)")
        r = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=16, temperature=0,
                                      extra_body={"cfg_scale": 1.5, "negative_prompt": "sad"})
        assert r.choices[0].text
        return f"cfg_scale 1.5: {r.choices[0].text!r}"

    def quantized_cache() -> str:
        out = []
        for mode in ("Q4", "Q8"):
            httpx.post(base + "/v1/model/unload", json={}, timeout=60)
            post_stream(base, "/v1/model/load", {"model_name": model_name, "max_seq_len": 2048, "cache_mode": mode})
            card = httpx.get(base + "/v1/model", timeout=10).json()
            assert (card.get("parameters") or {}).get("cache_mode") == mode, card
            out.append(f"{mode}: {greedy_text()!r}")
        return "; ".join(out)

    def greedy_text() -> str:
        r = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=16, temperature=0)
        return r.choices[0].text

    def scored_text() -> tuple[str, list[float]]:
        """Greedy text and its tokens' log-probabilities (a random-weight model can repeat one token whatever
        an adapter adds; its log-probabilities still move)."""
        r = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=16, temperature=0,
                                      logprobs=1)
        lp = r.choices[0].logprobs
        return r.choices[0].text, [float(x) for x in (lp.token_logprobs if lp and lp.token_logprobs else [])]

    def lora() -> str:
        before, lp_before = scored_text()
        res = post_stream(base, "/v1/lora/load", {"loras": [{"name": "random-r8", "scaling": 1.0}]})
        assert res[-1].get("success") == ["random-r8"], res
        listed = httpx.get(base + "/v1/lora", timeout=10).json()
        with_lora, lp_lora = scored_text()
        r = httpx.post(base + "/v1/lora/unload", json={}, timeout=60)
        assert r.status_code == 200, r.text
        after, lp_after = scored_text()
        moved = max((abs(a - b) for a, b in zip(lp_lora, lp_before)), default=0.0)
        back = max((abs(a - b) for a, b in zip(lp_after, lp_before)), default=0.0)
        assert (with_lora != before or moved > 1e-3) and after == before and back < 1e-3, \
            (before, with_lora, after, moved, back)
        scale = [c.get("scaling") for c in listed.get("data", [])]
        change = "output changes" if with_lora != before else f"same text, log-probabilities move by {moved:.3g}"
        return (f"load -> {change}, unload -> back to the base output (log-probabilities within {back:.1g}); "
                f"/v1/lora scaling {scale}")

    def unload_load() -> str:
        r = httpx.post(base + "/v1/model/unload", json={}, timeout=60)
        assert r.status_code == 200, r.text
        assert httpx.get(base + "/v1/model", timeout=10).status_code != 200 or True
        ev = post_stream(base, "/v1/model/load", {"model_name": model_name, "max_seq_len": 2048})
        text = greedy_text()
        assert text, "no text after reload"
        return f"unload, load ({len(ev)} progress events), then {text!r}"

    def draft() -> str:
        if draft_name is None:
            raise RuntimeError("no draft model")
        httpx.post(base + "/v1/model/unload", json={}, timeout=60)
        post_stream(base, "/v1/model/load", {"model_name": model_name, "max_seq_len": 2048})
        plain = greedy_text()
        httpx.post(base + "/v1/model/unload", json={}, timeout=60)
        post_stream(base, "/v1/model/load", {"model_name": model_name, "max_seq_len": 2048,
                                             "draft_model": {"draft_model_name": draft_name}})
        card = httpx.get(base + "/v1/model", timeout=10).json()
        assert (card.get("parameters") or {}).get("draft"), card
        text = greedy_text()
        assert text == plain, ("speculative decoding changed the greedy text", plain, text)
        return f"draft {draft_name} loaded; greedy text unchanged by drafting: {text!r}"

    for name, fn in (("models list", models), ("chat completion", chat_completion), ("completion", completion),
                     ("streaming chat", streaming), ("n=2", n2), ("JSON schema (formatron filter)", json_schema),
                     ("tools (tool_choice=required)", tools), ("concurrent requests", concurrent),
                     ("banned strings", banned_strings), ("token healing", token_healing), ("CFG", cfg),
                     ("LoRA load / unload", lora), ("model unload / load", unload_load),
                     ("Q4 / Q8 cache", quantized_cache), ("draft model", draft)):
        if only and not any(o.lower() in name.lower() for o in only):
            continue
        checks.run(name, fn)
