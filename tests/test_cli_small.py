"""Small things a new user meets first: `exlpy --version`, one-line warnings, EXLPY_NO_CPU_WARNING=1, and
`exlpy plan` on a machine without a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from exlpy.version import __version__
from tests.conftest import child_env, shared_path

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU messages need a machine without CUDA")
LOAD = ("from exlpy import ExLlamaV2, ExLlamaV2Config; "
        f"m = ExLlamaV2(ExLlamaV2Config({str(shared_path('models', 'aidreams260K'))!r})); m.load()")


def run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], env=child_env(drop=("EXLPY_NO_CPU_WARNING",), **env),
                          capture_output=True, text=True, timeout=300)


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from exlpy.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"exlpy {__version__}"


@NO_GPU
def test_warnings_are_one_line_and_the_cpu_switch_silences_them() -> None:
    res = run(LOAD + "; import warnings; warnings.warn('not ours')")
    lines = res.stderr.splitlines()
    ours = [ln for ln in lines if ln.startswith("exlpy: warning: ")]
    assert len(ours) == 2, res.stderr  # torch without CUDA; a model placed on the CPU
    assert not any("warnings.warn" in ln or "env.py" in ln or "placement.py" in ln for ln in lines), res.stderr
    assert any(ln.endswith("UserWarning: not ours") for ln in lines)  # other warnings keep Python's format
    quiet = run(LOAD, EXLPY_NO_CPU_WARNING="1")
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr


@NO_GPU
def test_plan_without_a_gpu_points_at_devices(capsys: pytest.CaptureFixture[str]) -> None:
    from exlpy.cli.main import main

    assert main(["plan", "--model", str(shared_path("models", "smollm2-135m-exl2-4.0"))]) == 1
    assert "--devices 24000,24000" in capsys.readouterr().err
