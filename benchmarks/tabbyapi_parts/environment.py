"""The virtual environment TabbyAPI runs in: this interpreter's packages and this exlpy checkout seen through a
.pth line, TabbyAPI's dependencies installed with pip (or only downloaded, for a machine without network), the
`+cu13` torch label masked for TabbyAPI's guard, and `exlpy compat install` (`import exllamav2` is exlpy there)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child_env(**extra: str) -> dict[str, str]:
    """The environment of the venv's processes: no PYTHONPATH (its entries would come before the venv's own
    packages, e.g. another pydantic than the one TabbyAPI pins); the venv's .pth lines put exlpy on the path."""
    return {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "EXLPY_NO_CPU_WARNING": "1", **extra}


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def make_venv(venv: Path) -> Path:
    py = venv_python(venv)
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True, env=child_env()).stdout.strip())
    # This interpreter's packages come after the venv's own (so a pin TabbyAPI needs can shadow them), and this
    # exlpy checkout before both. Every site directory it has: a distribution's Python keeps pip-installed
    # packages in one (/usr/local/lib/python3.X/dist-packages) and its own in another (/usr/lib/python3/...).
    paths = sysconfig.get_paths()
    dirs = [paths["purelib"], paths["platlib"], *(p for p in sys.path if p.rstrip("/").endswith(
        ("site-packages", "dist-packages")))]
    (site / "_exlpy_parent.pth").write_text("\n".join([str(ROOT), *dict.fromkeys(dirs)]) + "\n")
    return site


def mask_torch_cuda13(site: Path, log: list[str]) -> None:
    """TabbyAPI 79126f9 turns its exllamav2 backend off when torch's distribution version ends in `+cu13...`
    (`common/optional_dependencies.py: is_torch_cuda_13`): exllamav2's compiled wheels were never built for CUDA 13.
    exlpy compiles nothing ahead of time, so the guard does not apply to it; a metadata-only `torch` dist-info in the
    venv's site-packages (found before this interpreter's own) reports the version without its local label. torch
    itself is not touched: `import torch` still loads this interpreter's build."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        full = version("torch")
    except PackageNotFoundError:
        return
    public, _, local = full.partition("+")
    for old in site.glob("torch-*.dist-info"):
        if (old / "EXLPY_MASK").exists():
            for f in old.iterdir():
                f.unlink()
            old.rmdir()
    if not local.startswith("cu13"):
        return
    info = site / f"torch-{public}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {public}\n")
    (info / "EXLPY_MASK").write_text(f"masks torch {full} for TabbyAPI's is_torch_cuda_13 guard\n")
    log.append(f"torch {full}: the venv reports torch {public} (a metadata-only dist-info), since TabbyAPI "
               "79126f9 disables its exllamav2 backend for +cu13 torch builds (exllamav2's compiled wheels; exlpy "
               "has none)")


def tabby_requirements(tabby: Path) -> list[str]:
    try:
        import tomllib  # Python 3.11+
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    with open(tabby / "pyproject.toml", "rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


def install_deps(py: Path, reqs: list[str], wheelhouse: Path | None, log: list[str]) -> bool:
    cmd = [str(py), "-m", "pip", "--disable-pip-version-check", "install", "--quiet", *reqs]
    if wheelhouse is not None:
        cmd[5:5] = ["--no-index", "--find-links", str(wheelhouse)]
    log.append("$ " + " ".join(cmd[2:]))
    res = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
    if res.returncode != 0:
        log.append("pip failed (best effort, continuing): " + (res.stderr.strip().splitlines() or ["?"])[-1])
        return False
    return True


def download_wheels(reqs: list[str], dest: Path, python_version: str | None) -> None:
    """Wheels of TabbyAPI's dependencies and theirs (and the openai client's, for the driver) for an offline
    x86-64 Linux machine running `python_version` (default: this interpreter's). pip on that machine installs
    only what its environment lacks from them (`--wheelhouse`)."""
    dest.mkdir(parents=True, exist_ok=True)
    target = []
    if python_version:
        target = ["--python-version", python_version, "--implementation", "cp"]
        for plat in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                     "manylinux2014_x86_64", "manylinux1_x86_64"):
            target += ["--platform", plat]
    subprocess.run([sys.executable, "-m", "pip", "download", "--only-binary=:all:", *target, "-d", str(dest),
                    *reqs, "openai", "httpx"], check=True)


def alias_install(py: Path, log: list[str]) -> None:
    res = subprocess.run([str(py), "-m", "exlpy.cli.main", "compat", "install"], capture_output=True, text=True,
                         env=child_env())
    log.append("$ exlpy compat install: " + (res.stdout.strip() or res.stderr.strip()))
    if res.returncode != 0:
        raise SystemExit(f"exlpy compat install failed:\n{res.stderr}")
