"""GPTQ: packer round trips (v1/v2 zeros, with/without g_idx), bad input, and a tiny GPTQ model end to end."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config
from exlpy.errors import QuantFormatError
from exlpy.quant.gptq import GPTQLinear
from exlpy.quant.gptq_ref import build_gptq_matrix, gptq_dequant_ref
from exlpy.quant.pack import quantize_gptq
from tests.conftest import logits_tol, rel_err, shared_path

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("v2", [False, True])
def test_pack_round_trip(act_order: bool, v2: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(256, 64, generator=gen) * 0.05
    t, dq = quantize_gptq(w, 32, gen, act_order, v2)
    assert ("g_idx" in t) == act_order
    qm = build_gptq_matrix(t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"), 256, 64, "p", v2)
    assert torch.equal(gptq_dequant_ref(qm), dq)
    assert (dq - w).abs().max() < 0.1 * w.abs().max()  # a real (if coarse, 4-bit RTN) quantization of w
    if act_order:
        assert qm.perm is not None
    # the wrong zero convention is detected as a different matrix
    other = build_gptq_matrix(t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"), 256, 64, "p", not v2)
    assert not torch.equal(gptq_dequant_ref(other), dq)


@pytest.mark.parametrize("rows", [16, 24, 64])  # 2-, 3- and 8-bit packings of K = 64
def test_unsupported_bits(rows: int) -> None:
    qw = torch.zeros(rows, 32, dtype=torch.int32)
    with pytest.raises(QuantFormatError, match=r"only 4-bit GPTQ.*layer\.qweight"):
        build_gptq_matrix(qw, torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, 32).half(), None, 64, 32,
                          "layer")


def test_bad_gidx_and_shapes() -> None:
    gen = torch.Generator().manual_seed(4)
    t, _ = quantize_gptq(torch.randn(64, 32, generator=gen), 32, gen, True)
    bad = t["g_idx"].clone()
    bad[0] = 9
    with pytest.raises(QuantFormatError, match=r"L\.g_idx"):
        build_gptq_matrix(t["qweight"], t["qzeros"], t["scales"], bad, 64, 32, "L")
    with pytest.raises(QuantFormatError, match=r"L\.qzeros"):
        build_gptq_matrix(t["qweight"], t["qzeros"][:, :2], t["scales"], None, 64, 32, "L")


def _write_models(tmp: Path, v2: bool) -> tuple[Path, Path]:
    """A GPTQ model quantized from tiny-llama-fp16 by round-to-nearest, and its dequantized dense twin."""
    src = shared_path("models", "tiny-llama-fp16")
    gen = torch.Generator().manual_seed(5)
    qdir, ddir = tmp / "gptq", tmp / "dense"
    qt: dict[str, torch.Tensor] = {}
    dt: dict[str, torch.Tensor] = {}
    with safe_open(str(next(src.glob("*.safetensors"))), "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            prefix = name.removesuffix(".weight")
            if name.endswith(".weight") and prefix.split(".", 3)[-1] in LINEARS:
                layer = int(name.split(".")[2])
                packed, dq = quantize_gptq(t.float().T, 64, gen, act_order=layer == 1, v2=v2)
                qt.update({f"{prefix}.{k}": v for k, v in packed.items()})
                dt[name] = dq.T.contiguous()  # fp32: the exact dequantized weight
            else:
                qt[name] = dt[name] = t
    for d, tensors in ((qdir, qt), (ddir, dt)):
        d.mkdir()
        save_file(tensors, str(d / "model.safetensors"))
        for extra in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(src / extra, d / extra)
        cfg = json.loads((src / "config.json").read_text())
        if d == qdir:
            cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 64,
                                          **({"checkpoint_format": "gptq_v2"} if v2 else {})}
        (d / "config.json").write_text(json.dumps(cfg))
    return qdir, ddir


@pytest.mark.parametrize("v2", [False, True])
def test_tiny_gptq_model(tmp_path: Path, v2: bool) -> None:
    qdir, ddir = _write_models(tmp_path, v2)
    logits = []
    for d in (qdir, ddir):
        model = ExLlamaV2(ExLlamaV2Config(str(d)))
        model.load_autosplit(ExLlamaV2Cache(model, lazy=True))
        ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(6))
        logits.append(model.forward(ids))
        if d == qdir:
            assert isinstance(model.modules[1].q_proj, GPTQLinear)
    assert rel_err(logits[0], logits[1]) < logits_tol(model, 1e-4)  # half precision on a GPU: different kernels
