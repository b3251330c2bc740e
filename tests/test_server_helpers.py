"""Helpers for the server tests (no tests here): a served demo model, a reference greedy run, slowed steps."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Tokenizer  # noqa: E402
from exlpy.demo import DEMO_MODEL_DIR  # noqa: E402
from exlpy.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler  # noqa: E402
from exlpy.server import ServerState, state_from_generator  # noqa: E402

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
NO_EOS = {"2": -100.0}  # logit_bias that keeps the demo model from ending early (its EOS id is 2)


@pytest.fixture(autouse=True)
def single_torch_thread() -> Any:
    """One intra-op thread while a test runs: the demo model gains nothing from more, and on a busy 2-core machine
    a second thread makes every step wait for a descheduled peer (4 ms steps turn into 10-50 ms)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@lru_cache(maxsize=1)
def demo() -> tuple[Any, Any]:
    """(model, tokenizer) of the bundled demo model (context 128), loaded once."""
    cfg = ExLlamaV2Config(DEMO_MODEL_DIR)
    model = ExLlamaV2(cfg)
    model.load()
    return model, ExLlamaV2Tokenizer(cfg)


def make_generator(pages: int = 16, tokenizer: Any = None, **kw: Any) -> ExLlamaV2DynamicGenerator:
    model, tok = demo()
    cache = ExLlamaV2Cache(model, max_seq_len=pages * 256)
    return ExLlamaV2DynamicGenerator(model, cache, tokenizer or tok, max_chunk_size=256, **kw)


def make_state(pages: int = 16, max_queue: int = 64, tokenizer: Any = None, **kw: Any) -> ServerState:
    return state_from_generator(make_generator(pages, tokenizer, **kw), "aidreams260K", max_queue=max_queue)


def chat_tokenizer(tmp_path: Path) -> Any:
    """The demo tokenizer from a copy of the model dir whose tokenizer_config.json has a chat template."""
    d = tmp_path / "demo_chat"
    shutil.copytree(DEMO_MODEL_DIR, d)
    cfg_path = d / "tokenizer_config.json"
    tc = json.loads(cfg_path.read_text())
    tc["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(tc))
    return ExLlamaV2Tokenizer(ExLlamaV2Config(str(d)))


def reference_greedy(ids: torch.Tensor, n: int, banned_eos: bool = False) -> str:
    """What the dynamic generator itself produces greedily for `ids` (a fresh generator, one job)."""
    gen = make_generator()
    bias = None
    if banned_eos:
        bias = torch.zeros(512)
        bias[2] = -100.0
    settings = ExLlamaV2Sampler.Settings.greedy(token_bias=bias)
    job = ExLlamaV2DynamicJob(ids, n, gen_settings=settings, stop_conditions=sorted(gen.tokenizer.stop_token_ids))
    gen.enqueue(job)
    text = ""
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            if r["stage"] == "streaming":
                text += r["text"]
    return text


def prompt_ids(text: str) -> torch.Tensor:
    return demo()[1].encode(text, add_bos=True)


def slow_steps(gen: Any, seconds: float) -> None:
    """Make each generator step take at least `seconds`, so that concurrent requests reliably overlap."""
    real = gen.iterate

    def iterate() -> list[dict[str, Any]]:
        time.sleep(seconds)
        return real()

    gen.iterate = iterate


async def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.002)


def sse_events(body: str) -> list[Any]:
    """Parse an SSE body into JSON payloads; the final "[DONE]" stays a string."""
    out: list[Any] = []
    for block in body.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out
