"""Entry point of the `exlpy` command. Subcommands live in their own modules and register themselves here."""

from __future__ import annotations

import argparse
import importlib
import sys

# Each subcommand module exposes add_parser(subparsers) and run(args) -> int.
SUBCOMMANDS = ("generate", "plan", "bench", "serve", "convert", "compat", "eval")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="exlpy", description="Run Llama-family LLMs (fp16, EXL2, GPTQ) with "
                                     "exllamav2's API, in pure Python + Triton.")
    from exlpy.version import __version__

    parser.add_argument("--version", action="version", version=f"exlpy {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"exlpy.cli.{name}")
        except ImportError as e:  # a subcommand whose optional dependencies are missing stays visible
            p = sub.add_parser(name, help=f"(unavailable: {e})")
            p.set_defaults(_run=lambda _a, e=e: _unavailable(e))
            continue
        module.add_parser(sub)
    return parser


def _unavailable(e: Exception) -> int:
    print(f"exlpy: this command is unavailable: {e}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    from exlpy.errors import ExlpyError

    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except ExlpyError as e:
        # Typed errors already say what is wrong and what to change: no traceback.
        print(f"exlpy: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
