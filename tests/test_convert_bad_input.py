"""Bad input to the converter: each a typed exlpy error that names what to change, never a traceback or a hang."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from exlpy.convert import convert
from exlpy.convert.gptq import prepare_hessian
from exlpy.errors import (
    CalibrationDataError,
    ConfigError,
    ConvertIOError,
    ConvertSettingsError,
    JobConflictError,
    MeasurementFileError,
    NumericalError,
    UnsupportedArchitectureError,
    WeightsError,
)
from tests.conftest import child_env, shared_path

CAL = dict(rows=2, length=32, measurement_rows=2, measurement_length=32, progress=False)


def _tiny() -> str:
    return str(shared_path("models", "tiny-llama-fp16"))


def _copy(tmp_path, edit=None) -> str:
    dst = tmp_path / "src"
    shutil.copytree(_tiny(), dst)
    if edit is not None:
        f = dst / "model-00000.safetensors"
        t = load_file(str(f))
        edit(t)
        save_file(t, str(f))
    return str(dst)


def test_source_missing_or_unsupported(tmp_path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        convert(str(tmp_path / "nope"), str(tmp_path / "w"), **CAL)
    src = _copy(tmp_path)
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["architectures"] = ["GemmoeForCausalLM"]
    json.dump(cfg, open(os.path.join(src, "config.json"), "w"))
    with pytest.raises(UnsupportedArchitectureError, match="GemmoeForCausalLM"):
        convert(src, str(tmp_path / "w"), **CAL)


@pytest.mark.parametrize("bits", [1.0, 8.5])
def test_bits_out_of_range(tmp_path, bits: float) -> None:
    with pytest.raises(ConvertSettingsError, match=r"reachable range|up to 8"):
        convert(_tiny(), str(tmp_path / "w"), bits=bits, **CAL)
    assert not os.path.exists(tmp_path / "w" / "job.json")  # refused before any work


def test_head_bits(tmp_path) -> None:
    with pytest.raises(ConvertSettingsError, match="2, 3, 4, 5, 6, 8, got 7"):
        convert(_tiny(), str(tmp_path / "w"), head_bits=7, **CAL)


def test_calibration_files(tmp_path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(CalibrationDataError, match="empty"):
        convert(_tiny(), str(tmp_path / "w1"), cal_dataset=str(empty), **CAL)
    short = tmp_path / "short.txt"
    short.write_text("only a few words")
    with pytest.raises(CalibrationDataError, match=r"short.txt: holds \d+ tokens, but 2 rows of 32"):
        convert(_tiny(), str(tmp_path / "w2"), cal_dataset=str(short), **CAL)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{not json\n')
    with pytest.raises(CalibrationDataError, match=r"bad.jsonl:2"):
        convert(_tiny(), str(tmp_path / "w3"), cal_dataset=str(bad), **CAL)
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00\x81" * 100)
    with pytest.raises(CalibrationDataError, match="cannot read"):
        convert(_tiny(), str(tmp_path / "w4"), cal_dataset=str(binary), **CAL)
    pq = tmp_path / "cal.parquet"
    pq.write_bytes(b"PAR1 not really")
    with pytest.raises(CalibrationDataError, match=r"cal.parquet"):
        convert(_tiny(), str(tmp_path / "w5"), cal_dataset=str(pq), **CAL)


def test_nan_in_source_tensor(tmp_path) -> None:
    def poison(t):
        t["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")

    # Refused when the source tensor is read (the loader's own check, WeightsError) or by the converter's.
    with pytest.raises((NumericalError, WeightsError), match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        convert(_copy(tmp_path, poison), str(tmp_path / "w"), **CAL)


def test_inf_in_hidden_states_names_the_layer(tmp_path) -> None:
    def blow_up(t):
        for k in list(t):
            t[k] = t[k].float()
        t["model.layers.0.post_attention_layernorm.weight"][:] = 1e30  # finite, but overflows the activations
        t["model.layers.0.mlp.down_proj.weight"][:] = 1e30

    # A converter computing in fp32 (CPU) finds the overflow in the hidden states after layer 0's MLP; one that
    # reads the weights as fp16 (CUDA) refuses 1e30 itself, as inf, naming the tensor (the loader's check).
    with pytest.raises((NumericalError, WeightsError),
                       match=r"after model\.layers\.0\.mlp|tensor: model\.layers\.0\.post_attention_layernorm"):
        convert(_copy(tmp_path, blow_up), str(tmp_path / "w"), **CAL)


def test_singular_hessian_names_the_layer() -> None:
    with pytest.raises(NumericalError, match=r"model\.layers\.4\.mlp\.down_proj.*not invertible"):
        prepare_hessian(-torch.eye(16), 0.01, "model.layers.4.mlp.down_proj")


def test_measurement_of_another_model(tmp_path) -> None:
    meas = tmp_path / "m"
    convert(_tiny(), str(meas), output_measurement=True, **CAL)
    other = str(shared_path("models", "aidreams260K"))
    with pytest.raises(MeasurementFileError, match="another model"):
        convert(other, str(tmp_path / "w"), bits=5.0, measurement=str(meas / "measurement.json"), **CAL)
    junk = tmp_path / "junk.json"
    junk.write_text("[1, 2]")
    with pytest.raises(MeasurementFileError, match="not a measurement file"):
        convert(_tiny(), str(tmp_path / "w2"), measurement=str(junk), **CAL)


def test_work_dir_not_writable(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConvertIOError, match="cannot write"):
        convert(_tiny(), str(blocker / "work"), **CAL)


def test_existing_dirs_with_other_jobs(tmp_path) -> None:
    work = tmp_path / "w"
    convert(_tiny(), str(work), output_measurement=True, **CAL)
    with pytest.raises(JobConflictError, match=r"different job.*-nr"):
        convert(_tiny(), str(work), output_measurement=True, **{**CAL, "rows": 3})
    convert(_tiny(), str(work), output_measurement=True, no_resume=True, **{**CAL, "rows": 3})
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(JobConflictError, match="not empty"):
        convert(_tiny(), str(foreign), **CAL)
    out = tmp_path / "out"
    out.mkdir()
    (out / "something.bin").write_text("x")
    with pytest.raises(JobConflictError, match="not empty"):
        convert(_tiny(), str(tmp_path / "w3"), str(out), measurement=str(work / "measurement.json"), **CAL)
    with pytest.raises(ConvertSettingsError, match="exclude"):
        convert(_tiny(), str(tmp_path / "w4"), str(tmp_path / "o4"), output_measurement=True, **CAL)


def test_module_entry_point_errors_are_one_line(tmp_path) -> None:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "exlpy.convert", "-i", str(tmp_path / "missing"), "-cf",
                        str(tmp_path / "out"), "-b", "4.0"], capture_output=True, text=True, timeout=120,
                       env=child_env())
    assert r.returncode == 1
    assert "model directory not found" in r.stderr and "Traceback" not in r.stderr


_FSIZE_CHILD = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG, as a full disk does
resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
from exlpy.cli.main import main
sys.exit(main(["convert", "-i", sys.argv[1], "-o", sys.argv[2], "-cf", sys.argv[3], "-b", "4.0", "-r", "2", "-l", "32",
               "-mr", "2", "-ml", "32"]))
"""


