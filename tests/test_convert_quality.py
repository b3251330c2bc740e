"""The converter's quality methods on CPU: asymmetric calibration, learned rounding, the sensitivity-weighted
objective (exlpy/convert/quantize.py, gptq.py, sensitivity.py), and resume with learned rounding."""

from __future__ import annotations

import pytest
import torch

from exlpy.convert import convert
from exlpy.convert.gptq import gptq_quantize, prepare_hessian, refine_rounding
from exlpy.convert.packing import check_packed, pack_exl2
from exlpy.convert.qparams import qp
from exlpy.convert.quantize import asymmetric_targets, correction
from exlpy.convert.settings import ConvertSettings
from exlpy.errors import ConvertSettingsError
from tests.conftest import shared_path
from tests.convert_util import assert_resumes_bit_identical

CAL = dict(rows=4, length=64, measurement_rows=2, measurement_length=64, sensitivity_tokens=64, progress=False)


def _problem(k: int = 128, n: int = 96, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs X [T, K] with unequal feature scales, a weight W [K, N], the inputs' Hessian)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1500, k, generator=g) * (0.2 + 3 * torch.rand(k, generator=g))
    w = torch.randn(k, n, generator=g) * 0.05
    return x, w, x.t() @ x / x.shape[0]


def _err(h: torch.Tensor, w: torch.Tensor, q: torch.Tensor) -> float:
    d = q - w
    return float((d * (h @ d)).sum())


def test_learned_rounding_lowers_the_layer_error_and_packs_exactly() -> None:
    x, w, h = _problem()
    w2 = torch.randn(128, 40, generator=torch.Generator().manual_seed(1)) * 0.02
    opts = [qp((3, 0.1, 32), (2, 0.9, 32)), qp((4, 1.0, 64))]
    base = gptq_quantize([w, w2], opts, prepare_hessian(h, 0.01, "t"), norm=2.0)
    before = [_err(h, t, r.dense()) for t, r in zip((w, w2), base)]
    tuned = refine_rounding([w, w2], base, h, 0.01, 2)
    after = [_err(h, t, r.dense()) for t, r in zip((w, w2), tuned)]
    assert after[0] < 0.995 * before[0] and after[1] <= before[1] * (1 + 1e-5)
    for r in tuned:  # the stored codes and scales reproduce the tuned weights bit for bit
        check_packed(pack_exl2(r, "t"), r, "t")
    assert torch.equal(refine_rounding([w], base[:1], h, 0.01, 0)[0].codes, base[0].codes)


def test_asymmetric_target_reaches_the_source_output() -> None:
    """Quantized inputs X̃ = X + noise: GPTQ of W* = M W errs less against the source output X W than GPTQ of W,
    and M is the identity when the inputs are the source's."""
    x, w, _ = _problem(seed=2)
    xq = x + 0.3 * torch.randn(x.shape, generator=torch.Generator().manual_seed(5)) * x.std(0)
    hq = xq.t() @ xq / x.shape[0]
    cross = xq.t() @ x / x.shape[0]
    assert torch.allclose(correction(hq, hq, 0.01), torch.eye(128), atol=1e-4)
    opt = [qp((4, 1.0, 32))]
    ph = prepare_hessian(hq, 0.01, "t")
    plain = gptq_quantize([w], opt, ph, norm=2.0)[0].dense()
    target = asymmetric_targets([w], hq, cross, 0.01)[0]
    asym = gptq_quantize([target], opt, ph, norm=2.0)[0].dense()
    ref = x @ w
    assert float((xq @ asym - ref).square().sum()) < 0.9 * float((xq @ plain - ref).square().sum())


def test_quality_flags_reach_the_settings() -> None:
    import argparse

    from exlpy.convert.args import add_arguments, settings_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    kw = settings_from_args(p.parse_args(["-i", "S", "-o", "W", "--learned_rounding", "2", "--target", "source",
                                          "--objective", "sensitivity"]))
    assert (kw["learned_rounding"], kw["target"], kw["objective"]) == (2, "source", "sensitivity")
    d = ConvertSettings()
    # each decides the output, so a job resumed with another value is refused
    for change in (dict(learned_rounding=0), dict(target="source"), dict(objective="sensitivity"),
                   dict(sensitivity_tokens=512)):
        assert ConvertSettings(**change).fingerprint() != d.fingerprint()  # type: ignore[arg-type]


def test_settings_of_the_quality_methods_are_checked() -> None:
    for kw, match in ((dict(target="fp16"), "target"), (dict(objective="ppl"), "objective"),
                      (dict(learned_rounding=-1), "learned_rounding"), (dict(sensitivity_tokens=0), "sensitivity")):
        with pytest.raises(ConvertSettingsError, match=match):
            ConvertSettings(out_dir="x", **kw).validate()  # type: ignore[arg-type]


def test_sensitivity_is_measured_and_reused(tmp_path) -> None:
    """-om writes every decoder module's sensitivity into the measurement file (positive, finite); a job that
    reuses the file reads them instead of measuring again."""
    import json

    src = str(shared_path("models", "tiny-llama-fp16"))
    convert(src, str(tmp_path / "m"), output_measurement=True, objective="sensitivity", **CAL)
    meas = tmp_path / "m" / "measurement.json"
    sens = json.load(open(meas))["sensitivity"]
    assert set(sens) == set(json.load(open(meas))["measurement"])
    assert all(0 < v < float("inf") for v in sens.values())
    convert(src, str(tmp_path / "w"), str(tmp_path / "q"), bits=4.0, measurement=str(meas), objective="sensitivity",
            **CAL)
    job = json.load(open(tmp_path / "w" / "job.json"))
    assert job["sensitivity"] == sens and "sensitivity" not in job["times"]


def test_kl_objective_weighs_every_module_at_its_operating_point(tmp_path) -> None:
    """objective="kl": every decoder module gets a positive finite weight (the final distribution's KL per unit
    of its own quantization error), and the strategy is the knapsack optimum of the weighted errors."""
    import json

    from exlpy import ExLlamaV2, ExLlamaV2Config
    from exlpy.convert.layers import is_decoder, module_numel
    from exlpy.convert.optimize import choose, slot_error

    src = str(shared_path("models", "tiny-llama-fp16"))
    convert(src, str(tmp_path / "w"), str(tmp_path / "q"), bits=3.0, objective="kl", **CAL)
    job = json.load(open(tmp_path / "w" / "job.json"))
    weights, meas = job["kl_weights"], job["measurement"]
    assert set(weights) == set(meas) and all(0 < v < float("inf") for v in weights.values())
    assert "kl_weights" in job["times"]
    keys = list(meas)
    numel = sum(module_numel(m) for m in ExLlamaV2(ExLlamaV2Config(src)).modules if is_decoder(m))
    costs = [[int(e["total_bits"]) for e in meas[k]] for k in keys]
    errors = [[slot_error(e) * weights[k] for e in meas[k]] for k in keys]
    assert [job["strategy"][k]["option"] for k in keys] == choose(costs, errors, int(numel * 3.0))



@pytest.mark.slow
def test_learned_rounding_and_source_target_resume_bit_identical(tmp_path, monkeypatch) -> None:
    """The three options at once (one conversion is the slow part): the source model's states are checkpointed
    beside the quantized ones, the sensitivity pass and learned rounding are deterministic."""
    src = str(shared_path("models", "tiny-llama-fp16"))
    kw = dict(bits=3.0, learned_rounding=1, target="source", objective="sensitivity", **CAL)
    convert(src, str(tmp_path / "wa"), str(tmp_path / "a"), **kw)
    assert_resumes_bit_identical(monkeypatch, src, str(tmp_path / "wb"), str(tmp_path / "b"),
                                 str(tmp_path / "a"), **kw)
