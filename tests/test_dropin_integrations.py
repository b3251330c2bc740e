"""Libraries built on exllamav2 run unchanged on exlpy through the compat switch: lm-format-enforcer's and
formatron's exllamav2 integrations constrain real SmolLM2 (EXL2, CPU) to JSON that validates against the schema."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

import exlpy.compat
from tests.conftest import shared_path

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
PROMPT = "<|im_start|>user\nGive me a person as JSON.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def smol() -> Iterator[tuple[Any, Any, Any]]:
    path = shared_path("models", "smollm2-135m-exl2-4.0")
    exlpy.compat.install()
    try:
        from exllamav2 import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Tokenizer
        from exllamav2.generator import ExLlamaV2DynamicGenerator

        config = ExLlamaV2Config(str(path))
        config.max_seq_len = 512
        model = ExLlamaV2(config)
        cache = ExLlamaV2Cache(model, max_seq_len=512, lazy=True)
        model.load_autosplit(cache)
        tokenizer = ExLlamaV2Tokenizer(config)
        yield model, tokenizer, ExLlamaV2DynamicGenerator(model, cache, tokenizer)
    finally:
        exlpy.compat.uninstall()


def _generate(gen: Any, filters: list[Any]) -> Any:
    from exllamav2.generator import ExLlamaV2Sampler

    text = gen.generate(PROMPT, max_new_tokens=64, filters=filters, encode_special_tokens=True,
                        gen_settings=ExLlamaV2Sampler.Settings.greedy(), completion_only=True)
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    return value


@pytest.mark.slow
def test_lm_format_enforcer_integration(smol: tuple[Any, Any, Any]) -> None:
    pytest.importorskip("lmformatenforcer")
    from lmformatenforcer import JsonSchemaParser
    from lmformatenforcer.integrations.exllamav2 import (
        ExLlamaV2TokenEnforcerFilter,
        build_token_enforcer_tokenizer_data,
    )

    _, tokenizer, gen = smol
    data = build_token_enforcer_tokenizer_data(tokenizer)
    _generate(gen, [ExLlamaV2TokenEnforcerFilter(JsonSchemaParser(SCHEMA), data)])


@pytest.mark.slow
def test_formatron_integration(smol: tuple[Any, Any, Any]) -> None:
    pytest.importorskip("formatron")
    from formatron.formatter import FormatterBuilder
    from formatron.integrations.exllamav2 import create_formatter_filter
    from formatron.schemas.json_schema import create_schema

    model, tokenizer, gen = smol
    builder = FormatterBuilder()
    schema = create_schema({**SCHEMA, "$id": "https://exlpy.test/person",
                            "$schema": "https://json-schema.org/draft/2020-12/schema"})
    builder.append_line(f"{builder.json(schema, capture_name='json')}")
    _generate(gen, [create_formatter_filter(model, tokenizer, builder)])
