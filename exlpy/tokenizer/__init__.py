"""Tokenizer: tokenizer.json or tokenizer.model behind exllamav2's `ExLlamaV2Tokenizer` API."""

from exlpy.tokenizer.base import ExLlamaV2TokenizerBase
from exlpy.tokenizer.chat import ChatTemplateError, render_chat_template
from exlpy.tokenizer.hf import ExLlamaV2TokenizerHF
from exlpy.tokenizer.spm import ExLlamaV2TokenizerSPM
from exlpy.tokenizer.stream import StreamDecoder
from exlpy.tokenizer.tokenizer import ExLlamaV2Tokenizer
from exlpy.version import __version__

__all__ = ["ChatTemplateError", "ExLlamaV2Tokenizer", "ExLlamaV2TokenizerBase", "ExLlamaV2TokenizerHF",
           "ExLlamaV2TokenizerSPM", "StreamDecoder", "__version__", "render_chat_template"]
