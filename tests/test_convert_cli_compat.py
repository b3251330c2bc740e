"""The converter's exllamav2 flags that front ends pass (-rs, -ra, -so, -hsol, -fst) and its progress when the
output is not a terminal; fast (no conversion runs)."""

from __future__ import annotations

import argparse
import io
import json

import pytest

from exlpy.convert import progress as progress_mod
from exlpy.convert.args import add_arguments, deprecated_notices, settings_from_args
from exlpy.convert.pipeline import _Converter
from exlpy.convert.progress import StageProgress
from exlpy.convert.settings import ConvertSettings
from exlpy.errors import ConvertSettingsError
from tests.conftest import shared_path


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_exllamav2_flags_are_accepted() -> None:
    a = parse("-i", "SRC", "-o", "W", "-rs", "2.0", "-ra", "1.5", "-so", "-hsol", "3", "-fst")
    kw = settings_from_args(a)
    assert (kw["rope_scale"], kw["rope_alpha"], kw["status_output"]) == (2.0, 1.5, True)
    notes = deprecated_notices(a)
    assert any("-fst" in n for n in notes) and any("-hsol" in n for n in notes)
    assert deprecated_notices(parse("-i", "SRC", "-o", "W")) == []
    with pytest.raises(ConvertSettingsError, match="-rs/--rope_scale"):
        ConvertSettings(out_dir="W", rope_scale=0.0).validate()
    # The RoPE settings change the calibration forward, so they are part of the job's identity.
    assert ConvertSettings(rope_alpha=2.0).fingerprint() != ConvertSettings().fingerprint()


def test_rope_flags_reach_the_calibration_model(tmp_path) -> None:
    s = ConvertSettings(in_dir=str(shared_path("models", "tiny-llama-fp16")), out_dir=str(tmp_path), rope_scale=2.0,
                        rope_alpha=1.5, progress=False, length=64, measurement_length=64)
    c = _Converter(s)
    c._open_model()
    assert (c.config.scale_pos_emb, c.config.scale_alpha_value) == (2.0, 1.5)


def test_status_lines_and_plain_progress(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(progress_mod, "PLAIN_INTERVAL_S", 0.0)
    log = io.StringIO()  # not a terminal
    p = StageProgress(True, status_output=True, stream=log)
    p.step("tokenize (measure)")
    p.start("quantize", 4)
    for k in range(4):
        p.advance(f"layer {k}")
    p.finish()
    status = [json.loads(line[len("[STATUS]"):-len("[/STATUS]")]) for line in capsys.readouterr().out.splitlines()]
    tok = {"stage": "Tokenizing (1)"}
    assert status[:2] == [{**tok, "completion": 0.0}, {**tok, "completion": 1.0}]
    assert [s["completion"] for s in status[2:]] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert all(s["stage"] == "Quantizing" for s in status[2:])
    lines = log.getvalue().splitlines()
    assert lines[2] == "exlpy convert: quantize: started (4 steps)"
    assert "quantize: 25% (1/4)  layer 0" in lines[3] and "quantize: 75% (3/4)" in lines[5]
    assert lines[-1].startswith("exlpy convert: quantize: done in")
    # Quiet: no plain lines, but -so status lines still come (front ends parse them).
    quiet = io.StringIO()
    q = StageProgress(False, status_output=True, stream=quiet)
    q.step("optimize")
    assert quiet.getvalue() == "" and "Optimizing" in capsys.readouterr().out
