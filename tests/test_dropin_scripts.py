"""exllamav2-style scripts (tests/dropin_scripts/, `import exllamav2`) run unchanged on exlpy: in-process under
exlpy.compat.install(), and as a subprocess through the `exlpy-as-exllamav2` switch. Their outputs are checked
against oracles: greedy tokens from plain forward passes, and HF transformers for YaRN."""

from __future__ import annotations

import json
import runpy
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import exlpy.compat
from tests.conftest import child_env, logits_tol, rel_err, shared_path
from tests.hf_models import make_hf_model
from tests.test_generator_helpers import argmax_tokens

SCRIPTS = Path(__file__).parent / "dropin_scripts"


@pytest.fixture
def compat() -> Iterator[None]:
    exlpy.compat.install()
    yield
    exlpy.compat.uninstall()


def run_script(name: str, *args: str) -> tuple[dict[str, Any], dict[str, Any], str]:
    """Run a script as `python name args...` would (in this process); (its RESULT, its globals, its stdout)."""
    import contextlib
    import io

    path = SCRIPTS / name
    saved = sys.argv
    sys.argv = [str(path), *args]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            g = runpy.run_path(str(path), run_name="__main__")
    finally:
        sys.argv = saved
    text = out.getvalue()
    lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"{name} printed no RESULT line:\n{text}"
    return json.loads(lines[-1][len("RESULT "):]), g, text


def greedy_cached(model: Any, ids: list[int], n: int, stop: set[int]) -> list[int]:
    """Greedy tokens through a fresh cache (the oracle for scripts on a larger model)."""
    from exlpy import ExLlamaV2Cache

    cache = ExLlamaV2Cache(model, max_seq_len=len(ids) + n + 1)
    logits = model.forward(torch.tensor([ids]), cache)
    out: list[int] = []
    while len(out) < n:
        t = int(logits[0, -1, :model.config.vocab_size].argmax())
        out.append(t)
        if t in stop:
            break
        logits = model.forward(torch.tensor([[t]]), cache)
    return out


def completion_text(tok: Any, prompt: list[int], new: list[int]) -> str:
    """Text of `new` after `prompt` (decoded in context: SentencePiece drops a leading space on its own)."""
    head = tok.decode(torch.tensor(prompt))
    return tok.decode(torch.tensor(prompt + new))[len(head):]


def demo() -> str:
    return str(shared_path("models", "aidreams260K"))


@pytest.mark.slow
def test_chat_with_model_init(compat: None) -> None:
    smol = str(shared_path("models", "smollm2-135m-exl2-4.0"))
    r, g, out = run_script("chat_model_init.py", "-m", smol, "-l", "512", "-gs", "auto", "-maxr", "6",
                           "--turn", "Hi!", "--turn", "What is the capital of France?")
    assert " -- Options: ['gpu_split: auto', 'length: 512']" in out
    assert r["loaded"] and r["max_seq_len"] == 512 and r["cache"] == "ExLlamaV2Cache"
    model, tokenizer = g["model"], g["tokenizer"]
    stop = {tokenizer.eos_token_id}
    for ctx, ids, text in zip(r["contexts"], r["response_ids"], r["responses"]):
        assert ids == greedy_cached(model, ctx, 6, stop)
        assert text == completion_text(tokenizer, ctx, ids)
    assert "Paris" in r["responses"][1]  # a real model answering through exllamav2's chat setup
    assert r["sd_stats"] == [0.0, 0.0, len(r["response_ids"][1]), 0, 0]  # reset_sd_stats() before the turn


def test_streaming_with_warmup(compat: None) -> None:
    r, g, out = run_script("streaming_warmup.py", "-m", demo(), "-n", "12")
    assert r["is_base"] == "ExLlamaV2BaseGenerator"  # the streaming generator subclasses the base one
    assert r["tokens"] == argmax_tokens(g["model"], torch.tensor([r["prompt_ids"]]), 12)
    assert r["simple"] == r["text"] == completion_text(g["tokenizer"], r["prompt_ids"], r["tokens"])
    assert "Response generated in" in out and r["interval"] > 0


def test_dynamic_generation_shows_job_sequences(compat: None) -> None:
    r, g, _ = run_script("dynamic_sequences.py", "-m", demo(), "-n", "10")
    tok = g["tokenizer"]
    for i, (job, prompt) in enumerate(zip(r["jobs"], g["prompts"])):
        ids = tok.encode(prompt, add_bos=True)
        assert job["input"] == r["before"][i] == tok.decode(ids, decode_special_tokens=True)[0]
        completion = argmax_tokens(g["model"], ids, 10)
        assert job["sequence"] == ids[0].tolist() + completion
        assert job["completion"] == completion_text(tok, ids[0].tolist(), completion)
        assert job["new_tokens"] == 10 and job["prompt_tokens"] == ids.shape[1]
        assert job["kv_position"] == len(job["sequence"]) - 1


def test_list_of_caches(compat: None) -> None:
    r, g, _ = run_script("multicache.py", "-m", demo(), "-n", "8")
    tok, model = g["tokenizer"], g["model"]
    for prompt, ids, n in zip(g["prompts"], r["ids"], r["cache_lens"]):
        p = tok.encode(prompt, add_bos=True)
        assert ids == p[0].tolist() + argmax_tokens(model, p, 8)
        assert n == p.shape[1] - 1 + 8  # each cache advanced by its own row only


