"""Whole EXL2 models through the public API on the CPU: logits and greedy tokens equal the references."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config
from exlpy.quant.exl2 import EXL2Linear
from tests.conftest import logits_tol, rel_err, shared_path


def _load(name: str) -> tuple[ExLlamaV2, ExLlamaV2Cache, dict[str, torch.Tensor]]:
    d = shared_path("models", name)
    model = ExLlamaV2(ExLlamaV2Config(str(d)))
    cache = ExLlamaV2Cache(model, lazy=True)
    model.load_autosplit(cache)
    f = safe_open(str(d / "reference.safetensors"), "pt")
    ref = {k: f.get_tensor(k) for k in f.keys() if not k.startswith("dq.")}
    return model, cache, ref


def _greedy(model: ExLlamaV2, cache: ExLlamaV2Cache, ids: torch.Tensor, n: int) -> torch.Tensor:
    cache.current_seq_len = 0
    logits = model.forward(ids, cache)
    out = []
    tok = logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(n):
        out.append(tok.item())
        if len(out) == n:
            break
        tok = model.forward(tok, cache)[:, -1].argmax(-1, keepdim=True)
    return torch.tensor(out)


@pytest.mark.parametrize("name", ["tiny-llama-exl2-2.5", "tiny-llama-exl2-4.0", "tiny-llama-exl2-6.0",
                                  "tiny-llama-exl2-8.0"])
def test_tiny_logits_and_greedy(name: str) -> None:
    model, cache, ref = _load(name)
    assert isinstance(model.modules[-1].linear, EXL2Linear)
    logits = model.forward(ref["input_ids"])[0]
    assert rel_err(logits, ref["logits"]) <= logits_tol(model, 1e-3)
    assert torch.equal(_greedy(model, cache, ref["input_ids"], 32), ref["greedy_32"])


def test_smollm2_logits_and_greedy() -> None:
    model, cache, ref = _load("smollm2-135m-exl2-4.0")
    ids = ref["input_ids"]
    logits = model.forward(ids, cache)[0]
    tol = logits_tol(model, 1e-3)
    assert rel_err(logits[-8:], ref["logits_last8"]) <= tol
    lse = torch.logsumexp(logits.double(), -1).float().cpu()
    assert (lse - ref["logits_lse"]).abs().max().item() <= tol * ref["logits_lse"].abs().max().item()
    assert torch.equal(logits.argmax(-1).cpu(), ref["logits_argmax"])
    assert torch.equal(_greedy(model, cache, ids, 32), ref["greedy_32"])
