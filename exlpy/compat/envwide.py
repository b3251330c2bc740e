"""The environment-wide alias: `exlpy compat install` makes every Python process of this environment answer
`import exllamav2` with exlpy, with no wrapper and no code change (TabbyAPI's own start command, a notebook,
`python -m` of a tool), until `exlpy compat uninstall`.

It writes three things into site-packages (all listed in the dist-info's RECORD, so pip sees an `exllamav2`
distribution and `pip uninstall exllamav2` removes it as well as `exlpy compat uninstall` does):

- `_exlpy_exllamav2_alias.py`, a copy of exlpy/compat/site_hook.py (standard library only: nothing is imported
  at start-up until a program imports exllamav2);
- `exlpy-exllamav2-alias.pth`, the one line that imports it at interpreter start;
- `exllamav2-<ALIAS_VERSION>.dist-info/` (METADATA, INSTALLER, RECORD), so `importlib.metadata.version(
  "exllamav2")` answers as programs that check for exllamav2 >= 0.3.1 expect.

A real exllamav2 is never shadowed: install refuses when one is installed, and the hook steps aside at run time
if one appears later (pip, seeing the alias's dist-info, removes the alias first when it installs exllamav2).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.machinery
import importlib.metadata
import io
import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from exlpy.compat.version import __version__ as ALIAS_VERSION  # programs check for exllamav2 >= 0.3.1
from exlpy.errors import CompatInstallError
from exlpy.version import __version__ as EXLPY_VERSION

HOOK_MODULE = "_exlpy_exllamav2_alias"
PTH_NAME = "exlpy-exllamav2-alias.pth"
INSTALLER = "exlpy"


def dist_dir_name(version: str = ALIAS_VERSION) -> str:
    return f"exllamav2-{version}.dist-info"


def default_site_dir() -> Path:
    """This interpreter's site-packages (the venv's, inside a venv)."""
    return Path(sysconfig.get_paths()["purelib"])


@dataclass(frozen=True)
class AliasStatus:
    site_dir: Path
    installed: bool  # the alias's files are in site_dir
    real: str | None  # where a real exllamav2 was found (None: none)


def _our_dists(site: Path) -> list[Path]:
    return [d for d in site.glob("exllamav2-*.dist-info") if _installer(d) == INSTALLER]


def _installer(dist: Path) -> str:
    try:
        return (dist / "INSTALLER").read_text(encoding="utf-8").strip()
    except OSError:
        return ""


def find_real(site: Path) -> str | None:
    """Where a real exllamav2 is: an importable `exllamav2` package or module on the path (or in `site`), or
    an exllamav2 distribution in `site` that the alias did not write."""
    spec = importlib.machinery.PathFinder.find_spec("exllamav2", [str(site), *sys.path])
    if spec is not None:
        return spec.origin or str(list(spec.submodule_search_locations or [""])[0])
    for d in site.glob("exllamav2-*.dist-info"):
        if _installer(d) != INSTALLER:
            return str(d)
    for dist in importlib.metadata.distributions(name="exllamav2"):
        path = Path(str(dist._path)) if hasattr(dist, "_path") else None  # type: ignore[attr-defined]
        if path is not None and _installer(path) != INSTALLER:
            return str(path)
    return None


def status(site_dir: str | os.PathLike[str] | None = None) -> AliasStatus:
    site = Path(site_dir) if site_dir is not None else default_site_dir()
    return AliasStatus(site, bool(_our_dists(site)) or (site / PTH_NAME).exists(), find_real(site))


def _record_row(site: Path, rel: str) -> list[str]:
    data = (site / rel).read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [rel, f"sha256={digest}", str(len(data))]


def install(site_dir: str | os.PathLike[str] | None = None) -> Path:
    """Write the alias into `site_dir` (default: this interpreter's site-packages). Idempotent. Returns the
    dist-info directory. Refuses when a real exllamav2 is installed."""
    site = Path(site_dir) if site_dir is not None else default_site_dir()
    real = find_real(site)
    if real is not None:
        raise CompatInstallError(f"a real exllamav2 is installed ({real}); the alias never shadows it. Use "
                                 "`exlpy-as-exllamav2 SCRIPT` to run one program on exlpy, or uninstall exllamav2 "
                                 "first (pip uninstall exllamav2)")
    if not site.is_dir():
        raise CompatInstallError(f"{site}: not a directory (give an existing site-packages directory)")
    if not os.access(site, os.W_OK):
        raise CompatInstallError(f"{site}: not writable (run as the environment's owner, or use a virtual "
                                 "environment)")
    if _our_dists(site):  # a previous alias (perhaps of another version) is replaced
        uninstall(site)
    dist = site / dist_dir_name()
    dist.mkdir()
    hook_src = Path(__file__).with_name("site_hook.py").read_text(encoding="utf-8")
    (site / f"{HOOK_MODULE}.py").write_text(hook_src, encoding="utf-8")
    (site / PTH_NAME).write_text(f"import {HOOK_MODULE}\n", encoding="utf-8")
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\n"
        "Name: exllamav2\n"
        f"Version: {ALIAS_VERSION}\n"
        f"Summary: exllamav2's API provided by exlpy {EXLPY_VERSION} (an alias written by `exlpy compat install`; "
        "remove it with `exlpy compat uninstall` or `pip uninstall exllamav2`)\n"
        "Requires-Dist: exlpy\n", encoding="utf-8")
    (dist / "INSTALLER").write_text(INSTALLER + "\n", encoding="utf-8")
    rels = [f"{HOOK_MODULE}.py", PTH_NAME, f"{dist.name}/METADATA", f"{dist.name}/INSTALLER"]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    for rel in rels:
        w.writerow(_record_row(site, rel))
    w.writerow([f"{dist.name}/RECORD", "", ""])
    (dist / "RECORD").write_text(buf.getvalue(), encoding="utf-8")
    return dist


def uninstall(site_dir: str | os.PathLike[str] | None = None) -> bool:
    """Remove the alias's files from `site_dir`. Returns whether there was anything to remove; an exllamav2
    distribution the alias did not write is left alone."""
    site = Path(site_dir) if site_dir is not None else default_site_dir()
    dists = _our_dists(site)
    removed = False
    for dist in dists:
        try:
            rows = list(csv.reader((dist / "RECORD").read_text(encoding="utf-8").splitlines()))
        except OSError:
            rows = []
        for row in rows:
            if not row:
                continue
            p = (site / row[0]).resolve()
            if p.parent != site.resolve() and p.parent != dist.resolve():
                continue  # the alias writes only at the top of site-packages and in its dist-info
            if p.is_file():
                p.unlink()
        shutil.rmtree(dist, ignore_errors=True)
        removed = True
    for p in (site / PTH_NAME, site / f"{HOOK_MODULE}.py"):
        if p.exists():
            p.unlink()
            removed = True
    for pyc in (site / "__pycache__").glob(f"{HOOK_MODULE}.*.pyc"):
        pyc.unlink()
    return removed
