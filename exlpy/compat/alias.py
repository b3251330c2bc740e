"""An import hook that answers `import exllamav2[.X.Y]` with exlpy's module `exlpy[.X.Y]`.

The hook sits first on `sys.meta_path` and maps names on demand, so a module that exlpy gains later (e.g.
`exlpy.generator.filters`) resolves without a table entry. The alias of a module is exlpy's module object
itself (`exllamav2.generator.dynamic is exlpy.generator.dynamic`), except for the modules of exllamav2 that
export `__version__`: programs read that to check for a minimum exllamav2 version, so under the alias it must be
the exllamav2 release exlpy implements (exlpy.compat.version), while `exlpy.__version__` stays exlpy's own. Those
aliases (`exllamav2`, `exllamav2.generator`, `exllamav2.tokenizer`) are thin `AliasModule`s whose attributes read
and write through to exlpy's module (`exllamav2.ExLlamaV2 is exlpy.ExLlamaV2`), `__version__` excepted, and
`exllamav2.version` is exlpy/compat/version.py.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

from exlpy.compat.version import __version__ as EXLLAMAV2_VERSION
from exlpy.errors import CompatImportError

ALIAS = "exllamav2"
TARGET = "exlpy"

# exllamav2 modules (and their submodules) that live under another name in exlpy.
RENAMED = {
    "version": "compat.version",  # exllamav2's version, not exlpy's
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

# exllamav2 modules that export `__version__` (exllamav2 0.3.2: the package, `generator`, `tokenizer`).
VERSIONED = frozenset({ALIAS, f"{ALIAS}.generator", f"{ALIAS}.tokenizer"})


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


class AliasModule(ModuleType):
    """exllamav2's name for one of exlpy's modules, answering exllamav2's `__version__`.

    Reads of other attributes go to exlpy's module, and so do writes (a monkeypatch of `exllamav2.X` is seen by
    exlpy's code, as when the alias was exlpy's module itself). Kept on the alias: `__version__` and the import
    system's bookkeeping (dunders such as `__spec__`, and submodules it binds as attributes), so that exlpy's
    module is neither renamed nor handed exllamav2's submodules."""

    def __init__(self, name: str, target: ModuleType) -> None:
        super().__init__(name, target.__doc__)
        vars(self)["__exlpy_module__"] = target
        vars(self)["__version__"] = EXLLAMAV2_VERSION

    def __getattr__(self, name: str) -> object:
        target = vars(self)["__exlpy_module__"]
        try:
            value = getattr(target, name)
        except AttributeError:
            raise AttributeError(f"module {self.__name__!r} (exlpy's {target.__name__!r}) has no attribute {name!r}",
                                 name=name, obj=self) from None
        if isinstance(value, ModuleType) and value.__name__.startswith(target.__name__ + "."):
            # A submodule: answer its alias where that is another module (exllamav2.version is not exlpy.version).
            full = f"{self.__name__}.{name}"
            if full in VERSIONED or target_name(full) != value.__name__:
                return importlib.import_module(full)
        return value

    def __setattr__(self, name: str, value: object) -> None:
        if (name.startswith("__") and name.endswith("__")) or isinstance(value, ModuleType):
            super().__setattr__(name, value)
        else:
            setattr(vars(self)["__exlpy_module__"], name, value)

    def __delattr__(self, name: str) -> None:
        if name in vars(self):
            super().__delattr__(name)
        else:
            delattr(vars(self)["__exlpy_module__"], name)

    def __dir__(self) -> list[str]:
        return sorted(set(vars(self)) | set(dir(vars(self)["__exlpy_module__"])) - {"__exlpy_module__"})

    def __repr__(self) -> str:
        return (f"<module {self.__name__!r}: exllamav2 {EXLLAMAV2_VERSION}'s API, "
                f"exlpy's module {vars(self)['__exlpy_module__'].__name__!r}>")


def is_alias(module: object) -> bool:
    """Whether `module` is what the alias answers for some exllamav2 name (exlpy's module or an AliasModule)."""
    return isinstance(module, AliasModule) or getattr(module, "__name__", "").startswith(TARGET)


class _Loader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target
        self.module: ModuleType | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        self.module = importlib.import_module(self.target)
        self.original_spec = self.module.__spec__
        if spec.name in VERSIONED:
            return AliasModule(spec.name, self.module)
        return self.module

    def exec_module(self, module: ModuleType) -> None:
        if isinstance(module, AliasModule):
            return  # a module of its own: the alias spec the import system gave it is right
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
    if real is not None and not is_alias(real):
        raise CompatImportError("exlpy.compat.install(): the real exllamav2 package is already imported in this "
                                "process; install the switch before anything imports exllamav2", name=ALIAS)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    """Remove the hook and forget every `exllamav2*` alias (exlpy's modules stay imported)."""
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for name in [n for n in sys.modules if n == ALIAS or n.startswith(ALIAS + ".")]:
        if is_alias(sys.modules[name]):
            del sys.modules[name]


def installed() -> bool:
    return _FINDER in sys.meta_path
