"""Hostile tokenizer files and chat templates: TokenizerError / ChatTemplateError naming the file or template,
no allocation proportional to an id, and templates that cannot hang or exhaust memory."""

from __future__ import annotations

import json
import shutil
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

import exlpy
from exlpy.errors import TokenizerError
from exlpy.tokenizer import ChatTemplateError, ExLlamaV2Tokenizer, chat_sandbox, render_chat_template
from exlpy.tokenizer.chat_sandbox import MAX_OUTPUT_CHARS
from tests.conftest import shared_path

DEMO = Path(exlpy.__file__).parent / "demo" / "aidreams260K"  # a real 512-piece tokenizer.json, in the package


@pytest.fixture(params=["json", "spm"])
def tok_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    d = tmp_path / "tok"
    d.mkdir()
    if request.param == "json":
        shutil.copy(DEMO / "tokenizer.json", d)
    else:
        shutil.copy(shared_path("tokenizers", "llama2", "tokenizer.model"), d)
    return d


def _write(d: Path, name: str, content: Any) -> Path:
    p = d / name
    p.write_text(content if isinstance(content, str) else json.dumps(content))
    return p


# (file, content, words the message must hold)
FILE_CASES: dict[str, tuple[str, Any, str]] = {
    "tokenizer_config_list": ("tokenizer_config.json", [1, 2], "must hold a JSON object"),
    "tokenizer_config_not_json": ("tokenizer_config.json", "{", "cannot read tokenizer_config.json"),
    "tokenizer_config_deep": ("tokenizer_config.json", "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    "decoder_list": ("tokenizer_config.json", {"added_tokens_decoder": [{"content": "<x>"}]},
                     "added_tokens_decoder must map"),
    "decoder_string_id": ("tokenizer_config.json", {"added_tokens_decoder": {"abc": {"content": "<x>"}}},
                          "'abc'"),
    "decoder_negative_id": ("tokenizer_config.json", {"added_tokens_decoder": {"-3": {"content": "<x>"}}},
                            "'-3'"),
    "decoder_entry_not_object": ("tokenizer_config.json", {"added_tokens_decoder": {"600": "<x>"}},
                                 "added_tokens_decoder['600']"),
    "decoder_huge_id": ("tokenizer_config.json", {"added_tokens_decoder": {"100000000": {"content": "<x>"}}},
                        "id 100000000"),
    "added_tokens_list": ("added_tokens.json", ["<x>"], "must hold a JSON object"),
    "added_tokens_string_id": ("added_tokens.json", {"<x>": "abc"}, "'abc'"),
    "added_tokens_digit_string_id": ("added_tokens.json", {"<x>": "600"}, "'600'"),
    "added_tokens_negative_id": ("added_tokens.json", {"<x>": -1}, "'-1'"),
    "added_tokens_float_id": ("added_tokens.json", {"<x>": 600.5}, "'600.5'"),
    "added_tokens_huge_id": ("added_tokens.json", {"<x>": 10**8}, "id 100000000"),
    "added_tokens_bool_id": ("added_tokens.json", {"<x>": True}, "'True'"),
    "config_ids_strings": ("config.json", {"bos_token_id": "1"}, "bos_token_id"),
    "config_list": ("config.json", [1], "must hold a JSON object"),
    "generation_config_string_eos": ("generation_config.json", {"eos_token_id": ["x"]}, "eos_token_id"),
}


@pytest.mark.parametrize("case", list(FILE_CASES))
def test_bad_tokenizer_file(tok_dir: Path, case: str) -> None:
    name, content, words = FILE_CASES[case]
    path = _write(tok_dir, name, content)
    tracemalloc.start()
    try:
        with pytest.raises(TokenizerError) as e:
            ExLlamaV2Tokenizer(str(tok_dir))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert words in str(e.value) and str(path) in str(e.value)
    assert peak < 64 * 2**20, f"{peak / 2**20:.0f} MiB allocated"  # nothing sized from an id


def test_added_token_ids_near_the_vocabulary_still_load(tok_dir: Path) -> None:
    """Real added tokens sit right after the vocabulary (and may leave small gaps)."""
    base = ExLlamaV2Tokenizer(str(tok_dir)).actual_vocab_size
    _write(tok_dir, "added_tokens.json", {"<a>": base, "<b>": base + 5})
    _write(tok_dir, "tokenizer_config.json", {"added_tokens_decoder": {str(base + 1): {"content": "<c>"}}})
    tok = ExLlamaV2Tokenizer(str(tok_dir))
    assert tok.single_id("<b>") == base + 5 and tok.actual_vocab_size == base + 6


@pytest.mark.parametrize("what", ["tokenizer_config.json", "added_tokens.json"])
def test_tokenizer_file_that_is_a_directory(tok_dir: Path, what: str) -> None:
    (tok_dir / what).mkdir()
    with pytest.raises(TokenizerError, match="not a regular file") as e:
        ExLlamaV2Tokenizer(str(tok_dir))
    assert str(tok_dir / what) in str(e.value)


