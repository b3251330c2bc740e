"""`exlpy convert` on mixture-of-experts models (CPU): tiny random Mixtral and Qwen3-MoE (with a dense layer)
written by transformers. Every expert is quantized (its own Hessian from the tokens routed to it), the router
stays fp16, the output loads as EXL2 expert stacks exactly as the quantizer made them, and the logits stay
within the dense conversions' bounds of transformers' fp32 logits. Layouts the converter cannot read are refused
by name."""

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
from exlpy.model.moe import MoEMLP
from tests.arch_models import VOCAB, make_arch_model
from tests.convert_util import kl

# act order "on": one GPTQ pass per expert in the quantize stage ("auto", tried on dense models, runs two)
CAL = dict(rows=4, length=64, measurement_rows=2, measurement_length=64, progress=False, act_order="on")


def _cal_file(path: Path) -> str:
    g = torch.Generator().manual_seed(5)
    rows = [json.dumps({"input_ids": torch.randint(2, VOCAB, (64,), generator=g).tolist()}) for _ in range(8)]
    path.write_text("\n".join(rows))
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe"])
def test_moe_model_converts_loads_and_matches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    src = tmp_path / "src"
    ref = make_arch_model(src, case)
    intended: dict[str, torch.Tensor] = {}
    real_pack = quantize_mod.pack_exl2

    def spy(res, prefix, bias=None):  # noqa: ANN001, ANN202
        intended[prefix] = res.dense().cpu()
        return real_pack(res, prefix, bias)

    monkeypatch.setattr(quantize_mod, "pack_exl2", spy)
    out = tmp_path / "q"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = convert(str(src), str(tmp_path / "w"), str(out), bits=6.0,
                         cal_dataset=_cal_file(tmp_path / "c.jsonl"), **CAL)
    assert 5.5 < result["bpw"]["decoder"] <= 6.01, result["bpw"]
    assert result["mean_layer_error"] < 0.05
    assert result["min_expert_tokens"] is not None and result["min_expert_tokens"] >= 0
    job = json.loads((tmp_path / "w" / "job.json").read_text())
    for key, entries in job["measurement"].items():  # each MoE entry reports the tokens each expert got
        if ".mlp" in key and "expert_tokens" in entries[0]:
            assert len(entries[0]["expert_tokens"]) == 4 and sum(entries[0]["expert_tokens"]) == 2 * 2 * 64
    idx = ExLlamaV2Config(str(out)).index  # canonical names, read through the architecture's renames
    # the source's own names (exllamav2 loads them), the router stored in fp16 (not quantized)
    names = {i.name for i in idx.tensors.values()}
    want = ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.3.w2.q_weight") if case == "mixtral" else \
        ("mlp.gate.weight", "mlp.experts.3.down_proj.q_weight")
    assert all(f"model.layers.0.{n}" in names for n in want), sorted(names)[:20]
    assert idx.info("model.layers.0.mlp.router.weight").dtype == "F16"
    model = ExLlamaV2(ExLlamaV2Config(str(out)))
    model.load(device="cpu")
    blocks = [m for m in model.modules if isinstance(m, MoEMLP)]
    assert blocks and all(b.packed is not None and b.graph_safe for b in blocks)
    for b in blocks:  # every expert decodes from its stack exactly as the quantizer made it
        for stack, proj in zip(b.packed, ("gate_proj", "up_proj", "down_proj")):
            for e in range(stack.num_experts):
                assert torch.equal(stack.dequant(e), intended[f"{b.key}.experts.{e}.{proj}"]), (b.key, e, proj)
    ids = torch.randint(2, VOCAB, (1, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hf = ref(ids).logits.float()
    q = model.forward(ids).float()
    err = float((q - hf).norm() / hf.norm())
    print(f"{case}: decoder {result['bpw']['decoder']:.2f} bpw, layer error {result['mean_layer_error']:.4f}, "
          f"KL {kl(hf, q):.2e}, relative logit error {err:.3f}, min expert tokens {result['min_expert_tokens']}")
    assert kl(hf, q) < 2e-3
    assert err < 0.15
    src_index = ExLlamaV2Config(str(src)).index
    for prefix, w in intended.items():  # and stays near its source weight (a broken expert is order 1 off)
        if ".experts." in prefix:
            src_w = src_index.get(f"{prefix}.weight").float().t()
            assert float((w - src_w).norm() / src_w.norm()) < 0.5, prefix


def test_dbrx_fused_experts_refused_by_name(tmp_path: Path) -> None:
    make_arch_model(tmp_path / "src", "dbrx")
    with pytest.raises(UnsupportedArchitectureError, match="DbrxForCausalLM.*fused"):
        convert(str(tmp_path / "src"), str(tmp_path / "w"), progress=False)


def test_qwen2_moe_refused_by_name(tmp_path: Path) -> None:
    """Qwen2-MoE (shared experts beside the routed ones) is not an architecture exlpy runs: a typed refusal naming
    it, before any work."""
    src = tmp_path / "src"
    make_arch_model(src, "qwen3_moe")
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", shared_expert_intermediate_size=64)
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="Qwen2MoeForCausalLM"):
        convert(str(src), str(tmp_path / "w"), progress=False)
