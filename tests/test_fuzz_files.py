"""Hypothesis fuzzing of what a model directory holds: safetensors headers, config.json and the tokenizer files.

Every generated case must either work (and then give finite logits / a usable tokenizer) or raise an exlpy
error (ExlpyError): never a raw exception from Python, torch, safetensors, tokenizers or jinja2, a hang, or NaN
output. Examples are derived from a fixed seed so CI runs the same cases every time (within a minute);
EXLPY_FUZZ_EXAMPLES=N scales the number up, EXLPY_FUZZ_RANDOM=1 explores new cases.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import exlpy  # noqa: E402
from exlpy import ExLlamaV2, ExLlamaV2Config, ExLlamaV2Tokenizer  # noqa: E402
from exlpy.errors import ExlpyError  # noqa: E402
from exlpy.weights.safetensors_index import SafetensorsIndex  # noqa: E402

SCALE = int(os.environ.get("EXLPY_FUZZ_EXAMPLES", "0")) or None


def fuzz(n: int) -> Any:
    return settings(max_examples=SCALE or n, deadline=None, database=None,
                    derandomize=os.environ.get("EXLPY_FUZZ_RANDOM", "") in ("", "0"),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large])


# JSON-ish values, hostile ones included: huge and negative ints, NaN/inf, wrong types, nesting.
SCALARS = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-2**70, max_value=2**70),
    st.sampled_from([0, 1, -1, 2, 7, 64, 10**9, 10**12, 2**63, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-300, 1e300, 0.5, 2.0, math.nan, math.inf, -math.inf]),
    st.text(max_size=12),
    st.sampled_from(["", "F32", "F16", "BF16", "I32", "silu", "llama3", "yarn", "linear", "LlamaForCausalLM"]),
)
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                    max_leaves=12)


def _expect_typed(fn: Any) -> Any:
    """Run fn; an ExlpyError is a pass (returns None), any other exception fails the example."""
    try:
        return fn()
    except ExlpyError:
        return None


# --- safetensors ---------------------------------------------------------------------------------------------

DTYPE_SIZE = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "U8": 1, "I64": 8}


@st.composite
def safetensors_file(draw: Any) -> bytes:
    """A plausible file (valid header + data) damaged in one or more ways, or a wholly hostile header."""
    n = draw(st.integers(0, 4))
    header: dict[str, Any] = {}
    off = 0
    for i in range(n):
        dt = draw(st.sampled_from(list(DTYPE_SIZE)))
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        size = math.prod(shape) * DTYPE_SIZE[dt]
        header[f"t{i}"] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + size]}
        off += size
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.one_of(st.dictionaries(st.text(max_size=5), st.text(max_size=5),
                                                                max_size=2), JSON))
    if header and draw(st.booleans()):  # shift one tensor's data: gaps, overlaps, data past the end
        name = draw(st.sampled_from(sorted(k for k in header if k != "__metadata__") or ["-"]))
        if name in header:
            delta = draw(st.integers(-4, 4))
            b, e = header[name]["data_offsets"]
            header[name]["data_offsets"] = [max(0, b + delta), max(0, b + delta) + (e - b)]
            off = max(off, max(0, b + delta) + (e - b)) if draw(st.booleans()) else off
    for _ in range(draw(st.integers(0, 3))):  # damage entries: any field becomes any JSON value
        if header:
            name = draw(st.sampled_from(sorted(header)))
            entry = header[name]
            if isinstance(entry, dict) and draw(st.booleans()):
                entry[draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra"]))] = draw(JSON)
            else:
                header[name] = draw(JSON)
    if draw(st.integers(0, 9)) == 0:
        header = draw(JSON)
    raw = json.dumps(header).encode()
    data = bytes(draw(st.integers(0, 255)) for _ in range(off)) if off < 64 else b"\1" * off
    data = data[:max(0, off + draw(st.integers(-3, 3)))] if draw(st.booleans()) else data + b"\0" * draw(
        st.integers(0, 2))
    hlen = struct.pack("<Q", len(raw))
    if draw(st.integers(0, 5)) == 0:
        hlen = struct.pack("<q", draw(st.integers(-2**63, 2**63 - 1)))
    blob = hlen + raw + data
    if draw(st.integers(0, 4)) == 0 and blob:  # byte-level damage
        pos = draw(st.integers(0, len(blob) - 1))
        blob = blob[:pos] + bytes([draw(st.integers(0, 255))]) + blob[pos + 1:]
    if draw(st.integers(0, 9)) == 0:
        blob = blob[:draw(st.integers(0, len(blob)))]
    return blob


@fuzz(400)
@given(blob=safetensors_file())
def test_fuzz_safetensors_headers(blob: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        Path(d, "model.safetensors").write_bytes(blob)

        def read_all() -> dict[str, torch.Tensor]:
            idx = SafetensorsIndex(d)
            out = {n: idx.get(n) for n in idx.tensors}
            idx.close()
            return out

        tensors = _expect_typed(read_all)
        if tensors is not None:  # accepted: then every tensor reads back with its declared shape
            header = json.loads(blob[8:8 + struct.unpack("<Q", blob[:8])[0]])
            for name, t in tensors.items():
                assert list(t.shape) == header[name]["shape"]


# --- config.json -----------------------------------------------------------------------------------------------

CONFIG_KEYS = ["architectures", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "intermediate_size", "num_hidden_layers", "vocab_size", "max_position_embeddings", "rms_norm_eps",
               "rope_theta", "rope_scaling", "rope_parameters", "bos_token_id", "eos_token_id", "pad_token_id",
               "tie_word_embeddings", "text_config", "quantization_config", "hidden_act", "sliding_window",
               "torch_dtype", "attention_bias", "partial_rotary_factor", "original_max_position_embeddings"]
ROPE = st.fixed_dictionaries({"rope_type": st.sampled_from(["linear", "llama3", "yarn", "default", "dynamic"])},
                             optional={k: st.one_of(SCALARS, st.floats(0.1, 64)) for k in
                                       ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                                        "original_max_position_embeddings", "type")})


@fuzz(200)
@given(changes=st.dictionaries(st.sampled_from(CONFIG_KEYS),
                               st.one_of(JSON, ROPE, st.lists(JSON, min_size=1, max_size=2)), min_size=1, max_size=4),
       garbage=st.one_of(st.none(), st.binary(max_size=40)))
def test_fuzz_config_json(tiny_llama_dir: Path, changes: dict[str, Any], garbage: bytes | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        for f in tiny_llama_dir.iterdir():
            if f.suffix == ".safetensors":
                os.symlink(f, d / f.name)
        cfg = json.loads((tiny_llama_dir / "config.json").read_text())
        cfg.update(changes)
        (d / "config.json").write_bytes(garbage if garbage is not None else json.dumps(cfg).encode())

        def build_and_run() -> torch.Tensor:
            model = ExLlamaV2(ExLlamaV2Config(str(d)))
            model.load(device="cpu")
            return model.forward(torch.tensor([[1, 2, 3, 4]]))

        logits = _expect_typed(build_and_run)
        if logits is not None:  # accepted settings must give usable output, not NaN
            assert torch.isfinite(logits).all(), changes


# --- tokenizer files --------------------------------------------------------------------------------------------

DEMO = Path(exlpy.__file__).parent / "demo" / "aidreams260K"
TOKENIZER_FILES = ["tokenizer_config.json", "added_tokens.json", "config.json", "generation_config.json",
                   "tokenizer.json"]
TOK_KEYS = ["added_tokens_decoder", "bos_token", "eos_token", "pad_token", "chat_template", "bos_token_id",
            "eos_token_id", "pad_token_id", "model", "added_tokens", "normalizer", "pre_tokenizer", "decoder"]
TEMPLATE = st.one_of(
    st.text(max_size=30),
    st.sampled_from(["{{ messages[0]['content'] }}", "{% for m in messages %}{{ m.role }}{% endfor %}",
                     "{{ 1/0 }}", "{% for i in range(10**9) %}{% endfor %}", "{{ 'x' * 10**10 }}", "{{ x.y.z }}",
                     "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "{{ raise_exception('no') }}",
                     "{{ bos_token }}{% if add_generation_prompt %}A:{% endif %}", "{% if %}",
                     "{{ '%99999999d' % 1 }}"]),
)


def _mutate(value: Any, path: list[Any], new: Any) -> Any:
    """value with the node at `path` (indices into nested lists/dicts, taken modulo their size) replaced."""
    if not path or not isinstance(value, (dict, list)) or not value:
        return new
    if isinstance(value, dict):
        key = sorted(value)[path[0] % len(value)]
        return {**value, key: _mutate(value[key], path[1:], new)}
    i = path[0] % len(value)
    return value[:i] + [_mutate(value[i], path[1:], new)] + value[i + 1:]


@fuzz(150)
@given(file=st.sampled_from(TOKENIZER_FILES),
       content=st.one_of(st.dictionaries(st.sampled_from(TOK_KEYS), st.one_of(JSON, TEMPLATE), max_size=3),
                         st.dictionaries(st.text(max_size=6), st.one_of(st.integers(-5, 10**9), JSON), max_size=3),
                         JSON, st.binary(max_size=30)),
       path=st.lists(st.integers(0, 10**6), max_size=5), node=JSON)
def test_fuzz_tokenizer_files(file: str, content: Any, path: list[int], node: Any) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        for f in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
            if (DEMO / f).exists():
                shutil.copy(DEMO / f, d / f)
        if file == "tokenizer.json":  # a valid tokenizer.json with one subtree replaced
            data = _mutate(json.loads((DEMO / "tokenizer.json").read_text()), path, node)
            (d / file).write_text(json.dumps(data))
        elif file == "tokenizer_config.json" and isinstance(content, dict):
            base = json.loads((DEMO / file).read_text())
            (d / file).write_text(json.dumps({**base, **content}))
        else:
            (d / file).write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())

        def use() -> str:
            tok = ExLlamaV2Tokenizer(str(d))
            ids = tok.encode("Echoes of vectors, 123 \u00e9\u6f22")
            text = tok.decode(ids[0])
            assert isinstance(text, str)
            tok.get_id_to_piece_list(True)
            if tok.tokenizer_config.get("chat_template") is not None:
                tok.apply_chat_template([{"role": "user", "content": "hi"}])
            return text

        _expect_typed(use)
