"""Damaged weights: every safetensors defect is a WeightsError naming the file (and the tensor where there is
one); non-finite weights are refused at load naming the tensor; odd directory names load."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import struct
from pathlib import Path

import pytest
import torch

from exlpy import ExLlamaV2, ExLlamaV2Config
from exlpy.errors import WeightsError
from exlpy.runtime import RuntimeOptions, use_options
from exlpy.weights.safetensors_index import SafetensorsIndex
from tests.conftest import shared_path

GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
TWO = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
       "b": {"dtype": "F16", "shape": [2, 2], "data_offsets": [8, 16]}}


def _write(path: Path, header: dict | bytes, data: bytes, hlen: bytes | None = None) -> Path:
    hb = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes((hlen if hlen is not None else struct.pack("<Q", len(hb))) + hb + data)
    return path


def _entry(**changes: object) -> dict:
    return {"a": {**GOOD["a"], **changes}}


# (header, data, header-length override, words the message must hold, tensor named)
CASES: dict[str, tuple[dict | bytes, bytes, bytes | None, str, str | None]] = {
    "trailing_byte": (GOOD, b"\0" * 9, None, "trailing bytes", None),
    "header_length_minus_1": (GOOD, b"\0" * 8, struct.pack("<q", -1), "header length -1", None),
    "header_length_past_end": (GOOD, b"\0" * 8, struct.pack("<Q", 10**6), "header length 1000000", None),
    "overlapping_offsets": ({**TWO, "b": {**TWO["b"], "data_offsets": [4, 12]}}, b"\0" * 12, None, "overlaps",
                            "b"),
    "gapped_offsets": ({**TWO, "b": {**TWO["b"], "data_offsets": [12, 20]}}, b"\0" * 20, None, "gap", "b"),
    "metadata_not_string": ({"__metadata__": {"format": 5}, **GOOD}, b"\0" * 8, None, "__metadata__", None),
    "metadata_not_object": ({"__metadata__": [1], **GOOD}, b"\0" * 8, None, "__metadata__", None),
    "float_shape": (_entry(shape=[2.0]), b"\0" * 8, None, "shape", "a"),
    "negative_shape": (_entry(shape=[-2, -1]), b"\0" * 8, None, "shape", "a"),
    "bool_shape": (_entry(shape=[True, 2]), b"\0" * 8, None, "shape", "a"),
    "dtype_list": (_entry(dtype=["F32"]), b"\0" * 8, None, "dtype", "a"),
    "dtype_unknown": (_entry(dtype="F7"), b"\0" * 8, None, "unsupported dtype", "a"),
    "offsets_float": (_entry(data_offsets=[0.0, 8.0]), b"\0" * 8, None, "data_offsets", "a"),
    "offsets_three": (_entry(data_offsets=[0, 4, 8]), b"\0" * 8, None, "data_offsets", "a"),
    "offsets_reversed": (_entry(data_offsets=[8, 0]), b"\0" * 8, None, "size mismatch", "a"),
    "size_mismatch": (_entry(shape=[3]), b"\0" * 8, None, "size mismatch", "a"),
    "entry_not_object": ({"a": [1, 2]}, b"", None, "expected an object", "a"),
    "entry_missing_key": ({"a": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, None, "missing", "a"),
    "header_is_list": (b"[1, 2]", b"", None, "not an object", None),
    "header_not_utf8": (b"{\xff\xfe}", b"", None, "not JSON", None),
    "deep_nesting": (b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}", b"", None, "nested too deeply", None),
    "huge_int": (b'{"a": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 8]}}', b"\0" * 8,
                 None, "not JSON", None),
    "data_past_end": (_entry(shape=[4], data_offsets=[0, 16]), b"\0" * 8, None, "past the end", None),
    "empty_file": (b"", b"", b"", "truncated", None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_damaged_header_is_weights_error(tmp_path: Path, name: str) -> None:
    header, data, hlen, words, tensor = CASES[name]
    f = _write(tmp_path / "model.safetensors", header, data, hlen)
    with pytest.raises(WeightsError) as e:
        SafetensorsIndex(str(tmp_path))
    msg = str(e.value)
    assert words in msg and str(f) in msg  # what is wrong, and which file
    assert e.value.file == str(f)
    if tensor is not None:
        assert e.value.tensor == tensor and f"tensor: {tensor}" in msg


def test_valid_hand_written_header_reads(tmp_path: Path) -> None:
    """The checks accept what the format allows: metadata strings, zero-sized tensors, any entry order."""
    header = {"__metadata__": {"format": "pt"}, "z": {"dtype": "F16", "shape": [0, 4], "data_offsets": [8, 8]},
              **{k: TWO[k] for k in ("b", "a")}}
    data = torch.tensor([1.5, -2.0]).numpy().tobytes() + torch.tensor([1, 2, 3, 4], dtype=torch.float16).numpy(
    ).tobytes()
    _write(tmp_path / "x.safetensors", header, data)
    idx = SafetensorsIndex(str(tmp_path))
    assert idx.get("a").tolist() == [1.5, -2.0]
    assert idx.get("b").tolist() == [[1, 2], [3, 4]] and idx.get("z").shape == (0, 4)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_named_safetensors_does_not_hang(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "model.safetensors")
    old = signal.signal(signal.SIGALRM, lambda *_: pytest.fail("reading a FIFO hung"))
    signal.alarm(10)
    try:
        with pytest.raises(WeightsError, match="not a regular file") as e:
            SafetensorsIndex(str(tmp_path))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert "model.safetensors" in str(e.value)


def test_directory_named_safetensors(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").mkdir()
    with pytest.raises(WeightsError, match="not a regular file"):
        SafetensorsIndex(str(tmp_path))


def test_model_dir_not_a_directory(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(WeightsError, match="cannot list") as e:
        SafetensorsIndex(str(tmp_path / "f"))
    assert str(tmp_path / "f") in str(e.value)


@pytest.fixture
def hf_dir(tiny_llama_dir: Path) -> Path:
    return tiny_llama_dir


@pytest.mark.parametrize("dirname", ["llama[v2]", "m*?", "a b{1,2}"])
def test_directory_name_with_glob_characters_loads(hf_dir: Path, tmp_path: Path, dirname: str) -> None:
    d = tmp_path / dirname
    shutil.copytree(hf_dir, d)
    (d / "._model.safetensors").write_bytes(b"\0" * 4)  # a macOS resource fork is not a shard
    model = ExLlamaV2(ExLlamaV2Config(str(d)))
    model.load()
    logits = model.forward(torch.randint(0, 320, (1, 5)))
    assert logits.shape == (1, 5, 320) and torch.isfinite(logits).all()


def test_tensor_data_replaced_after_header_read(hf_dir: Path, tmp_path: Path) -> None:
    """The file is swapped for a FIFO between reading headers and loading: still a typed error."""
    d = tmp_path / "m"
    shutil.copytree(hf_dir, d)
    config = ExLlamaV2Config(str(d))
    f = next(p for p in d.iterdir() if p.suffix == ".safetensors")
    f.unlink()
    os.mkfifo(f) if hasattr(os, "mkfifo") else f.mkdir()
    with pytest.raises(WeightsError, match="not a regular file") as e:
        ExLlamaV2(config).load()
    assert str(f) in str(e.value)




def _poison(src: Path, dst: Path, edits: dict[str, tuple[tuple[int, ...], float]], dtype: torch.dtype | None = None
            ) -> Path:
    """Copy a model directory, setting single values of named tensors (name -> (index, value))."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    for f in [p for p in dst.iterdir() if p.suffix == ".safetensors" and p.name != "reference.safetensors"]:
        with safe_open(str(f), "pt") as h:
            tensors = {n: h.get_tensor(n) for n in h.keys()}
        hit = False
        for name, (idx, value) in edits.items():
            if name in tensors:
                t = tensors[name].clone() if dtype is None else tensors[name].to(dtype)
                t[idx] = value
                tensors[name], hit = t, True
        if hit:
            f.unlink()
            save_file(tensors, str(f), metadata={"format": "pt"})
    return dst


