"""Constrained decoding: exllamav2's filter API (`filters=` on jobs, `generate()`, the streaming and base
generators) and a grammar filter over llguidance (JSON schema, regex, Lark / GBNF)."""

from exlpy.generator.filters.base import ExLlamaV2Filter
from exlpy.generator.filters.grammar import ExLlamaV2GrammarFilter
from exlpy.generator.filters.prefix import ExLlamaV2PrefixFilter
from exlpy.generator.filters.select import ExLlamaV2SelectFilter

__all__ = ["ExLlamaV2Filter", "ExLlamaV2GrammarFilter", "ExLlamaV2PrefixFilter", "ExLlamaV2SelectFilter"]
