"""EXL2 conversion of architectures beyond Llama (CPU): Phi-3, whose q|k|v and gate|up are fused in the
checkpoint and written as separate quantized projections, loads back exactly as the quantizer produced it and
stays close to the source; GPT-2 (transposed, fused, non-gated); Cohere's parallel blocks are refused by name."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from exlpy import ExLlamaV2, ExLlamaV2Config
from exlpy.convert import convert
from exlpy.convert import quantize as quantize_mod
from exlpy.errors import UnsupportedArchitectureError
from exlpy.quant.exl2_ref import dequant_dense
from tests.arch_models import VOCAB, make_arch_model
from tests.convert_util import kl, logits

CAL = dict(rows=4, length=64, measurement_rows=2, measurement_length=64, progress=False)


def _cal_file(path: Path) -> str:
    """Pre-tokenized calibration rows (the tiny models have no tokenizer)."""
    g = torch.Generator().manual_seed(5)
    rows = [json.dumps({"input_ids": torch.randint(2, VOCAB, (64,), generator=g).tolist()}) for _ in range(8)]
    path.write_text("\n".join(rows))
    return str(path)


def test_phi3_converts_loads_and_matches_its_quantized_matrices(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "src"
    make_arch_model(src, "phi3_partial")
    intended: dict[str, list[torch.Tensor]] = {}
    real_pack = quantize_mod.pack_exl2

    def spy(res, prefix, bias=None):  # noqa: ANN001, ANN202
        intended.setdefault(prefix, []).append(res.dense().cpu())
        return real_pack(res, prefix, bias)

    monkeypatch.setattr(quantize_mod, "pack_exl2", spy)
    out = tmp_path / "q"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        convert(str(src), str(tmp_path / "w"), str(out), bits=6.0, cal_dataset=_cal_file(tmp_path / "c.jsonl"),
                **CAL)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Phi3ForCausalLM"]
    model = ExLlamaV2(ExLlamaV2Config(str(out)))
    model.load(device="cpu")
    seen = 0
    for m in model.modules:
        for attr in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "linear"):
            lin = getattr(m, attr, None)
            if lin is None or not hasattr(lin, "qm"):
                continue
            prefix = f"{m.key}.{attr}" if attr != "linear" else "lm_head"
            assert torch.equal(dequant_dense(lin.qm), torch.cat(intended[prefix], dim=1)), prefix
            seen += 1
    assert seen == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the head: the fused tensors split
    ids = torch.randint(2, VOCAB, (1, 48), generator=torch.Generator().manual_seed(3))
    assert kl(logits(str(src), ids), logits(str(out), ids)) < 2e-3


def test_gpt2_converts_transposed_fused_and_non_gated(tmp_path: Path) -> None:
    """GPT-2: Conv1D weights stored [in, out], q|k|v fused in c_attn with biases, a non-gated MLP (no gate),
    learned positions: each projection quantized under its canonical name, biases beside it."""
    src = tmp_path / "src"
    make_arch_model(src, "gpt2")
    out = tmp_path / "q"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        convert(str(src), str(tmp_path / "w"), str(out), bits=6.0, cal_dataset=_cal_file(tmp_path / "c.jsonl"),
                **CAL)
    from exlpy.weights.safetensors_index import SafetensorsIndex

    idx = SafetensorsIndex(str(out))
    for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.up_proj",
              "mlp.down_proj"):
        assert f"model.layers.1.{p}.q_weight" in idx and f"model.layers.1.{p}.bias" in idx, p
    assert not any("gate_proj" in n or "c_attn" in n for n in idx.tensors)
    assert "model.wpe.weight" in idx
    ids = torch.randint(2, VOCAB, (1, 48), generator=torch.Generator().manual_seed(3))
    assert kl(logits(str(src), ids), logits(str(out), ids)) < 2e-3


@pytest.mark.parametrize("case", ["cohere"])
def test_unconverted_architectures_are_refused_by_name(tmp_path: Path, case: str) -> None:
    make_arch_model(tmp_path / "src", case)
    with pytest.raises(UnsupportedArchitectureError, match="not supported yet"):
        convert(str(tmp_path / "src"), str(tmp_path / "w"), str(tmp_path / "q"), bits=4.0,
                cal_dataset=_cal_file(tmp_path / "c.jsonl"), **CAL)
