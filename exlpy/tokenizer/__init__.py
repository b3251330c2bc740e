"""Tokenizer: tokenizer.json or tokenizer.model behind exllamav2's `ExLlamaV2Tokenizer` API."""

from exlpy.tokenizer.chat import ChatTemplateError, render_chat_template
from exlpy.tokenizer.stream import StreamDecoder
from exlpy.tokenizer.tokenizer import ExLlamaV2Tokenizer

__all__ = ["ChatTemplateError", "ExLlamaV2Tokenizer", "StreamDecoder", "render_chat_template"]
