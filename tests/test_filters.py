"""Constrained decoding: the filter protocol, prefix / select filters, the llguidance grammar filter (JSON
schema, regex, Lark, GBNF) through the dynamic, streaming and base generators, and the device bitmask op."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch

from exlpy.errors import GrammarError
from exlpy.generator import ExLlamaV2BaseGenerator, ExLlamaV2Sampler, ExLlamaV2StreamingGenerator
from exlpy.generator.dynamic import ExLlamaV2DynamicJob
from exlpy.generator.filters import (
    ExLlamaV2Filter,
    ExLlamaV2GrammarFilter,
    ExLlamaV2PrefixFilter,
    ExLlamaV2SelectFilter,
)
from exlpy.kernels import reference
from tests.smollm2_util import chat_prompt, smollm2

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
GREEDY = ExLlamaV2Sampler.Settings.greedy()


def run(prompt: str, filters: list[Any], n: int = 60, settings: Any = None, **kw: Any) -> tuple[str, dict[str, Any]]:
    _, _, gen = smollm2()
    out, last = gen.generate(prompt, n, gen_settings=settings or GREEDY, encode_special_tokens=True,
                             completion_only=True, filters=filters, return_last_results=True, **kw)
    return out, last


def test_bitmask_reference_matches_token_sets() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 100, generator=g)
    allowed = [{0, 31, 32, 99}, set(range(40, 60)), {5}]
    words = torch.zeros(3, 4, dtype=torch.int32)
    for r, ids in enumerate(allowed):
        for t in ids:
            words[r, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
    out = reference.apply_token_bitmask(logits, words)
    for r, ids in enumerate(allowed):
        finite = set(torch.isfinite(out[r]).nonzero().view(-1).tolist())
        assert finite == ids
        assert torch.equal(out[r, sorted(ids)], logits[r, sorted(ids)])
    # Words shorter than the vocab exclude the tail.
    assert not torch.isfinite(reference.apply_token_bitmask(logits, words[:, :2])[:, 64:]).any()


def test_json_schema_output_validates() -> None:
    model, tok, _ = smollm2()
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                               "pets": {"type": "array", "items": {"type": "string"},
                                                        "maxItems": 3}},
              "required": ["name", "age", "pets"], "additionalProperties": False}
    f = ExLlamaV2GrammarFilter.json_schema(model, tok, schema)
    out, last = run(chat_prompt("Describe a person in JSON."), [f], 80)
    jsonschema.validate(json.loads(out), schema)
    assert last["eos_reason"] in ("stop_token", "end_filter")


def test_regex_lark_and_gbnf() -> None:
    model, tok, _ = smollm2()
    sampled = ExLlamaV2Sampler.Settings(temperature=1.0, top_k=0, top_p=1.0)
    f = ExLlamaV2GrammarFilter.regex(model, tok, r"\d{3}-\d{4}")
    out, _ = run(chat_prompt("Give me a phone number."), [f], 20, settings=sampled, seed=3)
    assert re.fullmatch(r"\d{3}-\d{4}", out), out
    f = ExLlamaV2GrammarFilter.lark(model, tok, 'start: "The answer is " ("yes" | "no") "."')
    out, _ = run(chat_prompt("Is the sky blue?"), [f], 20)
    assert out in ("The answer is yes.", "The answer is no.")
    f = ExLlamaV2GrammarFilter.gbnf(model, tok, 'root ::= "color: " ("red" | "green" | "blue")')
    out, _ = run(chat_prompt("Name a color."), [f], 20, settings=sampled, seed=1)
    assert out in ("color: red", "color: green", "color: blue")


def test_invalid_grammars_raise_named_errors() -> None:
    model, tok, _ = smollm2()
    with pytest.raises(GrammarError, match="json_schema.*Invalid type: foo"):
        ExLlamaV2GrammarFilter.json_schema(model, tok, {"type": "foo"})
    with pytest.raises(GrammarError, match="json_schema: not valid JSON"):
        ExLlamaV2GrammarFilter.json_schema(model, tok, "{nope")
    with pytest.raises(GrammarError, match="lark grammar"):
        ExLlamaV2GrammarFilter.lark(model, tok, 'start: undefined_rule')


def test_select_and_prefix_filters() -> None:
    model, tok, _ = smollm2()
    f = ExLlamaV2SelectFilter(model, tok, ["Paris", "London", "Berlin"])
    out, last = run(chat_prompt("What is the capital of France?"), [f], 20)
    assert out == "Paris" and last["eos_reason"] == "end_filter"
    f = ExLlamaV2SelectFilter(model, tok, ["YES", "NO"], case_insensitive=True)
    out, _ = run(chat_prompt("Is water wet? Answer yes or no."), [f], 20)
    assert out.lower() in ("yes", "no")
    f = ExLlamaV2PrefixFilter(model, tok, ["The answer is", "Answer:"])
    out, _ = run(chat_prompt("What is 2+2?"), [f], 12)
    assert out.startswith("The answer is") or out.startswith("Answer:")
    assert len(out) > len("Answer:") + 3  # free text after the prefix


def test_device_mask_path_equals_sampler_path_in_every_generator() -> None:
    """The dynamic generator masks on the device (greedy argmax there), the streaming generator too; the
    base generator uses the sampler's mask path. Same schema, same greedy output."""
    model, tok, gen = smollm2()
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer"}},
              "required": ["city", "population"]}
    prompt = chat_prompt("Give a city and its population as JSON.")
    f = ExLlamaV2GrammarFilter.json_schema(model, tok, schema)
    ids = tok.encode(prompt, encode_special_tokens=True)
    assert ExLlamaV2DynamicJob(ids, 40, gen_settings=GREEDY, filters=[f]).device_masked()
    dynamic, _ = run(prompt, [f], 40)
    from exlpy import ExLlamaV2Cache

    sg = ExLlamaV2StreamingGenerator(model, ExLlamaV2Cache(model, max_seq_len=512), tok)
    sg.begin_stream_ex(ids, GREEDY, filters=[f])
    streamed = ""
    for _ in range(40):
        r = sg.stream_ex()
        streamed += r["chunk"]
        if r["eos"]:
            break
    bg = ExLlamaV2BaseGenerator(model, ExLlamaV2Cache(model, max_seq_len=512), tok)
    base = bg.generate_simple(prompt, GREEDY, 40, encode_special_tokens=True, completion_only=True, filters=[f],
                              stop_token=tok.eos_token_id)
    assert dynamic == streamed == base
    jsonschema.validate(json.loads(dynamic), schema)


