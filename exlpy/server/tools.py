"""Tool calls for /v1/chat/completions: checking `tools` / `tool_choice`, putting the tools into the prompt,
constraining the reply when a call is required, and parsing the reply into OpenAI `tool_calls`.

A chat template that knows tools (it reads the `tools` variable) renders them itself, and the conversation's
tool calls and results go to it in the Hugging Face convention. For a template without tool support the tools
are described in the system message and calls / results are written into the messages as text, in the
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` form that most tool-tuned models use. The reply is
parsed for that form, or for a bare JSON call (`{"name": ..., "arguments"|"parameters": {...}}`, the Llama 3.1
form, also a list of them); only names of the offered tools count.

With `tool_choice` "required" or a named function, the reply is constrained by a grammar (llguidance) to one
call (or several, with `parallel_tool_calls`) whose arguments follow the tool's JSON schema.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from exlpy.errors import GeneratorError, GrammarError
from exlpy.server.schemas import ChatCompletionRequest, NamedToolChoice, Tool

NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
SYSTEM_PROMPT = ("You can call functions to help with the user's request. The functions, as JSON signatures "
                 "between <tools> and </tools>:\n<tools>\n{tools}\n</tools>\n\nTo call a function, reply with a "
                 "JSON object holding its name and arguments between <tool_call> and </tool_call>, one block per "
                 "call:\n<tool_call>\n{{\"name\": \"function name\", \"arguments\": {{...}}}}\n</tool_call>")


def _bad(param: str, message: str, cls: type[GeneratorError] = GeneratorError) -> GeneratorError:
    e = cls(f"{param}: {message}")
    e.param = param  # type: ignore[attr-defined]
    return e


@dataclass
class ToolPlan:
    tools: list[dict[str, Any]]  # OpenAI tool dicts, checked
    mode: str  # "auto", "required" or "named"
    name: str | None  # the named function
    parallel: bool
    native: bool  # the chat template renders tools itself
    style: str  # "hermes" (<tool_call> blocks) or "json" (bare JSON calls)

    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}


def check_tools(tools: list[Tool] | None) -> list[dict[str, Any]]:
    from exlpy.generator.filters.grammar import check_grammar, compile_json_schema

    out = []
    seen: set[str] = set()
    for i, t in enumerate(tools or []):
        if t.type != "function":
            raise _bad(f"tools[{i}].type", f"must be 'function', got {t.type!r}")
        f = t.function
        if f is None or not f.name:
            raise _bad(f"tools[{i}].function.name", "is required: every tool needs a function name")
        if not NAME.match(f.name):
            raise _bad(f"tools[{i}].function.name", f"must be 1-64 letters, digits, '_' or '-', got {f.name!r}")
        if f.name in seen:
            raise _bad(f"tools[{i}].function.name", f"duplicate tool name {f.name!r}")
        seen.add(f.name)
        params = f.parameters if f.parameters is not None else {"type": "object", "properties": {}}
        where = f"tools[{i}].function.parameters"
        try:
            check_grammar(compile_json_schema(params, where), where)
        except GrammarError as e:
            e.param = where  # type: ignore[attr-defined]
            raise
        fn: dict[str, Any] = {"name": f.name, "parameters": params}
        if f.description:
            fn["description"] = f.description
        out.append({"type": "function", "function": fn})
    return out


def plan_tools(req: ChatCompletionRequest, template_source: str) -> ToolPlan | None:
    """None when no tool may be called (no tools, or tool_choice "none")."""
    tools = check_tools(req.tools)
    choice = req.tool_choice
    name = None
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name if choice.function else None
        if choice.type != "function" or not name:
            raise _bad("tool_choice", "a named choice is {\"type\": \"function\", \"function\": {\"name\": ...}}")
        if name not in {t["function"]["name"] for t in tools}:
            raise _bad("tool_choice", f"function {name!r} is not one of the tools")
        mode = "named"
    else:
        mode = choice or ("auto" if tools else "none")
        if mode not in ("none", "auto", "required"):
            raise _bad("tool_choice", f"must be 'none', 'auto', 'required' or a named function, got {choice!r}")
        if mode == "required" and not tools:
            raise _bad("tool_choice", "'required' needs at least one tool in tools")
    if mode == "none" or not tools:
        return None
    native = "tools" in template_source
    style = "json" if native and "<tool_call>" not in template_source else "hermes"
    parallel = req.parallel_tool_calls is not False
    return ToolPlan(tools, mode, name, parallel, native, style)


def _arguments(args: str | dict[str, Any], where: str) -> dict[str, Any]:
    if isinstance(args, dict):
        return args
    try:
        value = json.loads(args or "{}")
    except ValueError as e:
        raise _bad(where, f"arguments must be a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise _bad(where, "arguments must be a JSON object")
    return value


def _call_text(name: str, args: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def message_text(m: Any, i: int, images: Any = None) -> str:
    """The text of message i, its role checked. Image parts become their alias in the text when `images`
    (exlpy/server/vision.py RequestImages) takes them; other parts (audio, ...) are not dropped silently (the
    model would answer without having seen them) but refused, naming the part."""
    if m.role not in CHAT_ROLES:
        raise _bad(f"messages[{i}].role", f"unknown role {m.role!r} (one of {', '.join(CHAT_ROLES)})")
    if isinstance(m.content, str) or m.content is None:
        return m.content or ""
    texts = []
    for k, part in enumerate(m.content):
        where = f"messages[{i}].content[{k}]"
        if part.type == "image_url" and images is not None:
            texts.append(images.alias(part, where))
            continue
        if part.type != "text":
            raise _bad(where, f"content parts of type {part.type!r} are not supported: this server's "
                      "models read text only")
        if part.text is None:
            raise _bad(where, "a text part needs a `text` string")
        texts.append(part.text)
    return "".join(texts)


def chat_messages(req: ChatCompletionRequest, plan: ToolPlan | None, images: Any = None
                  ) -> tuple[list[dict[str, Any]], list[str]]:
    """Messages for the chat template, and the user-written texts among them (kept as text when encoding)."""
    native = plan is not None and plan.native
    messages: list[dict[str, Any]] = []
    texts: list[str] = []
    for i, m in enumerate(req.messages):
        content = message_text(m, i, images)
        texts.append(content)
        msg: dict[str, Any] = {"role": m.role, "content": content}
        if m.name:
            msg["name"] = m.name
        if m.role == "assistant" and m.tool_calls:
            calls = [(c.function.name, _arguments(c.function.arguments, f"messages[{i}].tool_calls[{k}]"), c.id)
                     for k, c in enumerate(m.tool_calls)]
            if native:
                msg["tool_calls"] = [{"id": cid, "type": "function", "function": {"name": n, "arguments": a}}
                                     for n, a, cid in calls]
            else:
                msg["content"] = "\n".join([content, *(_call_text(n, a) for n, a, _ in calls)]).strip()
        if m.role == "tool":
            if native:
                msg["tool_call_id"] = m.tool_call_id
            else:
                msg = {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
        messages.append(msg)
    if plan is not None and not native:
        described = SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in plan.tools))
        if messages and messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + described}
        else:
            messages.insert(0, {"role": "system", "content": described})
    return messages, texts


def tool_grammar(plan: ToolPlan) -> str:
    """llguidance grammar text for a required / named call (Lark with an inline JSON schema)."""
    from exlpy.generator.filters.llg_tokenizer import import_llguidance

    llg = import_llguidance()
    tools = [t for t in plan.tools if plan.mode != "named" or t["function"]["name"] == plan.name]
    variants = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                  "arguments": t["function"]["parameters"]},
                 "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    body = json.dumps({"anyOf": variants, "x-guidance": JSON_OPTIONS})
    many = plan.parallel and plan.mode != "named"
    if plan.style == "hermes":
        start = 'start: call ("\\n" call)*' if many else "start: call"
        lark = f'{start}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\nbody: %json {body}'
    else:
        start = 'start: body | "[" body (", " body)* "]"' if many else "start: body"
        lark = f"{start}\nbody: %json {body}"
    return llg.LLMatcher.grammar_from_lark(lark)


def _as_call(obj: Any, names: set[str]) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def parse_tool_calls(text: str, plan: ToolPlan) -> tuple[str | None, list[dict[str, Any]]]:
    """(remaining content or None, tool calls) of a reply; no calls when nothing in it is a call of a tool."""
    names = plan.names()
    blocks = TOOL_CALL.findall(text)
    calls = []
    if blocks:
        for b in blocks:
            try:
                call = _as_call(json.loads(b), names)
            except ValueError:
                call = None
            if call is not None:
                calls.append(call)
        if calls:
            rest = TOOL_CALL.sub("", text).strip()
            return (rest or None), calls
        return text, []
    stripped = text.strip()
    try:
        value = json.loads(stripped)
    except ValueError:
        return text, []
    items = value if isinstance(value, list) else [value]
    calls = [c for c in (_as_call(v, names) for v in items) if c is not None]
    if calls and len(calls) == len(items):
        return None, calls
    return text, []