def test_banned_strings_report_suppressed_text(compat: None) -> None:
    r, g, out = run_script("banned_strings.py", "-m", demo(), "-b", " PROBABILITY", "-n", "12")
    model, tok = g["model"], g["tokenizer"]
    prompt = tok.encode(g["args"].prompt, add_bos=True)
    assert "probability" in r["plain"]  # the unbanned greedy text says it...
    assert "probability" not in r["banned"].lower()  # ...the banned one does not
    (text, tokens), = r["suppressed"]
    assert text == " probability" and completion_text(tok, prompt[0].tolist(), tokens) == text
    assert tokens == r["plain_ids"][:len(tokens)]
    assert "[suppressed: ' probability'" in out
    # Oracle: greedy with the match's first token banned where it was sampled.
    logits = model.forward(prompt)[0, -1].clone()
    logits[tokens[0]] = float("-inf")
    first = int(logits.argmax())
    expect = [first] + argmax_tokens(model, torch.cat([prompt, torch.tensor([[first]])], dim=1), 11)
    assert r["banned_ids"] == expect
    assert r["stream_suppressed"] == [" probability"]
    assert r["streamed"].startswith(r["banned"]) or r["banned"].startswith(r["streamed"])


def test_compat_switch_runs_script_in_subprocess() -> None:
    script = str(SCRIPTS / "streaming_warmup.py")
    runner = Path(sys.executable).parent / "exlpy-as-exllamav2"
    cmds = [[sys.executable, "-m", "exlpy.compat", script]]
    if runner.exists():  # the console script of an installed checkout
        cmds.append([str(runner), script])
    outputs = []
    for cmd in cmds:
        p = subprocess.run([*cmd, "-m", demo(), "-n", "6"], capture_output=True, text=True, timeout=300,
                           env=child_env())
        assert p.returncode == 0, p.stderr
        outputs.append(json.loads(p.stdout.splitlines()[-1][len("RESULT "):]))
    assert all(o["tokens"] == outputs[0]["tokens"] and len(o["tokens"]) == 6 for o in outputs)


# --- YaRN (and llama3) set through config attributes, against HF transformers' own scaling ---------------------
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def _plain_and_scaled(tmp_path: Path, scaling: dict[str, Any]) -> tuple[str, Any]:
    """A plain random HF Llama on disk, and the same weights as an HF model with `scaling` (the reference)."""
    plain = tmp_path / "plain"
    weights = make_hf_model(plain, "llama", seed=3).state_dict()
    ref = make_hf_model(tmp_path / "scaled", "llama", rope_scaling=scaling)
    ref.load_state_dict(weights)  # RoPE tables are buffers outside the state dict: they keep the scaling
    return str(plain), ref


def _logits(model_dir: str, set_attrs: Any, ids: torch.Tensor) -> torch.Tensor:
    from exlpy import ExLlamaV2, ExLlamaV2Config

    config = ExLlamaV2Config(model_dir)
    set_attrs(config)
    model = ExLlamaV2(config)
    model.load(device="cpu")
    return model.forward(ids)


@pytest.mark.parametrize("case", ["yarn", "llama3"])
def test_rope_scaling_through_config_attributes_matches_hf(tmp_path: Path, case: str) -> None:
    scaling = YARN if case == "yarn" else LLAMA3
    plain, ref_model = _plain_and_scaled(tmp_path, scaling)

    def set_yarn(c: Any) -> None:  # as exllamav2 scripts (and model_init's --rope_yarn) do
        c.alt_rope_method = "yarn"
        c.yarn_rope_factor = 4.0
        c.yarn_rope_original_max_position_embeddings = 64

    def set_llama3(c: Any) -> None:
        c.alt_rope_method = "llama3"
        c.l3_rope_factor, c.l3_rope_low_freq_factor, c.l3_rope_high_freq_factor = 8.0, 1.0, 4.0
        c.l3_rope_original_max_position_embeddings = 64

    ids = torch.randint(0, 320, (1, 200), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = ref_model(ids).logits
    scaled = _logits(plain, set_yarn if case == "yarn" else set_llama3, ids)
    unscaled = _logits(plain, lambda c: None, ids)
    assert rel_err(scaled, ref) <= 1e-4
    assert rel_err(unscaled, ref) > 1e-3  # ten times the tolerance: the attributes made the difference


def test_model_init_rope_yarn_flag_matches_hf(tmp_path: Path) -> None:
    import argparse

    from exlpy import model_init

    # Without YaRN in config.json, --rope_yarn takes the model's max_seq_len (256) as the original length.
    plain, ref_model = _plain_and_scaled(tmp_path, {"rope_type": "yarn", "factor": 2.0,
                                                    "original_max_position_embeddings": 256})
    shutil.copy(shared_path("models", "aidreams260K", "tokenizer.json"), plain)  # init() also loads a tokenizer
    parser = argparse.ArgumentParser()
    model_init.add_args(parser)
    args = parser.parse_args(["-m", plain, "-ry", "2", "-l", "1024"])
    model, _ = model_init.init(args, quiet=True)
    cfg = model.config
    assert (cfg.alt_rope_method, cfg.yarn_rope_factor, cfg.yarn_rope_original_max_position_embeddings,
            cfg.max_seq_len) == ("yarn", 2.0, 256, 1024)
    ids = torch.randint(0, 320, (1, 200), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = ref_model(ids).logits
    assert rel_err(model.forward(ids), ref) <= logits_tol(model, 1e-4)  # init() loads onto a GPU where there is one
