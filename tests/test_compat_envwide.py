"""The environment-wide exllamav2 alias (`exlpy compat install`): a .pth hook and an exllamav2 dist-info written
into a throw-away virtual environment, seen by importlib.metadata and pip, removed again by `exlpy compat
uninstall` or `pip uninstall exllamav2`, and never written over (or in front of) a real exllamav2."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from exlpy.compat import envwide
from exlpy.errors import CompatInstallError
from tests.conftest import child_env

ROOT = Path(__file__).resolve().parents[1]


def make_venv(tmp: Path) -> tuple[Path, Path]:
    """A venv without pip whose site-packages also sees this interpreter's (torch, pip, ... via a .pth line)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp / "v")], check=True)
    py = tmp / "v" / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "_parent.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return py, site


def run_py(py: Path, code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = child_env(PYTHONPATH=str(ROOT), EXLPY_NO_CPU_WARNING="1")
    return subprocess.run([str(py), "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


PROBE = """
import sys, importlib.metadata as md
print("version", md.version("exllamav2"))
print("lazy", "exlpy" not in sys.modules and "torch" not in sys.modules)
import exllamav2, exllamav2.generator, exlpy, exlpy.generator
print("same", exllamav2.ExLlamaV2 is exlpy.ExLlamaV2 and exllamav2.generator.ExLlamaV2Sampler is
      exlpy.generator.ExLlamaV2Sampler)
print("versions", exllamav2.__version__, exlpy.__version__ == exlpy.version.__version__)
"""


def test_install_is_seen_by_python_and_pip_and_removed_again(tmp_path: Path) -> None:
    py, site = make_venv(tmp_path)
    cli = [str(py), "-m", "exlpy.cli.main", "compat"]
    env = child_env(PYTHONPATH=str(ROOT), EXLPY_NO_CPU_WARNING="1")
    out = subprocess.run([*cli, "install"], env=env, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    dist = site / envwide.dist_dir_name()
    assert {p.name for p in dist.iterdir()} == {"METADATA", "INSTALLER", "RECORD"}
    res = run_py(py, PROBE, tmp_path)
    assert res.returncode == 0, res.stderr
    assert "version 0.3.2" in res.stdout and "lazy True" in res.stdout and "same True" in res.stdout
    assert "versions 0.3.2 True" in res.stdout  # one constant for the metadata and exllamav2.__version__
    st = subprocess.run([*cli, "status"], env=env, capture_output=True, text=True, cwd=ROOT).stdout
    assert "alias installed: yes" in st and "real exllamav2: none" in st

    # pip sees the distribution and removes every file of it.
    if importlib.util.find_spec("pip") is None:
        pytest.skip("pip is not installed: the pip half of this test cannot run")
    pip = [str(py), "-m", "pip", "--disable-pip-version-check"]
    listed = subprocess.run([*pip, "list"], env=env, capture_output=True, text=True, cwd=tmp_path).stdout
    assert any(line.split()[:2] == ["exllamav2", "0.3.2"] for line in listed.splitlines())
    rm = subprocess.run([*pip, "uninstall", "-y", "exllamav2"], env=env, capture_output=True, text=True,
                        cwd=tmp_path)
    assert rm.returncode == 0, rm.stderr
    assert sorted(p.name for p in site.iterdir()) == ["_parent.pth"]

    # ... and so does `exlpy compat uninstall`; afterwards exllamav2 is not importable.
    assert subprocess.run([*cli, "install"], env=env, capture_output=True, cwd=ROOT).returncode == 0
    out = subprocess.run([*cli, "uninstall"], env=env, capture_output=True, text=True, cwd=ROOT)
    assert "removed the exllamav2 alias" in out.stdout
    assert sorted(p.name for p in site.iterdir() if p.name != "__pycache__") == ["_parent.pth"]
    res = run_py(py, "import exllamav2", tmp_path)
    assert "No module named 'exllamav2'" in res.stderr


def test_a_real_exllamav2_is_never_shadowed(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "exllamav2").mkdir()
    (site / "exllamav2" / "__init__.py").write_text("REAL = True\n")
    with pytest.raises(CompatInstallError, match="real exllamav2 is installed"):
        envwide.install(site)
    assert sorted(p.name for p in site.iterdir()) == ["exllamav2"]
    # An exllamav2 dist-info that the alias did not write is left alone too.
    other = tmp_path / "other"
    (other / "exllamav2-0.2.9.dist-info").mkdir(parents=True)
    (other / "exllamav2-0.2.9.dist-info" / "INSTALLER").write_text("pip\n")
    with pytest.raises(CompatInstallError, match="exllamav2-0.2.9.dist-info"):
        envwide.install(other)
    assert not envwide.uninstall(other) and (other / "exllamav2-0.2.9.dist-info").is_dir()


def test_a_real_exllamav2_installed_after_the_alias_wins(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    envwide.install(site)
    real = tmp_path / "later"
    (real / "exllamav2").mkdir(parents=True)
    (real / "exllamav2" / "__init__.py").write_text("REAL = True\n")
    code = (f"import site, sys; site.addsitedir({str(site)!r}); sys.path.append({str(real)!r}); "
            "import exllamav2; print('real', getattr(exllamav2, 'REAL', False), 'exlpy' in sys.modules)")
    res = run_py(Path(sys.executable), code, tmp_path)
    assert res.returncode == 0, res.stderr
    assert "real True False" in res.stdout
    assert envwide.uninstall(site) and not any(site.iterdir())


def test_alias_left_behind_without_exlpy_says_how_to_remove_it(tmp_path: Path) -> None:
    """A venv that holds the alias but cannot import exlpy (exlpy uninstalled): a clear error, not a traceback
    from inside the hook."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "v")], check=True)
    py = tmp_path / "v" / "bin" / "python"
    site = Path(subprocess.run([str(py), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    envwide.install(site)
    res = subprocess.run([str(py), "-I", "-c", "import exllamav2"], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 1
    assert "ModuleNotFoundError" in res.stderr and "pip uninstall exllamav2" in res.stderr, res.stderr
    assert envwide.uninstall(site)
