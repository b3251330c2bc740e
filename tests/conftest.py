"""Shared fixtures. Tests that need ../shared skip outside CI when it is absent; in CI they must not skip."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

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
    """max |a - b| relative to max |b|."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (vocab 320, 2 layers, fp32) written once per session; copy it before damaging it."""
    from tests.hf_models import make_hf_model

    d = tmp_path_factory.mktemp("tiny_llama") / "m"
    make_hf_model(d, "llama")
    return d
