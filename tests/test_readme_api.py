"""The README's API example and CLI commands, run as a user would run them."""

from __future__ import annotations

import subprocess
import sys

import torch

from exlpy.demo import DEMO_MODEL_DIR
from tests.conftest import child_env


def test_readme_api_script() -> None:
    from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Tokenizer

    config = ExLlamaV2Config(DEMO_MODEL_DIR); config.prepare()  # noqa: E702 - exactly as in the README
    model = ExLlamaV2(config)
    cache = ExLlamaV2Cache(model, lazy=True)
    model.load_autosplit(cache, progress=True)
    tokenizer = ExLlamaV2Tokenizer(config)
    ids = tokenizer.encode("Hello", add_bos=True)
    logits = model.forward(ids, cache)
    assert logits.shape == (1, ids.shape[1], config.vocab_size)
    assert cache.current_seq_len == ids.shape[1]
    assert torch.isfinite(logits).all()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exlpy", *args], capture_output=True, text=True, timeout=120,
                          env=child_env())


def test_cli_generate_demo_greedy_text() -> None:
    r = _cli("generate", "", "--greedy", "--max-new-tokens", "24")
    assert r.returncode == 0, r.stderr
    # The demo model's known greedy continuation of BOS (../shared/README.md).
    assert r.stdout.strip().lstrip('"').startswith("Echoes of vectors unfold, a gentle hum")
    assert "tokens/s" in r.stderr


def test_cli_generate_sampling_is_seeded() -> None:
    a = _cli("generate", "Once upon a time", "--seed", "7", "-n", "20")
    b = _cli("generate", "Once upon a time", "--seed", "7", "-n", "20")
    assert a.returncode == 0 and a.stdout == b.stdout and a.stdout.startswith("Once upon a time")


def test_cli_errors_are_one_line() -> None:
    r = _cli("generate", "--model", "/nonexistent/model", "hi")
    assert r.returncode == 1
    assert "model directory not found: /nonexistent/model" in r.stderr and "Traceback" not in r.stderr
