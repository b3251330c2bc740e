"""Without Ray, importing exlpy.server.ray_app fails with an error that names the extra to install."""

from __future__ import annotations

import importlib
import sys

import pytest


def test_missing_ray_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError, as if not installed
    monkeypatch.setitem(sys.modules, "ray.serve", None)
    monkeypatch.delitem(sys.modules, "exlpy.server.ray_app", raising=False)
    with pytest.raises(ImportError, match=r"exlpy\[ray\]"):
        importlib.import_module("exlpy.server.ray_app")
