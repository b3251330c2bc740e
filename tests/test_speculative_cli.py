"""`exlpy generate` / `exlpy serve` with speculative decoding: --draft-model, --ngram-draft; /health acceptance."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import pytest

from tests.conftest import child_env, shared_path


def _generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exlpy", "generate", "", "--greedy", "-n", "24", *args],
                          capture_output=True, text=True, timeout=180, env=child_env())


def test_cli_generate_with_draft_model_and_ngram_equals_plain() -> None:
    plain = _generate()
    assert plain.returncode == 0, plain.stderr
    for extra in (["--ngram-draft"], ["--draft-model", str(shared_path("models", "tiny-llama-fp16")),
                                      "--num-draft-tokens", "3"]):
        r = _generate(*extra)
        assert r.returncode == 0, r.stderr
        assert r.stdout == plain.stdout and "drafted tokens accepted" in r.stderr
    bad = _generate("--ngram-draft", "--draft-model", str(shared_path("models", "tiny-llama-fp16")))
    assert bad.returncode == 1 and "alternatives" in bad.stderr and "Traceback" not in bad.stderr


def test_serve_flags_and_health_shows_acceptance() -> None:
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from exlpy.cli.main import build_parser
    from exlpy.server import create_app
    from tests.test_server_helpers import NO_EOS, make_state, prompt_ids, reference_greedy

    args = build_parser().parse_args(["serve", "--draft-model", "/d", "--ngram-draft", "--num-draft-tokens", "3"])
    assert (args.draft_model, args.ngram_draft, args.num_draft_tokens) == ("/d", True, 3)
    state = make_state(use_ngram_draft=True)

    async def main() -> tuple[Any, Any]:
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as c:
            try:
                r = await c.post("/v1/completions", json={"prompt": "Echoes of", "max_tokens": 30, "temperature": 0,
                                                          "logit_bias": NO_EOS})
                return r, (await c.get("/health")).json()
            finally:
                await state.bridge.stop()

    r, health = asyncio.run(main())
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == reference_greedy(prompt_ids("Echoes of"), 30, banned_eos=True)
    sd = health["speculative"]
    assert sd["drafter"] == "ngram" and sd["drafted"] > 0 and 0.0 <= sd["acceptance"] <= 1.0