NONFINITE: dict[str, tuple[str, tuple[int, ...], float]] = {
    "embedding_nan": ("model.embed_tokens.weight", (7, 3), math.nan),
    "q_proj_nan": ("model.layers.0.self_attn.q_proj.weight", (5, 1), math.nan),
    "down_proj_inf": ("model.layers.1.mlp.down_proj.weight", (0, 0), math.inf),
    "norm_neg_inf": ("model.layers.1.input_layernorm.weight", (4,), -math.inf),
    "final_norm_nan": ("model.norm.weight", (0,), math.nan),
    "lm_head_nan": ("lm_head.weight", (300, 63), math.nan),
}


@pytest.mark.parametrize("case", list(NONFINITE))
def test_nonfinite_dense_weight_named(hf_dir: Path, tmp_path: Path, case: str) -> None:
    name, idx, value = NONFINITE[case]
    d = _poison(hf_dir, tmp_path / "m", {name: (idx, value)})
    model = ExLlamaV2(ExLlamaV2Config(str(d)))
    with pytest.raises(WeightsError, match="non-finite") as e:
        model.load(device="cpu")
    assert e.value.tensor == name and f"index {list(idx)}" in str(e.value)
    assert e.value.file is not None and e.value.file.endswith(".safetensors")


def test_nonfinite_bias_named(tmp_path: Path) -> None:
    from tests.hf_models import make_hf_model

    src = tmp_path / "q"
    make_hf_model(src, "qwen2")
    name = "model.layers.0.self_attn.k_proj.bias"
    d = _poison(src, tmp_path / "m", {name: ((3,), math.nan)})
    with pytest.raises(WeightsError, match="non-finite") as e:
        ExLlamaV2(ExLlamaV2Config(str(d))).load(device="cpu")
    assert e.value.tensor == name


