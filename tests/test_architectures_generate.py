"""The new architectures through the dynamic generator (paged cache, batched rows of different lengths):
greedy tokens equal an oracle of full transformers forwards, with prompts longer than the sliding windows."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch

from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Tokenizer
from exlpy.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler
from tests.arch_models import make_arch_model
from tests.conftest import shared_path
from tests.test_generator_helpers import drain

VOCAB = 512  # the borrowed tokenizer's (aidreams260K)


def _oracle(ref: object, ids: torch.Tensor, n: int) -> list[int]:
    out, seq = [], ids.clone()
    for _ in range(n):
        with torch.no_grad():
            t = int(ref(seq).logits[0, -1].argmax())  # type: ignore[operator]
        out.append(t)
        seq = torch.cat([seq, torch.tensor([[t]])], dim=1)
    return out


@pytest.mark.parametrize("case", ["gemma2", "cohere", "cohere2", "gpt2", "phi3_window", "mixtral", "qwen3_moe",
                                  "dbrx"])
def test_dynamic_generator_greedy_equals_reference(tmp_path: Path, case: str) -> None:
    src = shared_path("models", "aidreams260K")
    vocab_key = "vocab_size"
    ref = make_arch_model(tmp_path, case, **{vocab_key: VOCAB})
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, tmp_path / f)
    config = ExLlamaV2Config(str(tmp_path))
    config.max_seq_len = 256
    model = ExLlamaV2(config)
    cache = ExLlamaV2Cache(model, max_seq_len=512, lazy=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.load_autosplit(cache)
    gen = ExLlamaV2DynamicGenerator(model, cache, ExLlamaV2Tokenizer(config))
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, VOCAB, (1, n), generator=g) for n in (21, 9)]
    n_new = 10
    jobs = [ExLlamaV2DynamicJob(p, n_new, gen_settings=ExLlamaV2Sampler.Settings.greedy(), stop_conditions=[])
            for p in prompts]
    gen.enqueue(jobs)
    res = drain(gen)
    for p, j in zip(prompts, jobs):
        assert res[j]["tokens"] == _oracle(ref, p, n_new)
