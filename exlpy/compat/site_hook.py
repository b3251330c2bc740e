"""The start-up hook of the environment-wide alias (`exlpy compat install`), copied into site-packages as
`_exlpy_exllamav2_alias.py` and imported by a `.pth` line at every interpreter start.

It must cost nothing at start-up: it imports neither exlpy nor torch, it only puts a finder first on
`sys.meta_path`. The first `import exllamav2[.X]` then decides once: when a real exllamav2 package is on the
path, the finder steps aside for good (the real package is imported, never shadowed); otherwise it installs
exlpy's alias (exlpy.compat.alias) and hands the import over to it.

This file is self-contained on purpose (standard library only): it is copied, not imported from exlpy.
"""

from __future__ import annotations

import importlib.machinery
import sys

ALIAS = "exllamav2"


class _LazyAlias:
    def find_spec(self, fullname: str, path: object = None, target: object = None) -> object:
        if fullname != ALIAS and not fullname.startswith(ALIAS + "."):
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # decided once, either way
        if importlib.machinery.PathFinder.find_spec(ALIAS, sys.path) is not None:
            return None  # a real exllamav2 is installed: it wins
        try:
            from exlpy.compat.alias import _FINDER, install
        except ImportError as e:
            raise ModuleNotFoundError(
                f"exllamav2 is aliased to exlpy in this environment (`exlpy compat install`), but exlpy cannot be "
                f"imported ({e}); reinstall exlpy, or remove the alias with `pip uninstall exllamav2`",
                name=fullname) from None
        install()
        return _FINDER.find_spec(fullname, path, target)


def activate() -> None:
    if not any(isinstance(f, _LazyAlias) or type(f).__name__ == "_LazyAlias" for f in sys.meta_path):
        sys.meta_path.insert(0, _LazyAlias())


if __name__ == "_exlpy_exllamav2_alias":  # the copy in site-packages, imported by the .pth line
    activate()
