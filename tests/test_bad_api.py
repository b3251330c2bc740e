"""API misuse: bad ids, empty batches, impossible cache sizes and devices, degenerate logits. Each is a typed
exlpy error naming the argument or limit, raised before any device work; a failed forward leaves the cache as
it was."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config
from exlpy.cache import ExLlamaV2Cache_Q4
from exlpy.errors import ConfigError, DeviceError, InputError, SamplerError, SequenceLengthError
from exlpy.generator.sampler import ExLlamaV2Sampler

VOCAB = 320  # tests/hf_models.py BASE


@pytest.fixture(scope="module")
def model(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ExLlamaV2:
    """The tiny Llama with a 128-position context."""
    d = tmp_path_factory.mktemp("api") / "m"
    shutil.copytree(tiny_llama_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = 128
    (d / "config.json").write_text(json.dumps(cfg))
    m = ExLlamaV2(ExLlamaV2Config(str(d)))
    m.load(device="cpu")
    return m


def _ids(*shape: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(sum(shape)))


# (input_ids, error class, words the message must hold)
FORWARD_CASES: dict[str, tuple[Any, type, str]] = {
    "id_equal_vocab": (torch.tensor([[1, 2, VOCAB]]), InputError, f"token id {VOCAB}"),
    "id_far_past_vocab": (torch.tensor([[10**9]]), InputError, "vocab_size"),
    "negative_id": (torch.tensor([[5, -1, 6]]), InputError, "token id -1"),
    "nan_ids": (torch.tensor([[1.0, math.nan]]), InputError, "dtype torch.float32"),
    "float_ids": (torch.tensor([[1.0, 2.0]]), InputError, "integer token ids"),
    "bool_ids": (torch.tensor([[True]]), InputError, "integer token ids"),
    "list_ids": ([[1, 2]], InputError, "torch tensor"),
    "zero_rows": (torch.zeros(0, 5, dtype=torch.long), InputError, "batch of 0 rows"),
    "no_tokens": (torch.zeros(1, 0, dtype=torch.long), InputError, "no tokens"),
    "3d_ids": (torch.zeros(1, 2, 3, dtype=torch.long), InputError, "[batch, tokens]"),
    "past_context": (_ids(1, 200), SequenceLengthError, "max_seq_len 128"),
}


@pytest.mark.parametrize("case", list(FORWARD_CASES))
def test_forward_bad_ids_without_cache(model: ExLlamaV2, case: str) -> None:
    ids, err, words = FORWARD_CASES[case]
    with pytest.raises(err) as e:
        model.forward(ids)
    assert words in str(e.value)


@pytest.mark.parametrize("case", ["id_equal_vocab", "negative_id", "nan_ids", "zero_rows", "no_tokens"])
def test_forward_bad_ids_with_cache(model: ExLlamaV2, case: str) -> None:
    ids, err, words = FORWARD_CASES[case]
    cache = ExLlamaV2Cache(model, max_seq_len=128)
    model.forward(_ids(1, 7), cache, preprocess_only=True)
    with pytest.raises(err, match=words.replace("[", r"\[")):
        model.forward(ids, cache)
    assert cache.current_seq_len == 7


def test_past_context_with_a_larger_cache(model: ExLlamaV2) -> None:
    """A cache longer than the model's context: positions past max_seq_len have no RoPE table."""
    cache = ExLlamaV2Cache(model, max_seq_len=512)
    model.forward(_ids(1, 100), cache, preprocess_only=True)
    with pytest.raises(SequenceLengthError, match=r"100 cached \+ 29 new tokens exceed the model's max_seq_len 128"):
        model.forward(_ids(1, 29), cache)
    assert cache.current_seq_len == 100
    assert model.forward(_ids(1, 28), cache).shape == (1, 28, VOCAB)


def test_good_ids_of_every_integer_dtype(model: ExLlamaV2) -> None:
    ids = _ids(1, 6)
    ref = model.forward(ids)
    for dt in (torch.int32, torch.int16):
        assert torch.equal(model.forward(ids.to(dt)), ref)
    assert torch.equal(model.forward(ids[0]), ref)  # 1-D ids are one sequence


@pytest.mark.parametrize("cls", [ExLlamaV2Cache, ExLlamaV2Cache_Q4])
@pytest.mark.parametrize("kwargs, words", [
    ({"max_seq_len": -5}, "max_seq_len"),
    ({"max_seq_len": 0}, "max_seq_len"),
    ({"max_seq_len": 10**12}, "max_seq_len"),
    ({"max_seq_len": 64.5}, "max_seq_len"),
    ({"max_seq_len": 64.0}, "max_seq_len"),
    ({"max_seq_len": "64"}, "max_seq_len"),
    ({"batch_size": 0}, "batch_size"),
    ({"batch_size": 2.5}, "batch_size"),
    ({"num_key_value_heads": -2}, "num_key_value_heads"),
])
def test_bad_cache_arguments(model: ExLlamaV2, cls: type, kwargs: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words) as e:
        cls(model, **kwargs)
    msg = str(e.value)
    assert "ExLlamaV2Cache" in msg and ("range" in msg or "integer" in msg)


