"""`exlpy-as-exllamav2 SCRIPT [ARGS...]` / `exlpy-as-exllamav2 -m MODULE [ARGS...]`: run a program written for
exllamav2 on exlpy, with `import exllamav2` answered by exlpy (see exlpy.compat)."""

from __future__ import annotations

import os
import runpy
import sys

from exlpy.compat.alias import install

USAGE = ("usage: exlpy-as-exllamav2 SCRIPT.py [ARGS...]  |  exlpy-as-exllamav2 -m MODULE [ARGS...]  |  "
         "exlpy-as-exllamav2 --install | --uninstall  (the alias for the whole environment: exlpy compat)")


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE + "\nRuns the program with `import exllamav2` resolving to exlpy.")
        raise SystemExit(0 if args else 2)
    if args[0] in ("--install", "--uninstall"):
        from exlpy.cli.main import main as exlpy_main

        raise SystemExit(exlpy_main(["compat", args[0][2:], *args[1:]]))
    install()
    if args[0] == "-m":
        if len(args) < 2:
            raise SystemExit(USAGE)
        sys.argv = [args[1], *args[2:]]
        sys.path.insert(0, os.getcwd())  # as `python -m`: the current directory comes first
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        return
    script = args[0]
    if not os.path.isfile(script):
        raise SystemExit(f"exlpy-as-exllamav2: no such script: {script}")
    sys.argv = [script, *args[1:]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script.py`: its folder comes first
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
