"""A jinja2 sandbox that also bounds what a chat template may cost.

jinja2's ImmutableSandboxedEnvironment keeps a template away from Python internals, but a hostile (or broken)
template can still spin forever (nested `range(100000)` loops, exponential macro recursion) or allocate without
limit (`'x' * 10**10`, a string doubled in a loop, `'%1000000000d' % 1`). This environment adds, per render:

- a step budget: every loop iteration and every call (function, method, macro, filter) costs one step;
- a wall-clock deadline, checked every few hundred steps;
- size checks before the operations that make big values: `*`, `+`, `**`, `%` and `~` (concatenation), integer
  arguments of calls and filters (widths, counts), and format strings with huge widths;
- an output cap, counted while the template streams its output.

A template that exceeds any of them raises TemplateLimitError, which the caller reports as a ChatTemplateError
naming the template. The limits are far above what real chat templates use (a few hundred steps per message).
"""

from __future__ import annotations

import functools
import re
import time
import types
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_STEPS = 1_000_000
MAX_SECONDS = 10.0
MAX_OUTPUT_CHARS = 64 * 2**20  # also bounds any single string or list a template builds
MAX_INT_ARG = 1_000_000  # integer arguments of calls and filters (widths, repeat counts, range ends)
MAX_POW_BITS = 4096
# A %-format or str.format spec with a width or precision of 10^6 or more ('%1000000000d', '{:>9999999}').
_HUGE_WIDTH = re.compile(r"%[#0\- +]*\d*\.?\d{7,}|\{[^{}]*:[^{}]*\d{7,}[^{}]*\}")
_CHECK_CLOCK_EVERY = 256
_BUILTINS = (types.BuiltinFunctionType, types.BuiltinMethodType, types.MethodWrapperType)


class TemplateLimitError(Exception):
    """A chat template exceeded a step, time or size limit."""


class _Budget:
    def __init__(self, max_steps: int, max_seconds: float) -> None:
        self.steps = max_steps
        self.max_steps, self.max_seconds = max_steps, max_seconds
        self.deadline = time.monotonic() + max_seconds

    def tick(self) -> None:
        self.steps -= 1
        if self.steps % _CHECK_CLOCK_EVERY == 0:
            if self.steps <= 0:
                raise TemplateLimitError(f"more than {self.max_steps} loop iterations and calls (limit)")
            if time.monotonic() > self.deadline:
                raise TemplateLimitError(f"rendering took longer than {self.max_seconds:g} s (limit)")


_budget: ContextVar[_Budget | None] = ContextVar("exlpy_chat_budget", default=None)


def _tick() -> None:
    b = _budget.get()
    if b is not None:
        b.tick()


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else 0


def _check_size(n: int, what: str) -> None:
    if n > MAX_OUTPUT_CHARS:
        raise TemplateLimitError(f"{what} would make a value of {n} items (limit {MAX_OUTPUT_CHARS})")


def _check_args(args: Iterable[Any], what: str, skip_int: int = -1) -> None:
    """Integer arguments (except position `skip_int`, a filter's value) at most MAX_INT_ARG; no format string
    with a huge width."""
    for i, a in enumerate(args):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_INT_ARG and i != skip_int:
            raise TemplateLimitError(f"{what} got the integer argument {a} (limit {MAX_INT_ARG})")
        if isinstance(a, str) and ("%" in a or "{" in a) and _HUGE_WIDTH.search(a):
            raise TemplateLimitError(f"{what} got a format string with a width of 10^6 or more")


def _loop_guard(iterable: Any) -> Iterator[Any]:
    """What every `{% for %}` iterates: the same items, one step each."""
    for item in iterable:
        _tick()
        yield item


def _guard_filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    # the filtered value comes after the context or environment that pass_context/pass_environment filters take
    value_at = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(f)  # keeps jinja_pass_arg (pass_context / pass_environment markers)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _tick()
        _check_args(list(args) + list(kwargs.values()), f"filter '{name}'", skip_int=value_at)
        return f(*args, **kwargs)

    return guarded


class _GuardedCodeGenerator(CodeGenerator):
    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        # `a ~ b` joins through a size check: a string doubled in a loop would otherwise grow unbounded
        self.write("environment.checked_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class ChatSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "+", "**", "%"})
    code_generator_class = _GuardedCodeGenerator

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.filters = {n: _guard_filter(n, f) for n, f in self.filters.items()}
        self.globals["__exlpy_loop_guard"] = _loop_guard

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        # Every for-loop iterates through _loop_guard (recursive loops' later levels pass through call()).
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Call(nodes.Name("__exlpy_loop_guard", "load"), [loop.iter], [], None, None,
                                   lineno=loop.lineno)
        return tree

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja's signature
        _tick()
        if isinstance(__obj, _BUILTINS):  # str/list methods: widths and counts (macros take any value)
            _check_args(list(args) + list(kwargs.values()), f"call of {getattr(__obj, '__name__', 'a method')}")
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        fmt = super().wrap_str_format(value)
        if fmt is not None:  # '{:>1000000000}'.format(1): refused when the method is looked up
            _check_args([value.__self__], "str.format")
        return fmt

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _tick()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if _size(seq) and isinstance(n, int):
                    _check_size(_size(seq) * max(n, 0), "'*'")
        elif operator == "+":
            _check_size(_size(left) + _size(right), "'+'")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0:
                bits = abs(left).bit_length() * right
                if bits > MAX_POW_BITS:
                    raise TemplateLimitError(f"'**' would make a number of about {bits} bits (limit "
                                             f"{MAX_POW_BITS})")
        elif operator == "%" and isinstance(left, str):
            _check_args([left, *(right if isinstance(right, tuple) else (right,))], "'%' formatting")
        return super().call_binop(context, operator, left, right)

    @staticmethod
    def checked_concat(parts: tuple[Any, ...]) -> str:
        texts = [p if isinstance(p, str) else str(p) for p in parts]
        _check_size(sum(len(t) for t in texts), "'~'")
        return "".join(texts)


def render_limited(template: Any, variables: dict[str, Any], max_steps: int | None = None,
                   max_seconds: float | None = None, max_output: int | None = None) -> str:
    """Render a template compiled by ChatSandbox within the limits (TemplateLimitError past any of them);
    None takes the module's limit."""
    max_output = MAX_OUTPUT_CHARS if max_output is None else max_output
    token = _budget.set(_Budget(MAX_STEPS if max_steps is None else max_steps,
                                MAX_SECONDS if max_seconds is None else max_seconds))
    try:
        out: list[str] = []
        total = 0
        for chunk in template.generate(**variables):
            total += len(chunk)
            if total > max_output:
                raise TemplateLimitError(f"output longer than {max_output} characters (limit)")
            out.append(chunk)
        return "".join(out)
    finally:
        _budget.reset(token)