def test_cache_limit_is_named(model: ExLlamaV2) -> None:
    with pytest.raises(ConfigError, match=r"must be in \[1, 16777216\]"):
        ExLlamaV2Cache(model, max_seq_len=10**12, lazy=True)


def test_chunked_forward_failing_in_second_chunk_keeps_cache_length(model: ExLlamaV2,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The second chunk fails (as an out-of-memory would): current_seq_len stays where it was, and the cache
    still gives the same logits as before."""
    cache = ExLlamaV2Cache(model, max_seq_len=128)
    model.forward(_ids(1, 10), cache, preprocess_only=True)
    model.config.max_input_len = 16
    head = model.modules[-1]
    calls = {"n": 0}
    real = type(head).forward

    def failing(self: Any, x: torch.Tensor, batch: Any) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated failure in the second chunk")
        return real(self, x, batch)

    try:
        monkeypatch.setattr(type(head), "forward", failing)
        with pytest.raises(RuntimeError, match="second chunk"):
            model.forward(_ids(1, 40), cache)  # chunks of 16, 16, 8
        assert calls["n"] == 2 and cache.current_seq_len == 10
        monkeypatch.undo()
        nxt = _ids(1, 5)
        fresh = ExLlamaV2Cache(model, max_seq_len=128)
        model.forward(_ids(1, 10), fresh, preprocess_only=True)
        torch.testing.assert_close(model.forward(nxt, cache), model.forward(nxt, fresh))
    finally:
        model.config.max_input_len = 2048


@pytest.mark.parametrize("device", ["cuda:99", "tpu", "not a device", 3.5])
def test_load_on_impossible_device(tiny_llama_dir: Path, device: Any) -> None:
    m = ExLlamaV2(ExLlamaV2Config(str(tiny_llama_dir)))
    with pytest.raises(DeviceError, match="load\\(device=") as e:
        m.load(device=device)
    assert repr(device) in str(e.value) and not m.loaded


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_load_cuda_without_cuda(tiny_llama_dir: Path) -> None:
    m = ExLlamaV2(ExLlamaV2Config(str(tiny_llama_dir)))
    with pytest.raises(DeviceError, match="no CUDA device is available"):
        m.load(device="cuda:0")
    m.load(device="cpu")  # nothing half-loaded stands in the way
    assert m.forward(_ids(1, 3)).shape == (1, 3, VOCAB)


Settings = ExLlamaV2Sampler.Settings
NEG = float("-inf")


def _logits(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows).unsqueeze(1)


SAMPLER_CASES: dict[str, tuple[torch.Tensor, Any, str]] = {
    "all_neg_inf": (_logits([NEG] * 8), Settings(), "the logits passed in"),
    "all_neg_inf_greedy": (_logits([NEG] * 8), Settings.greedy(), "the logits passed in"),
    "one_nan": (_logits([0.5, math.nan, 1.0, 2.0]), Settings(), "hold NaN"),
    "all_nan_greedy": (_logits([math.nan] * 4), Settings.greedy(), "hold NaN"),
    "pos_inf": (_logits([0.0, math.inf, 1.0]), Settings(top_k=0, top_p=0.0), "+inf"),
    "second_row_bad": (_logits([0.1, 0.2, 0.3], [NEG, NEG, NEG]), Settings(), "row 1"),
    "cfg_negative_nan": (_logits([0.1, 0.2], [math.nan, 0.0]), Settings(cfg_scale=1.5), "the logits passed in"),
    "nan_token_bias": (_logits([0.1, 0.2, 0.3]), Settings(token_bias=torch.tensor([0.0, math.nan, 0.0])),
                       "the logit stage"),
}


@pytest.mark.parametrize("case", list(SAMPLER_CASES))
def test_sampler_degenerate_logits(case: str) -> None:
    logits, settings, words = SAMPLER_CASES[case]
    with pytest.raises(SamplerError) as e:
        ExLlamaV2Sampler.sample(logits, settings, None, 0.5)
    assert words in str(e.value)


def test_sampler_filter_excluding_everything_left() -> None:
    """The healing/vocab masks can leave a row with only -inf: an error, not token 0."""
    logits = _logits([0.1, 0.2, 0.3, 0.4])
    with pytest.raises(SamplerError):
        ExLlamaV2Sampler.sample(logits, Settings(), None, 0.5, filters=[lambda x: torch.zeros(4, dtype=torch.bool)])


def test_sampler_partially_masked_logits_still_sample() -> None:
    logits = _logits([NEG, NEG, 0.0, NEG], [1.0, NEG, NEG, NEG])
    for settings in (Settings(), Settings.greedy(), Settings(top_k=2, top_p=0.5, min_p=0.1)):
        tok = ExLlamaV2Sampler.sample(logits, settings, None, 0.3)[0]
        assert tok.view(-1).tolist() == [2, 0]
