"""Block-wise output tuning (exlpy/convert/blocktune.py, --block_tune) on CPU with the tiny Llama: the held-out
block error never grows, the tuned block stays exactly EXL2, the option changes the output, which loads and
runs, and an interrupted conversion resumes bit for bit; with --block_tune_norms the tuned input norms are what
the output stores and the loader uses."""

from __future__ import annotations

import pytest
import torch

from exlpy.convert import blocktune, convert
from exlpy.convert import quantize as quantize_mod
from exlpy.convert.gptq import gptq_quantize, prepare_hessian
from exlpy.convert.settings import ConvertSettings
from exlpy.errors import ConvertSettingsError
from tests.conftest import requires_cuda, shared_path
from tests.convert_util import assert_resumes_bit_identical, check_format, kl, logits, safetensors_bytes

CAL = dict(rows=8, length=64, measurement_rows=2, measurement_length=64, progress=False)



def test_block_tune_settings_are_checked_and_decide_the_output() -> None:
    import argparse

    from exlpy.convert.args import add_arguments, settings_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    kw = settings_from_args(p.parse_args(["-i", "S", "-o", "W", "--block_tune", "30", "--block_tune_tokens", "512"]))
    assert (kw["block_tune"], kw["block_tune_tokens"], kw["block_tune_norms"]) == (30, 512, True)
    kw = settings_from_args(p.parse_args(["-i", "S", "-o", "W", "--block_tune", "30", "--no_block_tune_norms"]))
    assert kw["block_tune_norms"] is False
    with pytest.raises(SystemExit):
        p.parse_args(["-i", "S", "--block_tune_norms", "--no_block_tune_norms"])
    d = ConvertSettings()
    # block tuning off by default, with the norms when it runs: see benchmarks/results/convert_quality.md
    assert d.block_tune == 0 and d.block_tune_norms
    for change in (dict(block_tune=5), dict(block_tune_tokens=64)):
        assert ConvertSettings(**change).fingerprint() != d.fingerprint()  # type: ignore[arg-type]
    assert (ConvertSettings(block_tune=5, block_tune_norms=False).fingerprint()
            != ConvertSettings(block_tune=5).fingerprint())
    # without block tuning the norms decide nothing, and the fingerprint of such a job stays what it was
    assert ConvertSettings(block_tune_norms=False).fingerprint() == d.fingerprint()
    assert "block_tune_norms" not in d.fingerprint()
    for bad, match in ((dict(block_tune=-1), "block_tune"), (dict(block_tune_tokens=0), "block_tune_tokens"),
                       (dict(block_tune=5, block_tune_norms="yes"), "block_tune_norms")):
        with pytest.raises(ConvertSettingsError, match=match):
            ConvertSettings(out_dir="x", **bad).validate()  # type: ignore[arg-type]


def _rtn(ws, options, h, damp, norm, key, act_order="auto", rounding_passes=0):  # noqa: ANN001, ANN202
    return gptq_quantize(ws, options, prepare_hessian(h, damp, key), norm=norm, rtn=True, plain_scales=True)


@pytest.mark.slow
def test_block_tuning_changes_the_output_which_loads_and_resumes_bit_identical(tmp_path, monkeypatch) -> None:
    """The tiny Llama's weights are random: from GPTQ with learned rounding its blocks sit where tuning finds
    nothing better on the held-out rows (and keeps them as they are), so the tuner starts here from
    round-to-nearest codes, where there is room to improve."""
    src = str(shared_path("models", "tiny-llama-fp16"))
    monkeypatch.setattr(quantize_mod, "quantize_best_order", _rtn)
    errors: list[tuple[str, float, float]] = []
    real_tune = quantize_mod.tune_block

    def recording(module, *args, **kwargs):
        tuned = real_tune(module, *args, **kwargs)
        assert tuned.norm is None  # block_tune_norms=False: the source norms stay
        errors.append((module.key, tuned.before, tuned.after))
        return tuned

    monkeypatch.setattr(quantize_mod, "tune_block", recording)
    kw = dict(bits=3.0, block_tune=12, block_tune_tokens=128, block_tune_norms=False, **CAL)
    convert(src, str(tmp_path / "wa"), str(tmp_path / "a"), **kw)
    n_modules = len(errors)
    assert n_modules > 0
    assert all(after <= before for _, before, after in errors)  # the untuned block is kept unless tuning helps
    assert sum(after < 0.97 * before for _, before, after in errors) >= 2, errors

    convert(src, str(tmp_path / "wp"), str(tmp_path / "plain"), **(kw | dict(block_tune=0)))
    assert len(errors) == n_modules  # block_tune=0: the tuner is not called
    tuned, plain = safetensors_bytes(str(tmp_path / "a")), safetensors_bytes(str(tmp_path / "plain"))
    assert tuned.keys() == plain.keys() and tuned != plain
    check_format(str(tmp_path / "a"), src)  # every stored tensor is valid EXL2 (check_packed ran on each too)
    ids = torch.randint(1, 512, (1, 48), generator=torch.Generator().manual_seed(3))
    ref, got = logits(src, ids), logits(str(tmp_path / "a"), ids)
    assert bool(torch.isfinite(got).all())
    assert kl(ref, got) < 0.5 * kl(ref, torch.zeros_like(ref))  # far closer to the source than a flat guess

    assert_resumes_bit_identical(monkeypatch, src, str(tmp_path / "wb"), str(tmp_path / "b"),
                                 str(tmp_path / "a"), **kw)


