"""exlpy.compat: `import exllamav2` resolves to exlpy's modules, lazily, without duplicating them; what exlpy
lacks is a clear typed import error; a real exllamav2 already imported is refused."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

import exlpy
import exlpy.compat
from exlpy.errors import CompatImportError
from tests.conftest import child_env


@pytest.fixture
def compat() -> Iterator[None]:
    exlpy.compat.install()
    yield
    exlpy.compat.uninstall()


def test_aliases_are_exlpys_modules(compat: None) -> None:
    import exllamav2
    import exllamav2.generator
    import exllamav2.generator.dynamic_async
    from exllamav2 import model_init
    from exllamav2.generator import ExLlamaV2Sampler

    import exlpy.generator
    import exlpy.generator.dynamic.async_
    import exlpy.model_init

    assert model_init is exlpy.model_init and exllamav2.generator.dynamic_async is exlpy.generator.dynamic.async_
    # The package and generator are thin aliases (exllamav2's __version__); their contents are exlpy's objects.
    assert exllamav2.ExLlamaV2 is exlpy.ExLlamaV2 and exllamav2.model_init is exlpy.model_init
    assert ExLlamaV2Sampler is exlpy.generator.ExLlamaV2Sampler
    assert exllamav2.generator.dynamic is exlpy.generator.dynamic
    # exlpy's modules keep their own identity (the import system must not rename them).
    assert exlpy.generator.__spec__.name == "exlpy.generator" and exlpy.generator.__name__ == "exlpy.generator"
    exlpy.compat.install()  # idempotent
    assert sum(type(f).__name__ == "AliasFinder" for f in sys.meta_path) == 1


def test_versions_are_exllamav2s_under_the_alias_and_exlpys_under_exlpy(compat: None) -> None:
    """Programs check `exllamav2.__version__` for a minimum exllamav2 version: under the alias it is the release
    whose API exlpy implements (the one the environment-wide alias's metadata reports), never exlpy's own."""
    import exllamav2
    import exllamav2.version
    from exllamav2 import __version__ as from_package
    from exllamav2.generator import __version__ as from_generator
    from exllamav2.tokenizer import __version__ as from_tokenizer
    from exllamav2.version import __version__ as from_version

    import exlpy.generator
    import exlpy.tokenizer
    import exlpy.version
    from exlpy.compat import envwide, version

    assert exllamav2.__version__ == exllamav2.version.__version__ == from_package == from_version == "0.3.2"
    assert from_generator == from_tokenizer == version.__version__ == envwide.ALIAS_VERSION == "0.3.2"
    assert exlpy.__version__ == exlpy.version.__version__ == exlpy.generator.__version__ == "0.1.0"
    assert exlpy.tokenizer.__version__ == "0.1.0" and exlpy.version is not exllamav2.version
    namespace: dict[str, object] = {}
    exec("from exllamav2 import *", namespace)  # __all__ names __version__
    assert namespace["__version__"] == "0.3.2" and namespace["ExLlamaV2"] is exlpy.ExLlamaV2


def test_alias_writes_reach_exlpy_but_keep_its_names(compat: None) -> None:
    """A monkeypatch of `exllamav2.X` is seen by exlpy's code, as when the alias was exlpy's module itself; the
    alias's own bookkeeping (its name, spec, the submodules bound on it) stays off exlpy's modules."""
    import exllamav2
    import exllamav2.generator.dynamic_async

    original = exlpy.ExLlamaV2Config
    exllamav2.ExLlamaV2Config = int  # type: ignore[misc,assignment]
    try:
        assert exlpy.ExLlamaV2Config is int
    finally:
        exllamav2.ExLlamaV2Config = original
    assert exlpy.ExLlamaV2Config is original
    assert exllamav2.__name__ == "exllamav2" and exlpy.__name__ == "exlpy" and exlpy.__spec__.name == "exlpy"
    assert not hasattr(exlpy.generator, "dynamic_async") and "ExLlamaV2" in dir(exllamav2)
    assert exllamav2.__file__ == exlpy.__file__  # tools locating the package find exlpy's files


def test_uninstall_forgets_aliases() -> None:
    exlpy.compat.install()
    import exllamav2.util  # noqa: F401

    exlpy.compat.uninstall()
    assert not exlpy.compat.installed()
    assert not [n for n in sys.modules if n == "exllamav2" or n.startswith("exllamav2.")]
    assert "exlpy.util" in sys.modules


def test_mapping_is_lazy(compat: None) -> None:
    """A module exlpy gains later (as exlpy.generator.filters will) resolves without any table entry."""
    name = "exlpy.generator.zz_added_later"
    late = types.ModuleType(name)
    late.__spec__ = importlib.util.spec_from_loader(name, loader=None)
    late.VALUE = 42  # type: ignore[attr-defined]
    sys.modules[name] = late
    try:
        mod = importlib.import_module("exllamav2.generator.zz_added_later")
        assert mod is late and mod.VALUE == 42
    finally:
        sys.modules.pop(name, None)
        sys.modules.pop("exllamav2.generator.zz_added_later", None)


def test_filters_resolve_when_present(compat: None) -> None:
    from exllamav2.generator.base import ExLlamaV2Filter as from_base  # formatron imports it from here
    from exllamav2.generator.filters import ExLlamaV2Filter

    import exlpy.generator.filters

    assert ExLlamaV2Filter is exlpy.generator.filters.ExLlamaV2Filter is from_base


def test_conversion_and_ngram_resolve_to_what_exlpy_has(compat: None) -> None:
    import exllamav2.conversion
    import exllamav2.conversion.qparams
    import exllamav2.generator.ngram

    import exlpy.convert
    import exlpy.convert.qparams
    import exlpy.generator.speculative.ngram

    assert exllamav2.conversion is exlpy.convert and exllamav2.conversion.convert is exlpy.convert.convert
    assert exllamav2.conversion.qparams is exlpy.convert.qparams
    assert exllamav2.generator.ngram is exlpy.generator.speculative.ngram


def test_ngram_cache_has_exllamav2s_interface(compat: None) -> None:
    """exllamav2.generator.ngram's NgramCache: counts, longest suffix first, threshold, a preloaded table."""
    from exllamav2.generator.ngram import NgramCache, NgramCacheNode

    cache = NgramCache(1, 4, None)
    cache.update([5, 1, 2, 3, 1, 2, 3, 1, 2, 9])
    assert cache.predict_next([7, 1, 2], 1, None) == 3  # 1,2 -> 3 twice
    assert cache.predict_next([7, 1, 2], 3, None) is None  # seen twice, under the threshold
    assert cache.predict_next([8, 8], 1, None) is None
    assert cache.predict_next([3, 1], 1, None) == 2  # the longest suffix that matched
    assert isinstance(cache.ngrams[(1, 2)], NgramCacheNode) and cache.ngrams[(1, 2)].transitions == {3: 2}

    preload = NgramCache(1, 4, None)
    preload.update([4, 6, 4, 6, 4, 6])
    own = NgramCache(1, 4, preload)
    assert own.predict_next([0, 4], 1, None) is None and own.predict_next([0, 4], 1, preload) == 6
    own.update_single([4, 7])  # a node first met here starts from the preloaded counts
    assert own.ngrams[(4,)].transitions == {6: preload.ngrams[(4,)].transitions[6], 7: 1}


def test_test_inference_imports_resolve(compat: None, tmp_path) -> None:
    """The module paths exllamav2's test_inference.py imports at its top."""
    from exllamav2.conversion.quantize import list_live_tensors
    from exllamav2.conversion.tokenize import get_tokens
    from exllamav2.mlp import ExLlamaV2MLP
    from exllamav2.moe_mlp import ExLlamaV2MoEMLP
    from exllamav2.parallel_decoder import ExLlamaV2ParallelDecoder

    from exlpy.errors import NotSupportedError
    from exlpy.model.mlp import MLP
    from exlpy.model.moe import MoEMLP
    from exlpy.tokenizer import ExLlamaV2Tokenizer
    from tests.conftest import shared_path

    assert ExLlamaV2MLP is MLP and ExLlamaV2MoEMLP is MoEMLP and callable(list_live_tensors)
    with pytest.raises(NotSupportedError):
        ExLlamaV2ParallelDecoder()
    tok = ExLlamaV2Tokenizer(str(shared_path("models", "aidreams260K")))
    (tmp_path / "d.txt").write_text("Echoes of vectors unfold, a gentle hum of precision. " * 20)
    assert get_tokens(3, 16, str(tmp_path / "d.txt"), tok).shape == (3, 16)


@pytest.mark.parametrize("name,why", [("exllamav2.ext", "compiled extension"), ("exllamav2.conversion.adaptivegptq",
                                      "no module exlpy.convert.adaptivegptq"),
                                      ("exllamav2.vlm.processor", "no module exlpy.vision.processor"),
                                      ("exllamav2.no_such_module", "no module exlpy.no_such_module")])
def test_missing_modules_are_typed_errors(compat: None, name: str, why: str) -> None:
    with pytest.raises(CompatImportError, match=why) as e:
        importlib.import_module(name)
    assert isinstance(e.value, ModuleNotFoundError) and name.startswith(e.value.name)  # the package, or the module


def test_real_exllamav2_already_imported_is_refused() -> None:
    fake = types.ModuleType("exllamav2")
    sys.modules["exllamav2"] = fake
    try:
        with pytest.raises(CompatImportError, match="already imported"):
            exlpy.compat.install()
        assert not exlpy.compat.installed()
    finally:
        del sys.modules["exllamav2"]


def test_runner_usage_and_missing_script() -> None:
    r = subprocess.run([sys.executable, "-m", "exlpy.compat"], capture_output=True, text=True, timeout=120,
                       env=child_env())
    assert r.returncode == 2 and "usage: exlpy-as-exllamav2" in r.stdout
    r = subprocess.run([sys.executable, "-m", "exlpy.compat", "/no/such/script.py"], capture_output=True, text=True,
                       timeout=120, env=child_env())
    assert r.returncode == 1 and "no such script: /no/such/script.py" in r.stderr and "Traceback" not in r.stderr


def test_runner_module_mode(tmp_path: Path) -> None:
    (tmp_path / "uses_exllamav2.py").write_text(
        "import sys\nimport exllamav2\nfrom exllamav2.util import Timer\n"
        "print('OK', exllamav2.__name__, Timer.__module__, sys.argv[1:])\n")
    r = subprocess.run([sys.executable, "-m", "exlpy.compat", "-m", "uses_exllamav2", "a", "--b"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120, env=child_env())
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "OK exllamav2 exlpy.util ['a', '--b']"  # the package alias keeps its name
