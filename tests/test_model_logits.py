"""Logits equal HF transformers (fp32, CPU) for every supported architecture and the real tiny models.

load() places the model as a user would (load_autosplit: the GPU where there is one, which computes in fp16);
tolerances follow where it ran: TOL for fp32 on the CPU, tests/conftest.py's half-precision bound elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config
from exlpy.errors import ConfigError
from tests.conftest import logits_tol, rel_err, shared_path
from tests.hf_models import make_hf_model

TOL = 1e-4  # fp32 on the CPU, as HF's reference


def load(path: str | Path, max_seq_len: int | None = None) -> tuple[ExLlamaV2, ExLlamaV2Cache]:
    config = ExLlamaV2Config(str(path))
    if max_seq_len is not None:
        config.max_seq_len = max_seq_len
    model = ExLlamaV2(config)
    cache = ExLlamaV2Cache(model, lazy=True)
    model.load_autosplit(cache)
    return model, cache


ARCH_CASES = {
    "llama": ("llama", {}),
    "llama_bias_tied": ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}),
    "llama_head_dim": ("llama", {"head_dim": 32}),
    "llama_mha": ("llama", {"num_key_value_heads": 4}),
    "llama3_rope": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "linear_rope": ("llama", {"rope_scaling": {"type": "linear", "factor": 2.0}}),
    "yarn_rope": ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 64}}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3_tied": ("qwen3", {"tie_word_embeddings": True}),
}


@pytest.mark.parametrize("case", sorted(ARCH_CASES))
def test_architectures_match_hf(tmp_path: Path, case: str) -> None:
    arch, overrides = ARCH_CASES[case]
    hf = make_hf_model(tmp_path, arch, **overrides)
    model, _ = load(tmp_path)
    # Long enough that RoPE scaling variants change the logits well beyond the tolerance.
    ids = torch.randint(0, 320, (2, 200), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    out = model.forward(ids)
    assert out.shape == ref.shape
    assert rel_err(out, ref) <= logits_tol(model, TOL)


@pytest.mark.parametrize("name", ["tiny-llama-fp16", "aidreams260K", "stories260K"])
def test_shared_models_match_hf(name: str) -> None:
    from transformers import AutoModelForCausalLM

    path = shared_path("models", name)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model, _ = load(path)
    ids = torch.randint(0, 512, (1, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits
    tol = logits_tol(model, TOL)
    if tol > TOL:
        # Half precision (a GPU): a trained model can be far more sensitive to it than random ones. stories260K's
        # logits move 6.9e-2 (fp16) and 0.38 (bf16) in HF's own half-precision forward: allow twice HF's own error.
        dtype = model.config.compute_dtype(model.modules[model.head_layer_idx].device)
        half = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        with torch.no_grad():
            tol = max(tol, 2 * rel_err(half(ids).logits, ref))
    assert rel_err(model.forward(ids), ref) <= tol


def test_incremental_decode_equals_full_forward(tmp_path: Path) -> None:
    make_hf_model(tmp_path, "qwen2")
    model, cache = load(tmp_path, max_seq_len=128)
    ids = torch.randint(0, 320, (1, 50), generator=torch.Generator().manual_seed(3))
    full = model.forward(ids)
    parts = [model.forward(ids[:, :20], cache), model.forward(ids[:, 20:41], cache)]
    parts += [model.forward(ids[:, i:i + 1], cache) for i in range(41, 50)]
    assert cache.current_seq_len == 50
    assert rel_err(torch.cat(parts, dim=1), full) <= logits_tol(model, TOL)


def test_chunked_prefill_equals_full_forward(tmp_path: Path) -> None:
    make_hf_model(tmp_path, "llama")
    model, cache = load(tmp_path, max_seq_len=128)
    model.config.max_input_len = 16  # forces 4 chunks through the cache
    ids = torch.randint(0, 320, (1, 60), generator=torch.Generator().manual_seed(4))
    model.config.max_input_len = 64
    full = model.forward(ids)
    model.config.max_input_len = 16
    chunked = model.forward(ids, cache)
    assert cache.current_seq_len == 60
    assert rel_err(chunked, full) <= logits_tol(model, TOL)


def test_preprocess_only_and_last_id_only(tmp_path: Path) -> None:
    make_hf_model(tmp_path, "llama")
    model, cache = load(tmp_path, max_seq_len=64)
    ids = torch.randint(0, 320, (1, 30), generator=torch.Generator().manual_seed(5))
    full = model.forward(ids)
    assert model.forward(ids[:, :-1], cache, preprocess_only=True) is None
    assert cache.current_seq_len == 29
    last = model.forward(ids[:, -1:], cache, last_id_only=True)
    assert last.shape == (1, 1, 320)
    tol = logits_tol(model, TOL)
    assert rel_err(last[0, 0], full[0, -1]) <= tol
    cache.current_seq_len = 0
    only_last = model.forward(ids, cache, last_id_only=True)
    assert only_last.shape == (1, 1, 320) and rel_err(only_last[0, 0], full[0, -1]) <= tol


def test_left_padded_batch_matches_single_rows(tmp_path: Path) -> None:
    make_hf_model(tmp_path, "llama")
    model, _ = load(tmp_path, max_seq_len=64)
    a = torch.randint(3, 320, (1, 12), generator=torch.Generator().manual_seed(6))
    b = torch.randint(3, 320, (1, 8), generator=torch.Generator().manual_seed(7))
    batch = torch.zeros(2, 12, dtype=torch.long)
    batch[0] = a[0]
    batch[1, 4:] = b[0]
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, :4] = False
    out = model.forward(batch, input_mask=mask, position_offsets=torch.tensor([0, -4]))
    tol = logits_tol(model, TOL)
    assert rel_err(out[0], model.forward(a)[0]) <= tol
    assert rel_err(out[1, 4:], model.forward(b)[0]) <= tol


def test_unload_and_reload(tmp_path: Path) -> None:
    make_hf_model(tmp_path, "llama")
    model, cache = load(tmp_path, max_seq_len=64)
    ids = torch.randint(0, 320, (1, 10))
    before = model.forward(ids)
    model.unload()
    assert not model.loaded and all(m.device is None for m in model.modules)
    model.load()
    assert rel_err(model.forward(ids), before) == 0.0


def test_left_padded_batch_with_cache_matches_single_rows(tmp_path: Path) -> None:
    """Padding keys are masked and RoPE positions shifted, while cache rows keep physical slots."""
    make_hf_model(tmp_path, "llama")
    model, _ = load(tmp_path, max_seq_len=64)
    cache = ExLlamaV2Cache(model, batch_size=2, max_seq_len=64)
    a = torch.randint(3, 320, (1, 12), generator=torch.Generator().manual_seed(8))
    b = torch.randint(3, 320, (1, 8), generator=torch.Generator().manual_seed(9))
    batch = torch.zeros(2, 12, dtype=torch.long)
    batch[0], batch[1, 4:] = a[0], b[0]
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[1, :4] = False
    offsets = torch.tensor([0, -4])
    out = model.forward(batch[:, :10], cache, input_mask=mask, position_offsets=offsets)
    out2 = model.forward(batch[:, 10:], cache, input_mask=mask, position_offsets=offsets)
    full = torch.cat([out, out2], dim=1)
    tol = logits_tol(model, TOL)
    assert rel_err(full[0], model.forward(a)[0]) <= tol
    assert rel_err(full[1, 4:], model.forward(b)[0]) <= tol


def test_max_output_len_chunks_the_head(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_hf_model(tmp_path, "llama")
    model, cache = load(tmp_path, max_seq_len=64)
    ids = torch.randint(0, 320, (2, 21), generator=torch.Generator().manual_seed(8))
    full = model.forward(ids)
    head = model.modules[model.head_layer_idx]
    widths: list[int] = []
    forward = head._logits  # one pass of the head's projection
    monkeypatch.setattr(head, "_logits", lambda x, batch: widths.append(x.shape[1]) or forward(x, batch))
    model.config.max_output_len = 8
    chunked = model.forward(ids)
    assert widths == [8, 8, 5]  # no head pass over more than max_output_len positions
    assert chunked.shape == full.shape and chunked.dtype == torch.float32
    tol = logits_tol(model, TOL)
    assert rel_err(chunked, full) <= tol
    widths.clear()
    last = model.forward(ids[:1], cache, last_id_only=True)  # one position: one head pass
    assert widths == [1] and rel_err(last[0, 0], full[0, -1]) <= tol


def test_arch_compat_overrides_is_callable_and_changes_nothing(tmp_path: Path) -> None:
    make_hf_model(tmp_path, "mistral")
    config = ExLlamaV2Config(str(tmp_path))
    before = (config.no_flash_attn, config.no_xformers, config.no_sdpa, config.no_graphs)
    config.arch_compat_overrides()
    config.arch_compat_overrides(quiet=True, warn_only=True)
    assert (config.no_flash_attn, config.no_xformers, config.no_sdpa, config.no_graphs) == before
    with pytest.raises(ConfigError, match="prepare"):
        ExLlamaV2Config().arch_compat_overrides()
