"""LoRA logits against HF transformers + PEFT (fp32 on CPU): fp16 weights and an EXL2 base, ranks 8 and 64,
rsLoRA and per-module rank/alpha patterns; a batch mixing two adapters and none equals each row alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Lora
from exlpy.lora import registry_of
from exlpy.model.batch import cache_rows_batch
from tests.conftest import rel_err, shared_path
from tests.hf_models import make_hf_model
from tests.lora_util import peft_adapter

pytest.importorskip("peft")
TOL = 1e-4


def _exlpy(path: Path) -> ExLlamaV2:
    model = ExLlamaV2(ExLlamaV2Config(str(path)))
    model.load(device="cpu")
    return model


def _peft_logits(pm: object, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out = pm(ids).logits.float()  # type: ignore[operator]
        with pm.disable_adapter():  # type: ignore[attr-defined]
            base = pm(ids).logits.float()  # type: ignore[operator]
    return out, base


@pytest.fixture(scope="module")
def fp16_case(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny fp16 Llama (GQA), and PEFT adapters of rank 8 (all seven projections) and rank 64 (rsLoRA, a
    subset of projections, per-module rank and alpha patterns)."""
    root = tmp_path_factory.mktemp("lora_fp16")
    ids = torch.randint(3, 320, (2, 11), generator=torch.Generator().manual_seed(0))
    out = {"model_dir": root / "model", "ids": ids}
    specs = {"r8": dict(r=8, alpha=16, seed=1),
             "r64": dict(r=64, alpha=32, seed=2, targets=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
                         use_rslora=True, rank_pattern={"o_proj": 16}, alpha_pattern={"layers.1.mlp.up_proj": 4})}
    for name, spec in specs.items():
        hf = make_hf_model(out["model_dir"], "llama", dtype=torch.float16)  # fp16 weights; HF runs them in fp32
        pm = peft_adapter(hf, root / name, **spec)  # type: ignore[arg-type]
        out[name] = _peft_logits(pm, ids)
    # Both adapters active at once (PEFT sums their outputs), read back from the saved directories.
    import peft
    import transformers as tf

    hf = tf.LlamaForCausalLM.from_pretrained(str(out["model_dir"]), torch_dtype=torch.float32).eval()
    pm = peft.PeftModel.from_pretrained(hf, str(root / "r8"), adapter_name="a")
    pm.load_adapter(str(root / "r64"), adapter_name="b")
    pm.base_model.set_adapter(["a", "b"])
    out["both"] = _peft_logits(pm, ids)
    return out


@pytest.mark.parametrize("name", ["r8", "r64"])
def test_fp16_weights_equal_peft(fp16_case: dict, name: str, tmp_path: Path) -> None:
    model = _exlpy(fp16_case["model_dir"])
    lora = ExLlamaV2Lora.from_directory(model, str(fp16_case["model_dir"].parent / name))
    ref, base = fp16_case[name]
    ids = fp16_case["ids"]
    assert rel_err(ref, base) > 0.05  # the adapter matters
    assert rel_err(model.forward(ids, loras=[lora]), ref) <= TOL
    assert rel_err(model.forward(ids), base) <= TOL  # and is not applied when not asked for
    cache = ExLlamaV2Cache(model, batch_size=2, max_seq_len=32)  # prefill then decode through the cache
    chunks = [model.forward(ids[:, :6], cache, loras=[lora])]
    chunks += [model.forward(ids[:, t:t + 1], cache, loras=lora) for t in range(6, 11)]
    assert rel_err(torch.cat(chunks, 1), ref) <= TOL
    if name == "r64":
        assert lora.rank("model.layers.0.self_attn.o_proj") == 16 and lora.target_modules[0] == "q_proj"


def test_scaling_zero_and_combination(fp16_case: dict) -> None:
    model = _exlpy(fp16_case["model_dir"])
    ids = fp16_case["ids"]
    d = fp16_case["model_dir"].parent
    off = ExLlamaV2Lora.from_directory(model, str(d / "r8"), lora_scaling=0.0)
    assert rel_err(model.forward(ids, loras=[off]), fp16_case["r8"][1]) <= TOL
    r8 = ExLlamaV2Lora.from_directory(model, str(d / "r8"))
    r64 = ExLlamaV2Lora.from_directory(model, str(d / "r64"))
    # Two adapters applied together (one slot holding both, ranks concatenated) = PEFT with both active.
    assert rel_err(model.forward(ids, loras=[r8, r64]), fp16_case["both"][0]) <= TOL
    a = model.forward(ids, loras=[r8])
    double = ExLlamaV2Lora.from_directory(model, str(d / "r8"), lora_scaling=2.0)
    stacked = model.forward(ids, loras=[r8, ExLlamaV2Lora.from_directory(model, str(d / "r8"))])
    assert rel_err(stacked, model.forward(ids, loras=[double])) <= TOL
    assert rel_err(model.forward(ids, loras=[r8, r8]), a) <= TOL  # a list naming one adapter twice: once


