"""Every dense architecture beyond Llama against its fp32 reference: transformers' own model where it has
one, a reference written from the spec where it has none (tests/arch_models.py).

Full sequence, and incremental through a cache (a prefill chunk, a second chunk, then single tokens), with
sequences several times longer than the sliding windows of the models that have one."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch

from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config
from tests.arch_models import HF_CASES, SPEC_CASES, VOCAB, make_arch_model
from tests.conftest import logits_tol, rel_err

TOL = 1e-4  # fp32 on the same (fp16-rounded) weights as the reference; the issue asks for 2e-3
ARGMAX = 0.97
CASES = sorted(HF_CASES) + sorted(SPEC_CASES)


def _load(path: Path, max_seq_len: int = 128) -> tuple[ExLlamaV2, ExLlamaV2Cache]:
    config = ExLlamaV2Config(str(path))
    config.max_seq_len = max_seq_len
    model = ExLlamaV2(config)
    cache = ExLlamaV2Cache(model, lazy=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.load_autosplit(cache)
    return model, cache


def _check(out: torch.Tensor, ref: torch.Tensor, model: ExLlamaV2, ref_model: object, ids: torch.Tensor) -> None:
    assert out.shape == ref.shape
    err = rel_err(out, ref)
    agree = (out.argmax(-1).cpu() == ref.argmax(-1)).float().mean().item()
    tol = logits_tol(model, TOL)
    if tol > TOL:
        # Half precision (a GPU): allow twice transformers' own error in the same dtype (Gemma 2's soft-caps
        # and large test weights make some of these models more sensitive than a trained one).
        half = copy.deepcopy(ref_model).to(model.config.compute_dtype(model.modules[model.head_layer_idx].device))
        with torch.no_grad():
            tol = max(tol, 2 * rel_err(half(ids).logits, ref))  # type: ignore[operator]
    assert err <= tol, f"relative logit error {err:.2e}"
    assert agree >= ARGMAX, f"argmax agreement {agree:.3f}"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return {}


def _model(built: dict, tmp_path_factory: pytest.TempPathFactory, case: str):  # noqa: ANN202
    if case not in built:
        path = tmp_path_factory.mktemp(case)
        built[case] = (path, make_arch_model(path, case))
    return built[case]


@pytest.mark.parametrize("case", CASES)
def test_full_sequence_matches_reference(built: dict, tmp_path_factory: pytest.TempPathFactory, case: str) -> None:
    path, ref_model = _model(built, tmp_path_factory, case)
    ids = torch.randint(2, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = ref_model(ids).logits.float()
    model, _ = _load(path)
    _check(model.forward(ids), ref, model, ref_model, ids)


@pytest.mark.parametrize("case", CASES)
def test_incremental_matches_reference(built: dict, tmp_path_factory: pytest.TempPathFactory, case: str) -> None:
    path, ref_model = _model(built, tmp_path_factory, case)
    ids = torch.randint(2, VOCAB, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = ref_model(ids).logits.float()
    model, cache = _load(path)
    parts = [model.forward(ids[:, :13], cache), model.forward(ids[:, 13:30], cache)]
    parts += [model.forward(ids[:, i:i + 1], cache) for i in range(30, 40)]
    assert cache.current_seq_len == 40
    _check(torch.cat(parts, dim=1), ref, model, ref_model, ids)


def test_reference_applies_gemma2_attention_softcap(tmp_path: Path) -> None:
    """The reference itself honours Gemma 2's score soft-cap. transformers 5.17 runs Gemma 2 on SDPA, which
    drops it: the reference then lacked the cap and a correct exlpy failed against it (relative error 1.3).
    With the cap removed from the config the reference's logits must move by about that much."""
    ids = torch.randint(2, VOCAB, (1, 24), generator=torch.Generator().manual_seed(3))
    capped = make_arch_model(tmp_path / "capped", "gemma2")
    uncapped = make_arch_model(tmp_path / "uncapped", "gemma2", attn_logit_softcapping=None)
    with torch.no_grad():
        assert rel_err(capped(ids).logits, uncapped(ids).logits) > 0.1


@pytest.mark.parametrize("mode", ["row", "column"])
def test_glm4_tensor_parallel_equals_single(built: dict, tmp_path_factory: pytest.TempPathFactory,
                                            mode: str) -> None:
    """GLM-4 (exllamav2 marks it TP-capable): post-norms after the all-reduce, partial interleaved RoPE per
    shard, fused gate|up split by columns, on CPU "devices"."""
    from exlpy.runtime import RuntimeOptions

    path, _ = _model(built, tmp_path_factory, "glm4")
    ids = torch.randint(2, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    single = ExLlamaV2(ExLlamaV2Config(str(path)))
    single.load(device="cpu")  # fp32 on the CPU like the "devices" below, also where a GPU is present
    ref = single.forward(ids)
    model = ExLlamaV2(ExLlamaV2Config(str(path)))
    model.load_tp([1, 1], devices=["cpu", "cpu"], options=RuntimeOptions(tp_layout=mode))
    torch.testing.assert_close(model.forward(ids), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["gemma2", "cohere2"])
def test_quantized_cache_keeps_windows_and_softcaps(built: dict, tmp_path_factory: pytest.TempPathFactory,
                                                    case: str) -> None:
    """The Q8 cache's attention path applies the window and the soft-cap too: its logits stay near the fp16
    cache's (ignoring the window would move them by more than their own size, see the config tests)."""
    from exlpy import ExLlamaV2Cache_Q8

    path, _ = _model(built, tmp_path_factory, case)
    model, cache = _load(path)
    ids = torch.randint(2, VOCAB, (1, 40), generator=torch.Generator().manual_seed(5))
    outs = []
    for c in (cache, ExLlamaV2Cache_Q8(model, max_seq_len=128)):
        parts = [model.forward(ids[:, :20], c)] + [model.forward(ids[:, i:i + 1], c) for i in range(20, 40)]
        outs.append(torch.cat(parts, dim=1))
    assert rel_err(outs[1], outs[0]) < 0.05


def test_glm4_lora_matches_peft(tmp_path: Path) -> None:
    """LoRA on an architecture with post-norms, partial interleaved RoPE and fused gate|up: PEFT's own adapter
    (on q, k, v, o and down) through exlpy equals PEFT's transformers model."""
    from exlpy import ExLlamaV2Lora
    from tests.lora_util import peft_adapter

    ref = make_arch_model(tmp_path / "m", "glm4")
    peft_model = peft_adapter(ref, tmp_path / "a", r=4, alpha=8.0,
                              targets=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"])
    model, _ = _load(tmp_path / "m")
    lora = ExLlamaV2Lora.from_directory(model, str(tmp_path / "a"))
    ids = torch.randint(2, VOCAB, (1, 24), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = peft_model(ids).logits.float()
    got = model.forward(ids, loras=[lora])
    assert rel_err(got, want) <= logits_tol(model, TOL)
    assert rel_err(model.forward(ids), want) > 10 * TOL  # the adapter matters
