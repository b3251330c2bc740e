"""TabbyAPI (its last commit with the exllamav2 backend, 79126f9) served by exlpy, unmodified.

    python benchmarks/tabbyapi.py --tabby /path/to/tabbyAPI-79126f9 --model MODEL_DIR [--draft-model DIR]
        [--venv DIR] [--wheelhouse DIR] [--no-install] [--out benchmarks/results/tabbyapi.md]
        [--budget SECONDS] [--only lora,json] [--random-weights] [--save-log FILE]

What it does, in order:
1. A virtual environment (default /tmp/exlpy-tabby-venv) that sees this interpreter's packages (torch, exlpy's
   dependencies) through a .pth line, and this exlpy checkout.
2. TabbyAPI's dependencies (its pyproject.toml) installed into it with pip, best effort: from PyPI, or with
   `--wheelhouse DIR` from wheels only (`--download-wheels DIR` fills such a folder on a machine with network,
   for a GPU machine without one). Packages this interpreter already has are not installed again.
3. `exlpy compat install` into that environment: `import exllamav2` is exlpy there, with exllamav2's
   distribution metadata (TabbyAPI checks for it).
4. TabbyAPI started with its own entry point (`python main.py --config CONFIG`, from the checkout, nothing in it
   changed; CONFIG, the model links and a LoRA adapter live in a temporary folder).
5. The OpenAI client drives it: models, chat, completions, streaming, JSON schema, tools, LoRA load/unload,
   model unload/load, a draft model; each check is recorded with its result and time in the results file.
   Tools: TabbyAPI's `mistral` tool format with tabbyapi_parts/chatml_tools.jinja as its chat template, the
   reply held to the call syntax by TabbyAPI's `regex_pattern` (any model writes it; see checks.py).

Model: any exlpy-loadable directory (fp16 or EXL2). The LoRA adapter is a random rank-8 PEFT adapter written
for the model's shapes (its effect is checked, not its quality). The draft model defaults to the model itself.

Each part is a module of benchmarks/tabbyapi_parts/ (environment: steps 1-3; server: the config, the adapter and
TabbyAPI's process, step 4; checks: step 5; report: the results file); this script is their command line.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.tabbyapi_parts import server  # noqa: E402
from benchmarks.tabbyapi_parts.checks import Checks, drive  # noqa: E402
from benchmarks.tabbyapi_parts.environment import (  # noqa: E402
    alias_install,
    child_env,
    download_wheels,
    install_deps,
    make_venv,
    mask_torch_cuda13,
    tabby_requirements,
    venv_python,
)
from benchmarks.tabbyapi_parts.report import write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "tabbyapi.md"


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit("SIGTERM")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tabby", type=Path, required=True, help="TabbyAPI checkout (commit 79126f9)")
    p.add_argument("--model", type=Path, default=ROOT.parent / "shared" / "models" / "smollm2-135m-exl2-4.0")
    p.add_argument("--draft-model", type=Path, default=None, help="draft model (default: the model itself)")
    p.add_argument("--venv", type=Path, default=Path(tempfile.gettempdir()) / "exlpy-tabby-venv")
    p.add_argument("--wheelhouse", type=Path, default=None, help="install TabbyAPI's dependencies from here only")
    p.add_argument("--download-wheels", type=Path, default=None, help="only download the wheels into this folder")
    p.add_argument("--wheel-python", default=None, help="with --download-wheels: the target machine's Python "
                   "version, e.g. 3.12")
    p.add_argument("--no-install", action="store_true", help="do not pip-install TabbyAPI's dependencies")
    p.add_argument("--port", type=int, default=5057)
    p.add_argument("--tool-format", default="mistral", help="TabbyAPI's model.tool_format for the tools check "
                   "(default mistral: the check constrains the reply to that format's call syntax, so any model "
                   "writes it; another format, e.g. qwen3_coder, needs a model that emits it; 'none': skip)")
    p.add_argument("--tool-template", default="auto", help="chat template for TabbyAPI (model.prompt_template): "
                   "a .jinja file, 'model' for the model's own, or 'auto': with --tool-format mistral "
                   f"{server.TOOLS_TEMPLATE.name} (ChatML rendering tools, calls and results), else the model's own")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--budget", type=float, default=None, help="seconds for the whole run, set-up included: "
                   "checks not started by then are recorded as skipped, and the results file is written")
    p.add_argument("--random-weights", action="store_true", help="the model has random weights (its text is noise): "
                   "the structured-output check uses a bounded regex instead of an unbounded JSON schema")
    p.add_argument("--only", default=None, help="comma-separated parts of check names: run only those checks")
    p.add_argument("--save-log", type=Path, default=None, help="copy TabbyAPI's whole log here")
    p.add_argument("--commit", default="79126f9")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    tabby, model = args.tabby.resolve(), args.model.resolve()
    draft = (args.draft_model or args.model).resolve()
    reqs = tabby_requirements(tabby)
    if args.download_wheels:
        download_wheels(reqs, args.download_wheels, args.wheel_python)
        return 0

    t_start = time.monotonic()
    deadline = t_start + args.budget if args.budget else float("inf")
    # A `timeout` from outside (SIGTERM) ends the run the same way as the budget: TabbyAPI stopped, results written.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    setup_log: list[str] = []
    site = make_venv(args.venv)
    py = venv_python(args.venv)
    setup_log.append(f"venv {args.venv} (site-packages {site})")
    if not args.no_install:
        install_deps(py, [*reqs, "openai"], args.wheelhouse, setup_log)
    mask_torch_cuda13(site, setup_log)
    alias_install(py, setup_log)
    setup_log.append(f"set-up took {time.monotonic() - t_start:.0f} s")
    for line in setup_log:
        print("setup:", line[:300], flush=True)
    sys.path.append(str(site))  # the driver's openai client, where this interpreter has none (after its own)

    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    work = Path(tempfile.mkdtemp(prefix="exlpy-tabby-"))
    server.write_lora(model, work / "loras" / "random-r8", std=0.2 if args.random_weights else 0.05)
    tool_format = None if args.tool_format in ("", "none") else args.tool_format
    template = {"auto": server.TOOLS_TEMPLATE if tool_format == "mistral" else None, "model": None}.get(
        args.tool_template, Path(args.tool_template))
    cfg = server.write_config(work, model, draft, args.port, args.max_seq_len, tool_format, template)
    log_path = work / "tabby.log"
    env = child_env(PYTHONUNBUFFERED="1")

    def log_tail() -> str:
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-40:]) if log_path.exists() else ""

    checks = Checks(deadline, lambda: write_results(args.out, args, checks, setup_log, device, log_tail()))
    proc = server.start(py, tabby, cfg, log_path, env)
    base = f"http://127.0.0.1:{args.port}"
    try:
        startup = min(args.startup_timeout, max(checks.left(), 1.0))

        def started() -> str:
            server.wait_ready(base, proc, startup)
            return f"ready at {base}"

        if checks.run("start and load the model", started):
            drive(base, model.name, draft.name, tool_format, checks, args.random_weights,
                  args.only.split(",") if args.only else None)
    except BaseException as e:  # stopped from outside (SIGTERM, Ctrl-C): record where
        if checks.current is not None:
            checks.add(checks.current, "failed", time.perf_counter() - checks.t0,
                       f"interrupted ({type(e).__name__}: {e}; --budget {args.budget or 0:.0f} s)")
        raise
    finally:
        server.terminate(proc)
        write_results(args.out, args, checks, setup_log, device, log_tail())  # first: a kill may follow soon
        server.reap(proc)
        if args.save_log:
            args.save_log.write_bytes(log_path.read_bytes())
        print(f"results: {args.out}; work dir {work}; {time.monotonic() - t_start:.0f} s in all", flush=True)
    return 0 if all(r != "failed" for _, r, _, _ in checks.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
