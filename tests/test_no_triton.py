"""EXL2 and GPTQ models load and run on the CPU where Triton cannot be imported (torch's CPU wheel, installed
with plain `pip install -e .`). A child process blocks every `import triton`, loads both formats, checks the
logits against the references and that no kernel module was imported. (.ci/run also runs the EXL2/GPTQ test
files in a second environment where triton is not installed at all.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import child_env, shared_path

CHILD = r"""
import importlib.abc, json, sys

class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError("No module named 'triton' (blocked by the test)")
        return None

sys.meta_path.insert(0, NoTriton())
import torch
from safetensors import safe_open
from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config
from exlpy.quant.linear import QuantLinear

out = {}
for name, d in json.loads(sys.argv[1]).items():
    model = ExLlamaV2(ExLlamaV2Config(d))
    cache = ExLlamaV2Cache(model, lazy=True)
    model.load_autosplit(cache)
    assert isinstance(model.modules[1].q_proj, QuantLinear), type(model.modules[1].q_proj)
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(1))
    ref = None
    try:
        with safe_open(d + "/reference.safetensors", "pt") as f:
            ids, ref = f.get_tensor("input_ids"), f.get_tensor("logits")
    except FileNotFoundError:
        pass
    logits = model.forward(ids, cache)[0]
    err = None if ref is None else float((logits - ref).abs().max() / ref.abs().max())
    out[name] = {"finite": bool(torch.isfinite(logits).all()), "rel_err": err}
out["kernel_modules"] = sorted(m for m in sys.modules if m.startswith("triton") or m.startswith("exlpy.kernels.")
                               and m != "exlpy.kernels.ops" and not m.startswith("exlpy.kernels.reference"))
print("RESULT " + json.dumps(out))
"""


def test_exl2_and_gptq_run_without_triton(tmp_path: Path) -> None:
    from tests.test_gptq import _write_models

    gptq_dir, _ = _write_models(tmp_path, v2=False)
    dirs = {"exl2": str(shared_path("models", "tiny-llama-exl2-4.0")), "gptq": str(gptq_dir)}
    # CUDA_VISIBLE_DEVICES="": a CPU-only machine, also when the suite runs on a GPU one
    env = child_env(drop=("TRITON_INTERPRET",), CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(dirs)], capture_output=True, text=True, env=env,
                       timeout=600, cwd=Path(__file__).resolve().parents[1])
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    out = json.loads(lines[0][7:])
    assert out["kernel_modules"] == []  # nothing that imports triton was even attempted
    assert out["exl2"]["finite"] and out["exl2"]["rel_err"] <= 1e-3  # the EXL2 reference logits
    assert out["gptq"]["finite"]


def test_triton_is_optional_in_the_package_metadata() -> None:
    """`pip install -e .` must not pull triton: it is an extra, not a dependency."""
    tomllib = pytest.importorskip("tomllib")

    meta = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert not any(d.split(">")[0].split("=")[0].strip() == "triton" for d in meta["project"]["dependencies"])
    assert any(d.startswith("triton") for d in meta["project"]["optional-dependencies"]["triton"])
