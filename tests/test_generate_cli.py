"""`exlpy generate`'s token budget: `-n N` prints exactly N tokens' text, also when a token's text is held back
(a partial UTF-8 character) and with speculative steps that emit several tokens at once."""

from __future__ import annotations

import re

import pytest
import torch

from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Tokenizer
from exlpy.cli.main import main
from exlpy.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler
from exlpy.generator.streaming import ExLlamaV2StreamingGenerator
from tests.conftest import shared_path

PROMPT = "Hello"  # tiny-llama-fp16's greedy continuation is mostly bytes of incomplete characters


def _tiny() -> tuple[ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Tokenizer]:
    cfg = ExLlamaV2Config(str(shared_path("models", "tiny-llama-fp16")))
    model = ExLlamaV2(cfg)
    cache = ExLlamaV2Cache(model, max_seq_len=256, lazy=True)
    model.load_autosplit(cache)
    return model, cache, ExLlamaV2Tokenizer(cfg)


def _greedy_ids(n: int) -> list[int]:
    model, cache, tok = _tiny()
    gen = ExLlamaV2DynamicGenerator(model, cache, tok)
    job = ExLlamaV2DynamicJob(tok.encode(PROMPT, add_bos=True), n, gen_settings=ExLlamaV2Sampler.Settings.greedy(),
                              stop_conditions=sorted(tok.stop_token_ids))
    gen.enqueue(job)
    ids: list[int] = []
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            if r["stage"] == "streaming" and "token_ids" in r:
                ids += r["token_ids"].view(-1).tolist()
    return ids


@pytest.mark.parametrize("n, extra", [(2, []), (10, []), (7, ["--ngram-draft"]), (7, ["--draft-model", "tiny"])])
def test_generate_prints_exactly_n_tokens(n: int, extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = str(shared_path("models", "tiny-llama-fp16"))
    extra = [model_dir if a == "tiny" else a for a in extra]
    assert main(["generate", PROMPT, "--model", model_dir, "--greedy", "-n", str(n), *extra]) == 0
    out = capsys.readouterr()
    assert re.search(rf"\[{n} tokens in ", out.err), out.err
    ids = _greedy_ids(n)
    assert len(ids) == n
    tok = _tiny()[2]
    assert out.out == PROMPT + tok.decode(torch.tensor(ids)) + "\n"  # the held-back bytes of those n, no more


def test_end_stream_releases_held_text() -> None:
    model, cache, tok = _tiny()
    gen = ExLlamaV2StreamingGenerator(model, cache, tok)
    gen.begin_stream_ex(tok.encode(PROMPT, add_bos=True), ExLlamaV2Sampler.Settings.greedy())
    text, released = "", 0
    for _ in range(4):
        r = gen.stream_ex()
        text += r["chunk"]
        released += r["chunk_token_ids"].shape[-1]
    assert gen.new_tokens == 4 and released < 4  # some tokens' text is held back (partial characters)
    r = gen.end_stream()
    assert r["eos"] and r["eos_reason"] == "max_new_tokens" and released + r["chunk_token_ids"].shape[-1] == 4
    assert text + r["chunk"] == tok.decode(gen.sequence_ids[0, -4:])
    assert not gen.active


def test_seed_past_64_bits_is_a_clean_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", PROMPT, "--model", str(shared_path("models", "tiny-llama-fp16")), "-n", "2",
                 "--seed", str(2**70)]) == 1
    err = capsys.readouterr().err
    assert "--seed must fit in 64 bits" in err and "Traceback" not in err
