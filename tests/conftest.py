"""Shared fixtures. Tests that need ../shared skip outside CI when it is absent; in CI they must not skip.

Triton interpreter tests (marker `interpreter`: Triton kernels on CPU tensors) cannot share a session with
compiled kernels: Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. once per process. So a session
without TRITON_INTERPRET=1 never sets it; it takes the selected interpreter tests out and runs them in one child
`python -m pytest` with TRITON_INTERPRET=1 (the item `tests::triton-interpreter`, which fails if any of them
fails), while CUDA tests in the same session use compiled kernels. Under TRITON_INTERPRET=1 everything runs in
the session itself. The child starts with the session's test loop and runs beside the other tests (the
interpreter is single-threaded Python: a second core's work); its item, last, waits for it. With
EXLPY_TEST_INTERPRETER_OVERLAP=0 it runs only when its item's turn comes. Under pytest-xdist workers the
interpreter tests are shared among EXLPY_TEST_INTERPRETER_SHARDS children (default 4), each an item queued first.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

# benchmarks/gpu_tests.sh -n N on a machine with several GPUs: each xdist worker of the one-GPU pass takes one GPU
# (worker k sees GPU k mod count), so the workers' kernels spread over all cards instead of queueing on the first.
# Set before torch starts CUDA, which reads CUDA_VISIBLE_DEVICES once.
if os.environ.get("EXLPY_TEST_SPREAD_GPUS") and os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw"):
    _gpus = int(os.environ["EXLPY_TEST_SPREAD_GPUS"])
    if _gpus > 1:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(int(os.environ["PYTEST_XDIST_WORKER"][2:]) % _gpus)

import torch  # noqa: E402  (after the GPU choice above)

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
IN_CI = os.environ.get("CI", "") == "true"


def shared_path(*parts: str) -> Path:
    """Path under ../shared; skips the test when the folder is absent (a user's fresh clone)."""
    p = SHARED.joinpath(*parts)
    if not p.exists():
        if IN_CI:
            pytest.fail(f"{p} is missing in CI: ../shared must be present")
        pytest.skip(f"{p} not present (../shared is only beside the project checkout)")
    return p


@pytest.fixture
def shared() -> Path:
    return shared_path()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b|, in fp32 on the CPU (a model on a GPU against a CPU reference)."""
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return ((a - b).abs().max() / b.abs().max()).item()


# rel_err bounds for logits where a model did not compute in fp32 on the CPU. CUDA's default compute dtype is fp16
# (ExLlamaV2Config.compute_dtype), and fp32 on a GPU still means TF32 in Triton's default dots (10 mantissa bits,
# as fp16): activations round to ~11 significant bits between ops (unit roundoff 4.9e-4). The tiny random models
# of these tests then differ from an fp32 reference by up to 1.0e-3 of the logits' max in fp16 (tests/
# test_model_logits.py with config.dtype = fp16 on the CPU; on an H100, incremental decode against a full forward:
# 7e-4), and by up to 8.8e-3 in bf16 (8 bits). The bounds leave ~5x of that.
HALF_PRECISION_TOL = {torch.float16: 5e-3, torch.float32: 5e-3, torch.bfloat16: 4e-2}


def logits_tol(model: Any, cpu_fp32_tol: float) -> float:
    """The rel_err bound for `model`'s logits against an fp32 reference, or between two of its forward paths:
    `cpu_fp32_tol` where it computes in fp32 on the CPU (the same arithmetic as the reference up to summation
    order), else its compute dtype's half-precision bound (a GPU, or a half-precision config.dtype)."""
    device = model.modules[model.head_layer_idx].device
    dtype = model.config.compute_dtype(device)
    if torch.device(device).type == "cpu" and dtype == torch.float32:
        return cpu_fp32_tol
    return max(cpu_fp32_tol, HALF_PRECISION_TOL[dtype])


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (vocab 320, 2 layers, fp32) written once per session; copy it before damaging it."""
    from tests.hf_models import make_hf_model

    d = tmp_path_factory.mktemp("tiny_llama") / "m"
    make_hf_model(d, "llama")
    return d


ROOT = Path(__file__).resolve().parents[1]
_INTERPRET_AT_START = os.environ.get("TRITON_INTERPRET")


def child_env(drop: tuple[str, ...] = (), **extra: str) -> dict[str, str]:
    """os.environ for a child Python process, with this checkout first on PYTHONPATH as an absolute path: the
    child imports this exlpy whatever its cwd, also when the suite runs from a checkout that is not installed
    (PYTHONPATH=. is relative to the child's cwd). Entries already on PYTHONPATH stay after it; `drop` removes
    variables, `extra` sets them."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *rest])
    env.update(extra)
    return env


def _interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter turns a scalar tensor into a Python int (a `range` bound, an index) with
    `int(data)` of its 1-element array, which NumPy >= 2.4 refuses ("only 0-dimensional arrays can be converted
    to Python scalars"): every kernel loop with a run-time bound fails there, while compiled kernels are fine.
    Later Triton (3.9) squeezes the array first; do the same on the interpreters that do not. Test-only: exlpy
    runs Triton kernels on CUDA tensors only, the interpreter is how this suite runs them on the CPU."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "exlpy_squeezes", False):
        return

    def patch_lang_tensor(tensor: type, *scope: Any) -> None:  # Triton 3.6 passes a patch scope; older ones may not
        patch(tensor, *scope)
        index = lambda self: int(self.handle.data.squeeze())  # noqa: E731
        if scope:
            scope[0].set_attr(tensor, "__index__", index)
        else:
            tensor.__index__ = index  # type: ignore[attr-defined]

    patch_lang_tensor.exlpy_squeezes = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor


if _INTERPRET_AT_START == "1":
    _interpreter_scalar_index()


def pytest_collection_finish(session: pytest.Session) -> None:
    if os.environ.get("TRITON_INTERPRET") != _INTERPRET_AT_START:
        raise pytest.UsageError("a test module changed TRITON_INTERPRET while being collected, which breaks the "
                                "compiled kernels of this session: mark its tests `interpreter` instead")


class InterpreterRun(pytest.Item):
    """The session's interpreter tests, run in a child pytest with TRITON_INTERPRET=1."""

    def __init__(self, *, nodeids: list[str], **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.nodeids = nodeids
        self.output = ""
        self.proc: subprocess.Popen[str] | None = None
        self.logs: tuple[Any, Any] | None = None
        if self.config.pluginmanager.hasplugin("timeout"):
            # one item for hundreds of tests: a per-test --timeout (the GPU runs' 150 s) would kill the child
            self.add_marker(pytest.mark.timeout(1200))

    def start(self, beside_session: bool = False) -> None:
        """Start the child (once). Its output goes to files, not pipes: nobody reads it before it ends.
        `beside_session`: it shares the machine with the session's own tests, so its BLAS / OpenMP pools take one
        thread each unless the environment says otherwise (the interpreter's work is single-threaded anyway)."""
        if self.proc is not None:
            return
        threads = {v: "1" for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
                   if beside_session and v not in os.environ}
        env = child_env(TRITON_INTERPRET="1", **threads)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::UserWarning",
               *self.nodeids]
        self.logs = (tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+"))
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.logs[0], stderr=self.logs[1], text=True)

    def stop(self) -> None:
        """End a child still running (the session stopped early: -x, Ctrl-C) and close its logs."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.logs is not None:
            for f in self.logs:
                f.close()
            self.logs = None

    def runtest(self) -> None:
        self.start()
        assert self.proc is not None and self.logs is not None
        rc = self.proc.wait()
        for f in self.logs:
            f.seek(0)
        stdout, stderr = (f.read() for f in self.logs)
        self.output = stdout[-12000:] + stderr[-3000:]
        summary = next((ln for ln in reversed(stdout.splitlines()) if ln.strip()), "")
        self.add_report_section("call", "child pytest", f"{len(self.nodeids)} interpreter tests: {summary}")
        if rc != 0:
            raise InterpreterFailure(f"{len(self.nodeids)} interpreter tests run under TRITON_INTERPRET=1 in a "
                                     f"child pytest (rc {rc}): {summary}")

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: object = None) -> str:
        if isinstance(excinfo.value, InterpreterFailure):
            return f"{excinfo.value}\n--- child output (tail) ---\n{self.output}"
        return super().repr_failure(excinfo)  # type: ignore[arg-type]

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return ROOT / "tests" / "conftest.py", None, f"{self.name}: {len(self.nodeids)} tests in a child"


class InterpreterFailure(Exception):
    pass


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: the child runs exactly what this session selected
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    interp = [i for i in items if i.get_closest_marker("interpreter") is not None]
    if interp:
        items[:] = [i for i in items if i.get_closest_marker("interpreter") is None]
        nodeids = [i.nodeid for i in interp]
        if "PYTEST_XDIST_WORKER" in os.environ:
            # Under xdist a child runs when its item's turn comes, and one child of every interpreter test was the
            # session's tail (393 s of 502 on an H100 box, 14 workers). So: several children, each a round-robin share
            # (every worker collects the same items, as xdist requires), queued first so that they overlap the other
            # workers' tests.
            shards = max(1, min(len(nodeids), int(os.environ.get("EXLPY_TEST_INTERPRETER_SHARDS", "4"))))
            items[:0] = [InterpreterRun.from_parent(session, name=f"triton-interpreter-{k}", nodeids=nodeids[k::shards])
                         for k in range(shards)]
        else:  # alone, the child started with the loop (pytest_runtestloop); its item, last, only waits for it
            items.append(InterpreterRun.from_parent(session, name="triton-interpreter", nodeids=nodeids))
    # The MoE modules' GPU tests build Mixtral-shaped stacks and compile their kernels per process: spread over
    # many xdist workers they all did it at once and stalled past a 300 s timeout (H100 x2, 28 workers,
    # 2026-11-26). With --dist loadgroup (benchmarks/gpu_tests.sh) each module's share one worker (one worker for
    # all of them was the session's tail: ~550 s of tests, 2026-11-27).
    for i in items:
        if i.get_closest_marker("gpu") is not None and i.path.name.startswith("test_moe"):
            i.add_marker(pytest.mark.xdist_group(f"moe_gpu_{i.path.stem}"))
    if "PYTEST_XDIST_WORKER" in os.environ:
        # The sm_90 compile checks (a child compiling dozens of kernel variants, CPU-bound) come next in the queue,
        # with room to finish: started late beside 27 busy workers, the MoE one ran past 280 s (H100 x2,
        # 2026-11-27). Their child processes have timeouts of their own.
        compiles = [i for i in items if i.get_closest_marker("slow") is not None and "compile" in i.name]
        rest = [i for i in items if i not in compiles]
        lead = [i for i in rest if isinstance(i, InterpreterRun)]
        items[:] = lead + compiles + [i for i in rest if not isinstance(i, InterpreterRun)]
        if config.pluginmanager.hasplugin("timeout"):
            for i in compiles:
                i.add_marker(pytest.mark.timeout(900))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtestloop(session: pytest.Session) -> Any:
    """Start the interpreter child as the session's tests start (see the module docstring), and end it with the
    loop whatever happened."""
    runs = [i for i in session.items if isinstance(i, InterpreterRun)]
    if (len(runs) == 1 and not session.config.option.collectonly and "PYTEST_XDIST_WORKER" not in os.environ
            and os.environ.get("EXLPY_TEST_INTERPRETER_OVERLAP", "1") != "0"):
        runs[0].start(beside_session=True)
    try:
        yield
    finally:
        for run in runs:
            run.stop()


def run_compile_check(script: str) -> dict[str, dict[str, Any]]:
    """Run benchmarks/SCRIPT --json in a child process (this suite runs under TRITON_INTERPRET=1, where kernels
    cannot be compiled) and return its per-kernel figures; skips where Triton cannot compile for CUDA."""
    import json

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "benchmarks" / script), "--json"], capture_output=True, text=True,
                       env=child_env(drop=("TRITON_INTERPRET",)), timeout=600, cwd=root)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("JSON ")]
    if not lines and "ptxas" in r.stderr.lower():
        pytest.skip(f"triton cannot compile for CUDA here: {r.stderr[-300:]}")
    assert lines, r.stderr[-3000:]
    return json.loads(lines[0][5:])