def test_fp32_value_past_fp16_range_is_named_with_dtype_hint(hf_dir: Path, tmp_path: Path) -> None:
    name = "model.layers.0.mlp.up_proj.weight"
    d = _poison(hf_dir, tmp_path / "m", {name: ((2, 2), 1e6)})
    config = ExLlamaV2Config(str(d))
    config.dtype = torch.float16
    with pytest.raises(WeightsError, match="became inf in torch.float16") as e:
        ExLlamaV2(config).load(device="cpu")
    assert e.value.tensor == name
    config.dtype = torch.float32  # the value is finite in fp32: loads
    m = ExLlamaV2(config)
    m.load(device="cpu")
    assert torch.isfinite(m.forward(torch.tensor([[1, 2, 3]]))).all()


@pytest.mark.parametrize("layer, value", [(0, math.nan), (1, math.inf)])
def test_nonfinite_exl2_q_scale_max_named(tmp_path: Path, layer: int, value: float) -> None:
    name = f"model.layers.{layer}.self_attn.q_proj.q_scale_max"
    d = _poison(shared_path("models", "tiny-llama-exl2-4.0"), tmp_path / "m", {name: ((0,), value)})
    with pytest.raises(WeightsError, match="non-finite") as e:
        ExLlamaV2(ExLlamaV2Config(str(d))).load(device="cpu")
    assert e.value.tensor == name and e.value.file.endswith("output.safetensors")


def test_nonfinite_gptq_scales_named(tmp_path: Path) -> None:
    from tests.test_gptq import _write_models

    qdir, _ = _write_models(tmp_path, v2=False)
    name = "model.layers.1.mlp.gate_proj.scales"
    d = _poison(qdir, tmp_path / "m", {name: ((0, 5), math.nan)})
    with pytest.raises(WeightsError, match="non-finite") as e:
        ExLlamaV2(ExLlamaV2Config(str(d))).load(device="cpu")
    assert e.value.tensor == name


