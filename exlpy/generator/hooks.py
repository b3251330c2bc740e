"""exllamav2's names for post-sampling hooks (`settings.post_sampling_hooks`): a hook is called with an
`ExLlamaV2PostSamplingResult` after each draw and may replace the sampled token (see sampling/hooks.py)."""

from __future__ import annotations

from collections.abc import Callable

from exlpy.generator.sampling.hooks import PostSamplingResult as ExLlamaV2PostSamplingResult

ExLlamaV2PostSamplingHook = Callable[[ExLlamaV2PostSamplingResult], None]

__all__ = ["ExLlamaV2PostSamplingHook", "ExLlamaV2PostSamplingResult"]