@pytest.mark.parametrize("text", ["abc\ud800", "\udfff", "ok \ud83d then"])
def test_encode_lone_surrogate(tok_dir: Path, text: str) -> None:
    tok = ExLlamaV2Tokenizer(str(tok_dir))
    with pytest.raises(TokenizerError, match="lone surrogate") as e:
        tok.encode(text)
    assert f"index {next(i for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF)}" in str(e.value)
    with pytest.raises(TokenizerError, match="lone surrogate"):
        tok.num_tokens(text)
    assert tok.decode(tok.encode("abc")[0]) == "abc"  # the tokenizer still works


MSGS = [{"role": "user", "content": "hi"}]
# (template, words the message must hold)
TEMPLATES: dict[str, tuple[str, str]] = {
    "division_by_zero": ("{{ 1/0 }}", "ZeroDivisionError"),
    "range_1e9": ("{% for i in range(10**9) %}{% endfor %}", "Range too big"),
    "recursive_macro": ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recursed too deeply"),
    "string_times_1e10": ("{{ 'x'*10**10 }}", "'*'"),
    "nested_range_loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                           "loop iterations"),
    "exponential_macro": ("{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(60) }}",
                          "loop iterations"),
    "doubling_concat": ("{% set ns = namespace(s='x') %}{% for i in range(99) %}{% set ns.s = ns.s ~ ns.s %}"
                        "{% endfor %}", "'~'"),
    "doubling_plus": ("{% set ns = namespace(s='x') %}{% for i in range(99) %}{% set ns.s = ns.s + ns.s %}"
                      "{% endfor %}", "'+'"),
    "loop_over_long_string": ("{% set s = 'x'*100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
                              "loop iterations"),
    "center_filter": ("{{ 'x'|center(10**10) }}", "filter 'center'"),
    "ljust_method": ("{{ 'x'.ljust(10**10) }}", "ljust"),
    "percent_width": ("{{ '%1000000000d' % 1 }}", "width"),
    "format_filter_width": ("{{ '%1000000000d'|format(1) }}", "width"),
    "str_format_width": ("{{ '{:>1000000000}'.format(1) }}", "width"),
    "huge_power": ("{{ 2**(10**10) }}", "'**'"),
    "output_too_long": ("{% for i in range(100000) %}{{ 'y'*1000 }}{% endfor %}", "output longer"),
    "syntax_error": ("{% for %}", "does not parse"),
    "raise_exception": ("{{ raise_exception('no system role') }}", "no system role"),
    "unsafe_attribute": ("{{ messages.__class__.__mro__ }}", "unsafe"),
}


@pytest.mark.parametrize("case", list(TEMPLATES))
def test_hostile_chat_template(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    template, words = TEMPLATES[case]
    if case == "exponential_macro":  # macro calls cost ~5 us each: the real 10^6-step limit takes seconds
        monkeypatch.setattr(chat_sandbox, "MAX_STEPS", 50_000)
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError) as e:
        render_chat_template(template, MSGS, source="TEMPLATE-X")
    assert time.monotonic() - t0 < 30  # every hang ends (the limits: 10^6 steps, 10 s)
    assert "TEMPLATE-X" in str(e.value) and words in str(e.value)


def test_template_error_names_the_model_file(tmp_path: Path) -> None:
    d = tmp_path / "tok"
    shutil.copytree(DEMO, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ChatTemplateError) as e:
        ExLlamaV2Tokenizer(str(d)).apply_chat_template(MSGS)
    assert str(d / "tokenizer_config.json") in str(e.value) and "'default'" in str(e.value)
    with pytest.raises(ChatTemplateError, match="passed to apply_chat_template"):
        ExLlamaV2Tokenizer(str(d)).apply_chat_template(MSGS, chat_template="{{ 1/0 }}")


def test_real_templates_render_within_limits() -> None:
    """Loops, macros, namespaces, filters and long conversations stay far inside the limits."""
    template = ("{% macro fmt(m) %}<|{{ m.role }}|>{{ m.content | trim }}{% endmacro %}"
                "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ fmt(m) }}"
                "{% if not loop.last %}\n{% endif %}{% endfor %}{{ ns.n }}{{ '%5d' % 42 }}{{ '{:>3}'.format(7) }}")
    msgs = [{"role": "user" if i % 2 else "assistant", "content": f" message {i} " * 20} for i in range(2000)]
    out = render_chat_template(template, msgs)
    assert out.endswith("2000   42  7") and out.count("<|user|>") == 1000
    big = [{"role": "user", "content": "z" * (MAX_OUTPUT_CHARS // 4)}]
    assert len(render_chat_template("{{ messages[0].content }}", big)) == MAX_OUTPUT_CHARS // 4