def test_weight_checks_can_be_skipped(hf_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = _poison(hf_dir, tmp_path / "m", {"model.norm.weight": ((0,), math.nan)})
    m = ExLlamaV2(ExLlamaV2Config(str(d)))
    with use_options(RuntimeOptions.from_env({"EXLPY_SKIP_WEIGHT_CHECKS": "1"})):
        m.load(device="cpu")  # the user asked for it: loads, and the NaN shows in the logits
    assert torch.isnan(m.forward(torch.tensor([[1, 2]]))).all()


def test_module_checks_sync_once_per_module() -> None:
    """Inside module_checks() the sums are only read at the end, in one stack: count the host reads."""
    from exlpy.weights import checks

    class Index:
        tensors: dict = {}
        model_dir = "m"

    reads = {"n": 0}
    real = checks.verify

    def counting(pending: list) -> None:
        reads["n"] += 1
        real(pending)

    checks.verify = counting  # type: ignore[assignment]
    try:
        with checks.module_checks():
            for i in range(5):
                checks.landed(Index(), f"t{i}", torch.randn(10))
        assert reads["n"] == 1
        with pytest.raises(WeightsError, match="tensor: t3"):
            with checks.module_checks():
                for i in range(5):
                    checks.landed(Index(), f"t{i}", torch.full((4,), math.nan) if i == 3 else torch.randn(4))
    finally:
        checks.verify = real  # type: ignore[assignment]


def _retype(src: Path, dst: Path, names: list[str], dtype: torch.dtype) -> Path:
    """Copy a model directory with the named tensors stored value-cast to an integer dtype (what a broken
    exporter writes: the numbers survive as integers, the weights do not)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    for f in [p for p in dst.iterdir() if p.suffix == ".safetensors" and p.name != "reference.safetensors"]:
        with safe_open(str(f), "pt") as h:
            tensors = {n: h.get_tensor(n) for n in h.keys()}
        hit = [n for n in names if n in tensors]
        for n in hit:
            tensors[n] = (tensors[n].float() * 1000).to(dtype)
        if hit:
            f.unlink()
            save_file(tensors, str(f), metadata={"format": "pt"})
    return dst


INTEGER_FLOATS = {
    "fp32_embedding_i32": ("hf", "model.embed_tokens.weight", torch.int32),
    "fp32_q_proj_i16": ("hf", "model.layers.0.self_attn.q_proj.weight", torch.int16),
    "fp32_norm_i32": ("hf", "model.layers.1.input_layernorm.weight", torch.int32),
    "fp16_down_proj_i16": ("tiny-llama-fp16", "model.layers.1.mlp.down_proj.weight", torch.int16),
    "fp16_lm_head_i32": ("tiny-llama-fp16", "lm_head.weight", torch.int32),
    "exl2_q_scale_max_i16": ("tiny-llama-exl2-4.0", "model.layers.0.self_attn.q_proj.q_scale_max", torch.int16),
    "exl2_norm_i32": ("tiny-llama-exl2-4.0", "model.norm.weight", torch.int32),
}


@pytest.mark.parametrize("case", list(INTEGER_FLOATS))
def test_float_weight_stored_as_integer_is_named(hf_dir: Path, tmp_path: Path, case: str) -> None:
    src, name, dtype = INTEGER_FLOATS[case]
    d = _retype(hf_dir if src == "hf" else shared_path("models", src), tmp_path / "m", [name], dtype)
    with pytest.raises(WeightsError, match="an integer type, but it is a floating-point weight") as e:
        ExLlamaV2(ExLlamaV2Config(str(d))).load(device="cpu")
    assert e.value.tensor == name and e.value.file.endswith(".safetensors")
    # Checked from the header even when the value checks are off: the values are not NaN, just wrong.
    with use_options(RuntimeOptions.from_env({"EXLPY_SKIP_WEIGHT_CHECKS": "1"})), pytest.raises(WeightsError):
        ExLlamaV2(ExLlamaV2Config(str(d))).load(device="cpu")


def test_integer_float_weight_in_the_cli_and_the_converter(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                            ) -> None:
    from exlpy.cli.main import main
    from exlpy.convert import convert

    name = "model.layers.0.mlp.up_proj.weight"
    d = _retype(shared_path("models", "tiny-llama-fp16"), tmp_path / "m", [name], torch.int16)
    assert main(["generate", "--model", str(d), "--prompt", "Hi", "--max-new-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert "integer type" in err and name in err and "Traceback" not in err
    with pytest.raises(WeightsError, match="integer type") as e:
        convert(str(d), str(tmp_path / "w"), rows=2, length=32, measurement_rows=2, measurement_length=32,
                progress=False)
    assert e.value.tensor == name
