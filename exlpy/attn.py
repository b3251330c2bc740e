"""exllamav2's `attn` module names. exllamav2 picks among flash-attn, xformers and SDPA back ends and exposes
which it found; exlpy has its own attention (Triton on GPUs, a torch reference on the CPU), paged included, so
it needs none of them: the flags are False and paged attention is always available."""

from exlpy.model.attention import Attention as ExLlamaV2Attention

has_flash_attn = False
has_flash_attn_with_paged = False
has_flash_attn_with_window = False
has_flash_attn_with_softcap = False
has_xformers = False
has_lower_right_sdpa = False


def assert_paged_attn() -> None:
    """exllamav2 raises here without flash-attn >= 2.5.7; exlpy's paged attention needs nothing extra."""


__all__ = ["ExLlamaV2Attention", "assert_paged_attn", "has_flash_attn", "has_flash_attn_with_paged",
           "has_flash_attn_with_softcap", "has_flash_attn_with_window", "has_lower_right_sdpa", "has_xformers"]
