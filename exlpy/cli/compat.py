"""`exlpy compat install | uninstall | status`: the environment-wide exllamav2 alias (exlpy/compat/envwide.py)."""

from __future__ import annotations

import argparse
from typing import Any

from exlpy.compat import envwide

HELP = ("make `import exllamav2` resolve to exlpy in every Python process of this environment (reversible; "
        "never over a real exllamav2)")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("compat", help=HELP, description=HELP + ". It writes a .pth start-up hook and an "
                       f"exllamav2-{envwide.ALIAS_VERSION}.dist-info into site-packages; `pip uninstall exllamav2` "
                       "removes them too. For one program only, use `exlpy-as-exllamav2 SCRIPT`.")
    p.add_argument("action", choices=("install", "uninstall", "status"))
    p.add_argument("--site-dir", default=None,
                   help="site-packages directory to write to (default: this interpreter's, "
                        f"{envwide.default_site_dir()})")
    p.set_defaults(_run=run)


def run(args: argparse.Namespace) -> int:
    if args.action == "install":
        dist = envwide.install(args.site_dir)
        print(f"exllamav2 now resolves to exlpy in this environment ({dist.parent}); `importlib.metadata` "
              f"reports exllamav2 {envwide.ALIAS_VERSION}. Undo with `exlpy compat uninstall`.")
        return 0
    if args.action == "uninstall":
        st = envwide.status(args.site_dir)
        if envwide.uninstall(args.site_dir):
            print(f"removed the exllamav2 alias from {st.site_dir}")
        else:
            print(f"no exllamav2 alias in {st.site_dir}; nothing removed")
        return 0
    st = envwide.status(args.site_dir)
    print(f"site-packages: {st.site_dir}")
    print(f"alias installed: {'yes' if st.installed else 'no'}")
    print(f"real exllamav2: {st.real or 'none'}")
    return 0
