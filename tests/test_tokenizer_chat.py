"""Chat templates: the four real templates render as HF transformers renders them; errors are typed."""

from __future__ import annotations

import pytest

from exlpy.tokenizer import ChatTemplateError, ExLlamaV2Tokenizer, render_chat_template
from tests.conftest import shared_path

TEMPLATES = [
    ("Qwen-Qwen2.5-7B-Instruct", "", "<|im_end|>"),
    ("meta-llama-Llama-3.1-8B-Instruct", "<|begin_of_text|>", "<|eot_id|>"),
    ("meta-llama-Llama-3.2-3B-Instruct", "<|begin_of_text|>", "<|eot_id|>"),
    ("mistralai-Mistral-Nemo-Instruct-2407", "<s>", "</s>"),
]
CONVERSATION = [
    {"role": "system", "content": "You are terse. Ünïcode is fine: 中文 😀"},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "number"}, "b": {"type": "number"}}}}}]


def template(name: str) -> str:
    return shared_path("tokenizers", "testvectors-llamacpp", "templates", f"{name}.jinja").read_text()


@pytest.mark.parametrize(("name", "bos", "eos"), TEMPLATES)
@pytest.mark.parametrize("gen_prompt", [True, False])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_matches_transformers(name: str, bos: str, eos: str, gen_prompt: bool, tools: list | None) -> None:
    hf = pytest.importorskip("transformers.utils.chat_template_utils")
    tmpl = template(name)
    # Llama 3.2 puts today's date in via strftime_now; pin it so both renderings agree.
    extra = {"date_string": "01 Jan 2025"}
    ours = render_chat_template(tmpl, CONVERSATION, add_generation_prompt=gen_prompt, bos_token=bos,
                                eos_token=eos, tools=tools, **extra)
    (ref,), _ = hf.render_jinja_template(conversations=[CONVERSATION], tools=tools, chat_template=tmpl,
                                         add_generation_prompt=gen_prompt, bos_token=bos, eos_token=eos, **extra)
    assert ours == ref
    assert "And 3+3?" in ours and "中文 😀" in ours


def test_known_rendering() -> None:
    """A hand-checked rendering, independent of any reference library."""
    out = render_chat_template(template("Qwen-Qwen2.5-7B-Instruct"), [{"role": "user", "content": "hi"}])
    assert out == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                   "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    out = render_chat_template(template("meta-llama-Llama-3.1-8B-Instruct"), [{"role": "user", "content": "hi"}],
                               add_generation_prompt=False, bos_token="<|begin_of_text|>")
    assert out == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: "
                   "December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>"
                   "\n\nhi<|eot_id|>")


def test_strftime_now_available() -> None:
    out = render_chat_template(template("meta-llama-Llama-3.2-3B-Instruct"), [{"role": "user", "content": "x"}])
    assert "Today Date: 26 Jul 2024" not in out  # the template took the strftime_now branch


def test_raise_exception_is_typed() -> None:
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="must alternate"):
        render_chat_template(template("mistralai-Mistral-Nemo-Instruct-2407"), bad)


def test_sandbox_and_syntax_errors() -> None:
    with pytest.raises(ChatTemplateError, match="failed to render"):
        render_chat_template("{{ messages.__class__.__mro__[1].__subclasses__() }}", [])
    with pytest.raises(ChatTemplateError, match="does not parse"):
        render_chat_template("{% for m in messages %}", [])
    with pytest.raises(ChatTemplateError, match="list of dicts"):
        render_chat_template("{{ messages }}", ["not a dict"])  # type: ignore[list-item]


def test_apply_chat_template_from_tokenizer_config() -> None:
    tok = ExLlamaV2Tokenizer(str(shared_path("models", "smollm2-135m-exl2-4.0")))
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hello!"}])
    assert prompt.endswith("<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(prompt, encode_special_tokens=True)[0].tolist()
    assert ids.count(tok.single_id("<|im_start|>")) == prompt.count("<|im_start|>")
    assert tok.decode(ids, decode_special_tokens=True) == prompt
    custom = tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{{ bos_token }}"
                                     "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    assert custom == tok.bos_token + "[user]x"


def test_no_template_is_a_clear_error() -> None:
    tok = ExLlamaV2Tokenizer(str(shared_path("models", "aidreams260K")))
    with pytest.raises(ChatTemplateError, match="no chat_template.*aidreams260K"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