@pytest.mark.slow
def test_tuned_norms_are_written_loaded_and_resume_bit_identical(tmp_path, monkeypatch) -> None:
    """--block_tune_norms (the default with --block_tune): every kept tuning writes its block's tuned input norm
    (fp16) in place of the source's, the other norms stay the source's, the loader runs with exactly the written
    weights, and an interrupted job resumes bit for bit. From round-to-nearest codes, as above."""
    from exlpy import ExLlamaV2, ExLlamaV2Config
    from exlpy.model.attention import Attention
    from exlpy.model.mlp import MLP
    from exlpy.weights.safetensors_index import SafetensorsIndex

    src = str(shared_path("models", "tiny-llama-fp16"))
    monkeypatch.setattr(quantize_mod, "quantize_best_order", _rtn)
    tuned: dict[str, blocktune.BlockTuning] = {}
    real_tune = quantize_mod.tune_block

    def recording(module, *args, **kwargs):
        out = real_tune(module, *args, **kwargs)
        tuned[module.key] = out
        return out

    monkeypatch.setattr(quantize_mod, "tune_block", recording)
    kw = dict(bits=3.0, block_tune=12, block_tune_tokens=128, **CAL)  # norms tuned by default
    convert(src, str(tmp_path / "wa"), str(tmp_path / "a"), **kw)
    assert len(tuned) == 4 and all(t.after <= t.before for t in tuned.values())
    written = {t.norm_name: t.norm for t in tuned.values() if t.norm is not None}
    assert len(written) >= 2, {k: (t.before, t.after) for k, t in tuned.items()}
    out, source = SafetensorsIndex(str(tmp_path / "a")), SafetensorsIndex(src)
    changed = 0
    for name in source.tensors:
        if name.endswith("layernorm.weight"):
            stored = out.get(name)
            assert stored.dtype == torch.float16
            if name in written:
                assert torch.equal(stored, written[name])  # the tuned norm, bit for bit
                changed += not torch.equal(stored, source.get(name).half())
            else:
                assert torch.equal(stored, source.get(name).half())  # untuned blocks keep the source's
    assert changed >= 1
    check_format(str(tmp_path / "a"), src)
    model = ExLlamaV2(ExLlamaV2Config(str(tmp_path / "a")))
    model.load(device="cpu")
    for m in model.modules:
        if isinstance(m, (Attention, MLP)) and f"{m.norm_key}.weight" in written:
            assert torch.equal(m.norm_w, written[f"{m.norm_key}.weight"].to(m.norm_w.dtype))
    model.unload()
    ids = torch.randint(1, 512, (1, 48), generator=torch.Generator().manual_seed(3))
    ref, got = logits(src, ids), logits(str(tmp_path / "a"), ids)
    assert bool(torch.isfinite(got).all()) and kl(ref, got) < 0.5 * kl(ref, torch.zeros_like(ref))

    assert_resumes_bit_identical(monkeypatch, src, str(tmp_path / "wb"), str(tmp_path / "b"),
                                 str(tmp_path / "a"), **kw)


def test_only_dense_unparallel_blocks_are_tuned() -> None:
    class Other:
        parallel = False

    assert not blocktune.tunable(Other())  # type: ignore[arg-type]


@pytest.mark.gpu
@requires_cuda
def test_block_tuning_runs_on_the_gpu(tmp_path, monkeypatch) -> None:
    """On CUDA the tuner runs torch's reference ops (the Triton kernels have no backward pass) and still
    improves blocks from round-to-nearest codes; the result is valid EXL2."""
    src = str(shared_path("models", "tiny-llama-fp16"))
    monkeypatch.setattr(quantize_mod, "quantize_best_order", _rtn)
    errors: list[tuple[float, float]] = []
    real_tune = quantize_mod.tune_block

    def recording(module, *args, **kwargs):
        tuned = real_tune(module, *args, **kwargs)
        errors.append((tuned.before, tuned.after))
        return tuned

    monkeypatch.setattr(quantize_mod, "tune_block", recording)
    convert(src, str(tmp_path / "w"), str(tmp_path / "o"), bits=3.0, block_tune=12, block_tune_tokens=128,
            device="cuda:0", **CAL)
    assert errors and all(a <= b for b, a in errors) and any(a < 0.97 * b for b, a in errors), errors
    check_format(str(tmp_path / "o"), src)


def test_compile_writes_a_tensor_of_the_job_files_instead_of_the_source_one(tmp_path) -> None:
    """A source tensor the job's files also hold (a tuned norm) is written once, the job's version, also when the
    two would land in different shards."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from exlpy.convert.compile import compile_output
    from exlpy.weights.safetensors_index import SafetensorsIndex

    g = torch.Generator().manual_seed(0)
    src = tmp_path / "src"
    src.mkdir()
    norm = "model.layers.0.input_layernorm.weight"
    # zbig sorts after the norm, so the source norm closes a shard of its own before the job files are read
    save_file({norm: torch.randn(256, generator=g).half(), "model.layers.0.zbig.weight":
               torch.randn(600, 1000, generator=g).half()}, str(src / "model.safetensors"))
    tuned = torch.randn(256, generator=g).half()
    job = tmp_path / "job.safetensors"
    save_file({norm: tuned, "model.layers.1.other.weight": torch.randn(600, 1000, generator=g).half()}, str(job))
    out = tmp_path / "out"
    names = compile_output(SafetensorsIndex(str(src)), [str(job)], set(), str(out), 1)
    assert len(names) >= 2  # the source's copy would sit in another shard than the job's
    holders = []
    for f in names:
        with safe_open(str(out / f), "pt") as h:
            holders += [f for n in h.keys() if n == norm]
    assert len(holders) == 1
    assert torch.equal(SafetensorsIndex(str(out)).get(norm), tuned)
