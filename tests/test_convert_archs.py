"""EXL2 conversion of architectures beyond Llama (CPU): Phi-3, whose q|k|v and gate|up are fused in the
checkpoint and written as separate quantized projections, loads back exactly as the quantizer produced it and
stays close to the source; GPT-2 (transposed, fused, non-gated); Cohere / Cohere 2 (parallel blocks, tied head,
logit scale)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from exlpy import ExLlamaV2, ExLlamaV2Config
from exlpy.convert import convert
from exlpy.convert import quantize as quantize_mod
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


@pytest.mark.parametrize("case", ["cohere", "cohere_qk_norm", "cohere2"])
def test_cohere_converts_and_matches_the_fp32_source(tmp_path: Path, case: str) -> None:
    """Command-R / Command-R7B: parallel attention + MLP on one LayerNorm (weight only), GPT-J RoPE, optional
    q/k norms, alternating sliding windows (Cohere 2), logit scale and a tied head. The converted model's logits
    stay within the converter tests' KL bound of transformers' fp32 logits."""
    src = tmp_path / "src"
    ref = make_arch_model(src, case)
    out = tmp_path / "q"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = convert(str(src), str(tmp_path / "w"), str(out), bits=6.0,
                         cal_dataset=_cal_file(tmp_path / "c.jsonl"), **CAL)
    from exlpy.weights.safetensors_index import SafetensorsIndex

    idx = SafetensorsIndex(str(out))
    for p in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
        assert f"model.layers.1.{p}.q_weight" in idx, p
    assert "lm_head.q_weight" in idx and "model.embed_tokens.weight" in idx  # tied: the fp16 table stays
    assert result["mean_layer_error"] < 0.05
    ids = torch.randint(2, VOCAB, (1, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hf = ref(ids).logits.float()
    q = logits(str(out), ids)
    assert kl(hf, q) < 2e-3
    assert float((q - hf).norm() / hf.norm()) < 0.15  # 6 bits: 3-8% measured; a broken block is order 1
    assert kl(hf, logits(str(src), ids)) < 1e-5  # the unquantized load: what the quantized one is measured from


def test_parallel_block_calibration_forward_matches_the_model(tmp_path: Path) -> None:
    """The converter runs the attention and the MLP of a parallel block as separate modules over chunks of
    rows; the MLP must read the attention's normed input (States.side), so chaining the modules chunk by chunk
    reproduces the model's own forward exactly."""
    from exlpy.convert.forward import States, forward_chunks, run_chunk

    make_arch_model(tmp_path / "src", "cohere")
    model = ExLlamaV2(ExLlamaV2Config(str(tmp_path / "src")))
    model.load(device="cpu")
    cpu = torch.device("cpu")
    ids = torch.randint(2, VOCAB, (4, 24), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = model.forward(ids).float()
        states = States([run_chunk(model.modules[0], States([ids[:2]]), 0, cpu),
                         run_chunk(model.modules[0], States([ids[2:]]), 0, cpu)])
        for m in model.modules[1:-2]:
            nxt = forward_chunks(m, states, cpu, cpu, m.key)
            assert nxt is not None and (nxt.side is not None) == (m.key.endswith("self_attn"))
            states = nxt
        got = torch.cat([run_chunk(model.modules[-1], States([run_chunk(model.modules[-2], states, i, cpu)]), 0,
                                   cpu) for i in range(2)]).float()
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    back = States.from_dict(nxt.to_dict(), cpu)
    assert back.side is None and len(back.chunks) == 2


# Every dense case of tests/test_architectures.py the tests above do not convert: the calibration forward runs
# each with its own RoPE (Phi-3's longrope) and windows. The MoE cases are refused by name (tests/test_moe.py).
# Gemma 2 at 8 bits: its test model's weights are ten times the usual init (so that the soft-caps act), which
# makes its logits large and sensitive: at 6 bits its weights err as much as the others' (3-5%) but its KL is
# 2.6e-3; 4, 6, 8 bits give relative logit errors 0.23, 0.064, 0.020, the 3.5x per 2 bits of a sound conversion.
CONVERT_CASES = {"gemma": 6.0, "gemma2": 8.0, "granite": 6.0, "starcoder2": 6.0, "gpt_bigcode": 6.0, "glm4": 6.0,
                 "phi3": 6.0, "phi3_longrope": 6.0, "phi3_window": 6.0, "yi": 6.0, "internlm2": 6.0, "index": 6.0,
                 "minicpm": 6.0, "orion": 6.0}


def _quantized_linears(model: ExLlamaV2) -> dict[str, object]:
    """Every EXL2 linear of the loaded model by its tensor prefix."""
    from exlpy.convert.forward import LINEARS

    out = {}
    for m in model.modules:
        for attr in LINEARS.get(type(m), ()) + ("linear",):
            lin = getattr(m, attr, None)
            if lin is not None and hasattr(lin, "qm"):
                out[f"{m.key}.{attr}" if attr != "linear" else "lm_head"] = lin
    return out


@pytest.mark.parametrize("case", sorted(CONVERT_CASES))
def test_architecture_converts_loads_and_matches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 case: str) -> None:
    """`exlpy convert` on the CPU, for each architecture with its quirks (Gemma's +1 norms and embedding scale,
    Gemma 2's four norms and soft-caps, StarCoder2's LayerNorm and biased non-gated MLP, GPTBigCode's multi-query
    fused c_attn, Granite / MiniCPM multipliers, GLM-4's post-norms and fused gate|up, InternLM2's packed wqkv,
    Index's normalized head, Orion's LayerNorms, Phi-3's longrope): every quantized matrix loads exactly as the
    quantizer made it, the optimizer spends the bit budget (a quirk the calibration forward misses flattens the
    measured errors and the cheapest options win), and the logits stay within the bounds of the Cohere test of
    transformers' fp32 logits."""
    bits = CONVERT_CASES[case]
    src = tmp_path / "src"
    ref = make_arch_model(src, case)
    intended: dict[str, list[torch.Tensor]] = {}
    real_pack = quantize_mod.pack_exl2

    def spy(res, prefix, bias=None):  # noqa: ANN001, ANN202
        intended.setdefault(prefix, []).append(res.dense().cpu())
        return real_pack(res, prefix, bias)

    monkeypatch.setattr(quantize_mod, "pack_exl2", spy)
    out = tmp_path / "q"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # On the CPU as the docstring says, on a GPU machine too. The GPU path (fp16, the CUDA kernels' in-place
        # residual adds) of the post-norm models is tests/test_convert_gpu_path.py's.
        result = convert(str(src), str(tmp_path / "w"), str(out), bits=bits,
                         cal_dataset=_cal_file(tmp_path / "c.jsonl"), device="cpu", **CAL)
    assert bits - 0.5 < result["bpw"]["decoder"] <= bits + 0.01, result["bpw"]
    assert result["mean_layer_error"] < 0.05
    model = ExLlamaV2(ExLlamaV2Config(str(out)))
    model.load(device="cpu")
    loaded = _quantized_linears(model)
    assert sorted(loaded) == sorted(intended)  # every projection and the head, no fused leftover
    p = model.config.spec.features.residual_scale  # folded into o_proj's and down_proj's scales at load
    for prefix, lin in loaded.items():
        want = torch.cat(intended[prefix], dim=1)
        if prefix.endswith(("o_proj", "down_proj")) and p != 1.0:
            torch.testing.assert_close(dequant_dense(lin.qm), want * p, rtol=1e-6, atol=0, msg=prefix)
        else:
            assert torch.equal(dequant_dense(lin.qm), want), prefix
    ids = torch.randint(2, VOCAB, (1, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hf = ref(ids).logits.float()
    q = model.forward(ids).float()
    err = float((q - hf).norm() / hf.norm())
    print(f"{case}: {bits:g} bits, decoder {result['bpw']['decoder']:.2f} bpw, layer error "
          f"{result['mean_layer_error']:.4f}, KL {kl(hf, q):.2e}, relative logit error {err:.3f}")
    assert kl(hf, q) < 2e-3
    assert err < 0.15
    assert kl(hf, logits(str(src), ids)) < 1e-5
