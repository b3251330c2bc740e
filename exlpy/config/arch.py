"""Declarative table of supported architectures: what differs between Llama-family models."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchParams:
    name: str
    qkv_bias: bool = False  # Qwen2: q/k/v projections carry a bias
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    supports_tp: bool = True
    # Mistral v0.1 declares a sliding window that exllamav2 ignores; we do the same, with a warning.
    ignores_sliding_window: bool = False


ARCHITECTURES: dict[str, ArchParams] = {
    "LlamaForCausalLM": ArchParams("LlamaForCausalLM"),
    "MistralForCausalLM": ArchParams("MistralForCausalLM", ignores_sliding_window=True),
    "Qwen2ForCausalLM": ArchParams("Qwen2ForCausalLM", qkv_bias=True),
    "Qwen3ForCausalLM": ArchParams("Qwen3ForCausalLM", qk_norm=True),
}