def test_mixed_batch_equals_rows_alone(fp16_case: dict) -> None:
    """One step over rows with adapter A, adapter B and none (the dynamic generator's situation)."""
    model = _exlpy(fp16_case["model_dir"])
    d = fp16_case["model_dir"].parent
    a = ExLlamaV2Lora.from_directory(model, str(d / "r8"))
    b = ExLlamaV2Lora.from_directory(model, str(d / "r64"))
    reg = registry_of(model)
    slots = [reg.acquire([a]), reg.acquire([b]), -1, reg.acquire([a])]
    ids = torch.randint(3, 320, (4, 9), generator=torch.Generator().manual_seed(5))
    cache = ExLlamaV2Cache(model, batch_size=4, max_seq_len=32)
    dev = torch.device("cpu")
    lens = [9, 6, 8, 3]  # ragged rows, prefilled one by one, then decoded together
    for r in range(4):
        batch = cache_rows_batch(cache, [r], [0], lens[r], dev, adapters=[slots[r]])
        model.forward_batch(ids[r:r + 1, :lens[r]], batch, preprocess_only=True)
    nxt = torch.randint(3, 320, (4, 1), generator=torch.Generator().manual_seed(6))
    mixed = model.forward_batch(nxt, cache_rows_batch(cache, [0, 1, 2, 3], lens, 1, dev, adapters=slots))
    for r, loras in enumerate([[a], [b], None, [a]]):
        alone = model.forward(torch.cat([ids[r:r + 1, :lens[r]], nxt[r:r + 1]], 1), loras=loras)[:, -1:]
        assert rel_err(mixed[r:r + 1], alone) <= TOL, r
    for s in slots:
        reg.release(s)


def _hf_from_exl2(model: ExLlamaV2, src: Path, dst: Path) -> object:
    """HF LlamaForCausalLM whose linears are exlpy's exact dequantization of the EXL2 weights (fp32)."""
    import transformers as tf
    from safetensors import safe_open

    from exlpy.quant.exl2_ref import dequant_dense

    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    hf = tf.LlamaForCausalLM(tf.LlamaConfig(**cfg)).eval()
    state = {}
    with safe_open(str(src / "output.safetensors"), "pt") as f:
        for n in f.keys():
            if n.endswith("norm.weight") or n == "model.embed_tokens.weight":
                state[n] = f.get_tensor(n).float()
    for m in model.modules[1:-2]:
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            lin = getattr(m, proj, None)
            if lin is not None:
                state[f"{m.key}.{proj}.weight"] = dequant_dense(lin.qm).t().contiguous()
    state["lm_head.weight"] = dequant_dense(model.modules[-1].linear.qm).t().contiguous()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return hf.float()


@pytest.mark.parametrize("r", [8, 64])
def test_exl2_base_equals_peft_on_dequantized(r: int, tmp_path: Path) -> None:
    src = shared_path("models", "tiny-llama-exl2-4.0")
    model = _exlpy(src)
    hf = _hf_from_exl2(model, src, tmp_path)
    pm = peft_adapter(hf, tmp_path / "ad", r=r, alpha=2 * r, seed=r, std=0.03)
    from safetensors import safe_open

    ref_ids = safe_open(str(src / "reference.safetensors"), "pt").get_tensor("input_ids")[:, :40]
    ref, base = _peft_logits(pm, ref_ids)
    lora = ExLlamaV2Lora.from_directory(model, str(tmp_path / "ad"))
    assert rel_err(model.forward(ref_ids), base) <= TOL
    assert rel_err(ref, base) > 0.05
    assert rel_err(model.forward(ref_ids, loras=[lora]), ref) <= TOL


def test_gptq_base_equals_its_dense_twin(tmp_path: Path) -> None:
    """A GPTQ model with an adapter equals its exactly dequantized fp32 twin with the same adapter (the twin's
    adapter path is the one checked against PEFT above)."""
    from tests.lora_util import write_adapter
    from tests.test_gptq import _write_models

    qdir, ddir = _write_models(tmp_path, v2=False)
    ad = write_adapter(tmp_path / "ad", ddir, r=8, seed=3, std=0.03)
    ids = torch.randint(3, 500, (2, 10), generator=torch.Generator().manual_seed(7))
    out = []
    for d in (qdir, ddir):
        model = _exlpy(d)
        out.append(model.forward(ids, loras=[ExLlamaV2Lora.from_directory(model, str(ad))]))
        base = model.forward(ids)
    assert rel_err(out[0], out[1]) <= TOL and rel_err(out[1], base) > 0.01


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qkv_bias_and_qk_norm_architectures_equal_peft(arch: str, tmp_path: Path) -> None:
    """Qwen2 (q/k/v biases) and Qwen3 (q/k RMSNorm after the adapted projections)."""
    hf = make_hf_model(tmp_path / "m", arch, dtype=torch.float16)
    pm = peft_adapter(hf, tmp_path / "ad", r=8, alpha=8, seed=4)
    ids = torch.randint(3, 320, (2, 9), generator=torch.Generator().manual_seed(8))
    ref, base = _peft_logits(pm, ids)
    model = _exlpy(tmp_path / "m")
    assert rel_err(ref, base) > 0.05
    assert rel_err(model.forward(ids, loras=[ExLlamaV2Lora.from_directory(model, str(tmp_path / "ad"))]), ref) <= TOL