def test_background_evaluation_and_clone() -> None:
    model, tok, _ = smollm2()
    f = ExLlamaV2GrammarFilter.regex(model, tok, r"ab+c")
    f.begin("")
    f.background_prepare_logit_mask()
    assert f.background_result is not None
    assert f.get_next(mask=True) is True and f.background_result is None
    a = tok.single_id("a")
    pass_tokens, _ = f.next()
    assert a in pass_tokens and tok.single_id("b") not in pass_tokens
    f.feed(a)
    g = f.clone()
    assert tok.single_id("b") in g.next()[0] and tok.single_id("b") in f.next()[0]
    with pytest.raises(GrammarError, match="does not continue the grammar"):
        f.feed(tok.single_id("x"))


def test_custom_filter_subclass_and_base_errors() -> None:
    model, tok, _ = smollm2()

    class OnlyDigits(ExLlamaV2Filter):
        def begin(self, prefix_str: str) -> None:
            self.n = 0

        def feed(self, token: int) -> None:
            self.n += 1

        def next(self) -> tuple[set[int], set[int]]:
            digits = {tok.single_id(str(d)) for d in range(10)}
            return digits, (digits if self.n >= 3 else set())

        def use_background_worker(self) -> bool:
            return True

    out, last = run(chat_prompt("Pick a number."), [OnlyDigits(model, tok)], 10)
    assert out.isdigit() and len(out) == 4 and last["eos_reason"] == "end_filter"
    with pytest.raises(NotImplementedError, match="begin"):
        ExLlamaV2Filter(model, tok).begin("")


def test_grammar_filter_on_a_sentencepiece_tokenizer() -> None:
    """Without tokenizer.json llguidance gets the vocabulary token by token (SentencePiece bytes)."""
    from exlpy import ExLlamaV2Tokenizer
    from tests.conftest import shared_path

    tok = ExLlamaV2Tokenizer(str(shared_path("tokenizers", "llama2")), force_spm=True)
    assert tok.backend.kind == "spm"
    f = ExLlamaV2GrammarFilter.regex(None, tok, r"hello [0-9]+")
    f.begin("")
    allowed, _ = f.next()
    assert tok.piece_to_id["hello"] in allowed and tok.piece_to_id["\u2581hello"] not in allowed
    f.feed(tok.piece_to_id["hello"])
    allowed, end = f.next()
    assert tok.piece_to_id["\u2581"] in allowed and tok.piece_to_id["world"] not in allowed and not end
    f.feed(tok.piece_to_id["\u2581"])
    f.feed(tok.piece_to_id["4"])
    allowed, end = f.next()
    assert tok.eos_token_id in allowed and tok.eos_token_id in end and tok.piece_to_id["2"] in allowed
