"""An import hook that answers `import exllamav2[.X.Y]` with exlpy's module `exlpy[.X.Y]`.

The hook sits first on `sys.meta_path` and maps names on demand, so a module that exlpy gains later (e.g.
`exlpy.generator.filters`) resolves without a table entry. The alias and the original are the same module
object: `exllamav2.generator.ExLlamaV2Sampler is exlpy.generator.ExLlamaV2Sampler`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

from exlpy.errors import CompatImportError

ALIAS = "exllamav2"
TARGET = "exlpy"

# exllamav2 modules (and their submodules) that live under another name in exlpy.
RENAMED = {
    "generator.dynamic_async": "generator.dynamic.async_",
    "generator.dynamic_embeddings": "vision.embedding",
    "vlm.vision_tower": "vision.tower",
    "vlm": "vision",
    "generator.ngram": "generator.speculative.ngram",  # n-gram drafting
    "mlp": "compat.modules",  # block classes scripts test modules against
    "moe_mlp": "compat.modules",
    "parallel_decoder": "compat.modules",
    "conversion.tokenize": "compat.modules",  # get_tokens (test_inference.py's dataset reader)
    "conversion.quantize": "compat.modules",  # list_live_tensors
    "conversion": "convert",  # the EXL2 converter (exllamav2's convert.py is `exlpy convert`); after its modules
}
# exllamav2 modules with no exlpy counterpart, and why.
MISSING = {
    "ext": "exlpy has no compiled extension (exllamav2_ext): its kernels are Triton, with torch references",
    "server": "exllamav2's websocket server is not part of exlpy; `exlpy serve` is an OpenAI-compatible server",
    "experimental": "exllamav2's experimental modules are not part of exlpy",
    "device": "exllamav2's device contexts do not exist in exlpy (torch's allocator gives scratch per call)",
}


def target_name(fullname: str) -> str | None:
    """exlpy's module name for an exllamav2 module name (None for other names)."""
    if fullname == ALIAS:
        return TARGET
    if not fullname.startswith(ALIAS + "."):
        return None
    sub = fullname[len(ALIAS) + 1:]
    for old, new in RENAMED.items():
        if sub == old or sub.startswith(old + "."):
            return f"{TARGET}.{new}{sub[len(old):]}"
    return f"{TARGET}.{sub}"


class _Loader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target
        self.module: ModuleType | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        self.module = importlib.import_module(self.target)
        self.original_spec = self.module.__spec__
        return self.module

    def exec_module(self, module: ModuleType) -> None:
        # The import system stamped the alias spec on exlpy's module; it stays exlpy's module, so restore its own.
        module.__spec__ = self.original_spec


class AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        name = target_name(fullname)
        if name is None:
            return None
        sub = fullname[len(ALIAS) + 1:]
        reason = next((why for key, why in MISSING.items() if sub == key or sub.startswith(key + ".")), None)
        found = None
        if reason is None:
            try:
                found = importlib.util.find_spec(name)
            except ModuleNotFoundError:  # a missing parent package
                found = None
            if found is None:
                reason = f"exlpy has no module {name}"
        if reason is not None or found is None:
            raise CompatImportError(f"cannot import {fullname} under exlpy's exllamav2 compatibility switch: {reason}",
                                    name=fullname)
        return importlib.util.spec_from_loader(fullname, _Loader(name),
                                               is_package=found.submodule_search_locations is not None)


_FINDER = AliasFinder()


def install() -> None:
    """Make `import exllamav2` (and every `exllamav2.X`) resolve to exlpy for the rest of this process.
    Idempotent. Fails if the real exllamav2 was already imported (its objects would mix with exlpy's)."""
    real = sys.modules.get(ALIAS)
    if real is not None and getattr(real, "__name__", None) != TARGET:
        raise CompatImportError("exlpy.compat.install(): the real exllamav2 package is already imported in this "
                                "process; install the switch before anything imports exllamav2", name=ALIAS)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    """Remove the hook and forget every `exllamav2*` alias (exlpy's modules stay imported)."""
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for name in [n for n in sys.modules if n == ALIAS or n.startswith(ALIAS + ".")]:
        if getattr(sys.modules[name], "__name__", "").startswith(TARGET):
            del sys.modules[name]


def installed() -> bool:
    return _FINDER in sys.meta_path