def test_write_failure_mid_job_is_typed(tmp_path) -> None:
    """A checkpoint that cannot be written (here: files capped at 64 KiB, the way a full disk fails a write) is a
    one-line ConvertIOError naming the file, not safetensors' raw SafetensorError, and the job stays resumable."""
    import subprocess
    import sys

    work = tmp_path / "w"
    r = subprocess.run([sys.executable, "-c", _FSIZE_CHILD, _tiny(), str(work), str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=300, env=child_env())
    assert r.returncode == 1, r.stderr
    assert "exlpy: error: cannot write" in r.stderr and "File too large" in r.stderr and "resumes" in r.stderr
    assert "Traceback" not in r.stderr and "SafetensorError" not in r.stderr
    assert json.load(open(work / "job.json"))["stage"]  # the last checkpoint is intact
    assert not [p for p in work.rglob("*.tmp")]  # no half-written file left behind


def test_io_error_messages_say_why() -> None:
    import errno

    from safetensors import SafetensorError

    from exlpy.convert.job import _io_error

    for e, why in ((OSError(errno.ENOSPC, "No space left on device"), "the disk is full"),
                   (SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
                    "the disk is full"),
                   (SafetensorError('IoError(Os { code: 122, kind: QuotaExceeded, message: "Disk quota exceeded" })'),
                    "the disk is full"),
                   (OSError(errno.EROFS, "Read-only file system"), "not writable"),
                   (OSError(errno.EACCES, "Permission denied"), "not writable")):
        err = _io_error("/x/out.safetensors", e)
        assert isinstance(err, ConvertIOError) and why in str(err) and "/x/out.safetensors" in str(err)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions, so a read-only folder cannot be "
                    "made here")
def test_read_only_output_folder(tmp_path) -> None:
    work = tmp_path / "w"
    work.mkdir()
    work.chmod(0o555)
    try:
        with pytest.raises(ConvertIOError, match="not writable"):
            convert(_tiny(), str(work), **CAL)
    finally:
        work.chmod(0o755)
