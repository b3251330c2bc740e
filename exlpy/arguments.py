"""Unknown arguments are errors: exllamav2 ignores a misspelt keyword (`max_new_token=5` runs with the default),
exlpy names it. `refuse_unknown_arguments` wraps a public function or method so that a call its signature does
not accept raises `UnknownArgumentError` (a TypeError, so code catching TypeError keeps working) instead of
Python's bare TypeError."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from exlpy.errors import UnknownArgumentError

F = TypeVar("F", bound=Callable[..., Any])


def refuse_unknown_arguments(func: F) -> F:
    sig = inspect.signature(func)
    name = func.__qualname__.replace(".__init__", "")

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            sig.bind(*args, **kwargs)
        except TypeError as e:
            raise UnknownArgumentError(f"{name}(): {e}") from None
        return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
