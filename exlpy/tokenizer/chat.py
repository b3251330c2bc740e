"""Chat templates: tokenizer_config.json's Jinja `chat_template` rendered in a sandbox.

The environment matches what model authors write templates against (the HF convention): trim_blocks and
lstrip_blocks, `raise_exception(msg)`, `strftime_now(fmt)`, and a `tojson` filter that keeps non-ASCII text.
It is jinja2's immutable sandbox with limits on steps, time and sizes (chat_sandbox.py); whatever goes wrong
while a template compiles or renders is a ChatTemplateError naming the template.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

import jinja2

from exlpy.errors import TokenizerError
from exlpy.tokenizer.chat_sandbox import ChatSandbox, TemplateLimitError, render_limited


class ChatTemplateError(TokenizerError):
    """The model has no chat template, or its template rejected the conversation."""


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(f"chat template error: {message}")


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False,
            sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ChatSandbox:
    env = ChatSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=16)
def _compile(template: str, source: str) -> jinja2.Template:
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"{source} does not parse (line {e.lineno}): {e.message}") from e
    except (RecursionError, MemoryError) as e:  # pathologically nested source
        raise ChatTemplateError(f"{source} cannot be compiled: {type(e).__name__}") from None


def select_template(raw: Any, name: str | None, where: str) -> str:
    """tokenizer_config.json holds one template string or a list of {name, template}; pick one."""
    if raw is None:
        raise ChatTemplateError(f"no chat_template in tokenizer_config.json of {where}; "
                                "pass chat_template=...")
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        chosen = named.get(name or "default")
        if isinstance(chosen, str):
            return chosen
        raise ChatTemplateError(f"chat template {name or 'default'!r} not found in {where}; "
                                f"have {sorted(named)}")
    raise ChatTemplateError(f"chat_template in {where} must be a string or a list, got {type(raw).__name__}")


def render_chat_template(template: str, messages: Sequence[dict[str, Any]],
                         add_generation_prompt: bool = True, bos_token: str = "", eos_token: str = "",
                         source: str = "chat template", **kwargs: Any) -> str:
    """Render `template` for `messages` ([{"role": ..., "content": ...}, ...]); extra kwargs (tools,
    date_string, ...) become template variables. `source` names the template in errors (e.g. the
    tokenizer_config.json it came from)."""
    if not isinstance(template, str):
        raise ChatTemplateError(f"{source} must be a string, got {type(template).__name__}")
    if not isinstance(messages, Sequence) or not all(isinstance(m, dict) for m in messages):
        raise ChatTemplateError("messages must be a list of dicts with 'role' and 'content'")
    compiled = _compile(template, source)
    variables = dict(messages=list(messages), add_generation_prompt=add_generation_prompt, bos_token=bos_token,
                     eos_token=eos_token, **kwargs)
    try:
        return render_limited(compiled, variables)
    except ChatTemplateError as e:
        raise ChatTemplateError(f"{source}: {e}") from e
    except TemplateLimitError as e:
        raise ChatTemplateError(f"{source} exceeded a limit: {e}") from None
    except RecursionError:
        raise ChatTemplateError(f"{source} recursed too deeply (e.g. a macro that calls itself)") from None
    except MemoryError:
        raise ChatTemplateError(f"{source} ran out of memory") from None
    except Exception as e:  # jinja2.TemplateError, and whatever the template's own expressions raise (1/0, ...)
        raise ChatTemplateError(f"{source} failed to render: {type(e).__name__}: {e}") from e
