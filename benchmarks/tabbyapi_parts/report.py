"""The results file: one section per device and model (replaced when the same pair runs again, the others
kept), written after every check so that a run stopped from outside keeps what it did."""

from __future__ import annotations

import argparse
import datetime as dt
import platform
from pathlib import Path

from benchmarks.tabbyapi_parts.checks import Checks


def write_results(out: Path, args: argparse.Namespace, checks: Checks, setup_log: list[str], device: str,
                  log_tail: str) -> None:
    title = f"## TabbyAPI {args.commit} on exlpy: {device}, {args.model.name}"
    passed = sum(r == "ok" for _, r, _, _ in checks.rows)
    skipped = sum(r == "skipped" for _, r, _, _ in checks.rows)
    lines = [
        title,
        "",
        f"Date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC. Host: {platform.node()}, Python "
        f"{platform.python_version()}. Model: `{args.model}`; draft: `{args.draft_model or args.model}`.",
        "",
        f"Command: `python benchmarks/tabbyapi.py --tabby {args.tabby} --model {args.model}"
        + (f" --draft-model {args.draft_model}" if args.draft_model else "")
        + (f" --wheelhouse {args.wheelhouse}" if args.wheelhouse else "")
        + (f" --budget {args.budget:.0f}" if args.budget else "")
        + (f" --tool-format {args.tool_format}" if args.tool_format != "mistral" else "")
        + (f" --tool-template {args.tool_template}" if args.tool_template != "auto" else "")
        + (" --random-weights" if args.random_weights else "") + (f" --only {args.only}" if args.only else "") + "`",
        "",
        "TabbyAPI started unmodified with `python main.py --config CONFIG` in a virtual environment where "
        "`exlpy compat install` aliases exllamav2 to exlpy.",
        "",
        f"**{passed} of {len(checks.rows) - skipped} checks passed** ({skipped} skipped).",
        "",
        "| check | result | time | detail |",
        "|---|---|---|---|",
    ]
    lines += [f"| {n} | {r if r != 'failed' else '**failed**'} | {t:.1f} s | {d} |" for n, r, t, d in checks.rows]
    lines += ["", "Set-up:", "", "```", *setup_log, "```", ""]
    if log_tail:
        lines += ["<details><summary>TabbyAPI log (tail)</summary>", "", "```", log_tail, "```", "</details>", ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    previous = out.read_text() if out.exists() else "# TabbyAPI on exlpy\n\n"
    if title in previous:  # replace this device's and model's section, keep the others
        head, _, rest = previous.partition(title)
        nxt = rest.find("\n## ")
        previous = head + (rest[nxt + 1:] if nxt >= 0 else "")
    out.write_text(previous.rstrip() + "\n\n" + "\n".join(lines))
