"""benchmarks/lora.py's timing code on a tiny CPU model (the GPU run is the lead's): it must run end to end
and its adapter cases must really use the adapters."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from exlpy import ExLlamaV2, ExLlamaV2Config, ExLlamaV2Lora
from exlpy.lora import registry_of
from tests.tp_util import make_model_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import lora as bench  # noqa: E402


def test_benchmark_functions_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "DEV", torch.device("cpu"))
    d = make_model_dir(tmp_path / "m", hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=300)
    shape = dict(hidden_size=64, head_dim=16, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 num_hidden_layers=2)
    model = ExLlamaV2(ExLlamaV2Config(str(d)))
    model.load(device="cpu")
    loras = [ExLlamaV2Lora.from_directory(model, bench.write_adapter(str(tmp_path / f"a{i}"), shape, 16, i))
             for i in range(2)]
    err, effect = bench.check_graph_step(model, loras[0])
    assert err < 1e-5 and effect > 1e-4
    assert bench.decode_b1(model, [loras[0]], 8, 3).tokens_per_s > 0
    reg = registry_of(model)
    slots = [reg.acquire([lr]) for lr in loras]
    r = bench.decode_paged(model, [slots[i % 2] if i < 4 else -1 for i in range(6)], 20, 2, page=16)
    assert r.batch == 6 and r.tokens_per_s > 0
    assert bench.decode_paged(model, None, 20, 2, page=16).batch == 32
