"""Every public name of exllamav2's (0.3.2, spec "Files read") `__init__`, `generator`, `generator.filters`,
`cache`, `tokenizer`, `model_init`, `util` and `tensor_p` modules exists under `import exllamav2` (exlpy.compat),
and the public methods scripts call on its main classes exist. Names of features exlpy lacks raise
NotSupportedError when used, never AttributeError."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest

import exlpy.compat
from exlpy.compat.alias import AliasModule
from exlpy.errors import ConfigError, LoraConfigError, MultimodalError, NotSupportedError

MODULE_NAMES: dict[str, list[str]] = {
    "exllamav2": [
        "__version__", "ExLlamaV2", "ExLlamaV2CacheBase", "ExLlamaV2Cache", "ExLlamaV2Cache_Q4", "ExLlamaV2Cache_Q6",
        "ExLlamaV2Cache_Q8", "ExLlamaV2Cache_8bit", "ExLlamaV2Cache_TP", "ExLlamaV2Config", "ExLlamaV2Tokenizer",
        "ExLlamaV2Lora", "SeqTensor", "Timer", "Intervention", "ExLlamaV2MultimodalProjector", "ExLlamaV2VisionTower",
    ],
    "exllamav2.generator": [
        "__version__", "ExLlamaV2Sampler", "ExLlamaV2BaseGenerator", "ExLlamaV2StreamingGenerator",
        "ExLlamaV2DynamicGenerator", "ExLlamaV2DynamicJob", "ExLlamaV2DynamicGeneratorAsync",
        "ExLlamaV2DynamicJobAsync", "ExLlamaV2MMEmbedding", "ExLlamaV2PostSamplingHook",
        "ExLlamaV2PostSamplingResult",
    ],
    "exllamav2.generator.filters": ["ExLlamaV2Filter", "ExLlamaV2SelectFilter", "ExLlamaV2PrefixFilter"],
    "exllamav2.cache": [
        "ExLlamaV2CacheBase", "ExLlamaV2Cache", "ExLlamaV2Cache_8bit", "ExLlamaV2Cache_Q", "ExLlamaV2Cache_Q4",
        "ExLlamaV2Cache_Q6", "ExLlamaV2Cache_Q8", "ExLlamaV2Cache_TP",
    ],
    "exllamav2.tokenizer": ["__version__", "ExLlamaV2TokenizerBase", "ExLlamaV2TokenizerHF"],
    "exllamav2.model_init": ["add_args", "print_options", "check_args", "init", "post_init_load"],
    "exllamav2.util": [
        "Timer", "timed", "timings", "num_run_avg", "SeqTensor", "cuda_sync_active", "get_basic_progress",
        "list_live_tensors", "snapshot", "set_snapshot", "diff_snapshot", "print_vram_usage", "print_vram_usage_peak",
        "get_visible_devices", "get_nvidia_gpu_memory", "get_amd_gpu_memory", "get_all_gpu_memory", "integer_split",
        "unpack_4bit", "pack_4bit",
    ],
    "exllamav2.tensor_p": ["BROADCAST_KV", "BROADCAST_ID", "BROADCAST_VC", "BROADCAST_RS", "BROADCAST_Q", "TPContext"],
    # Submodules scripts import names from directly.
    "exllamav2.version": ["__version__"],
    "exllamav2.config": ["ExLlamaV2Config"],
    "exllamav2.model": ["ExLlamaV2"],
    "exllamav2.attn": ["ExLlamaV2Attention", "has_flash_attn", "has_xformers", "has_lower_right_sdpa",
                       "assert_paged_attn"],
    "exllamav2.lora": ["ExLlamaV2Lora"],
    "exllamav2.tokenizer.tokenizer": ["ExLlamaV2Tokenizer"],
    "exllamav2.tokenizer.base": ["ExLlamaV2TokenizerBase"],
    "exllamav2.tokenizer.hf": ["ExLlamaV2TokenizerHF"],
    "exllamav2.generator.base": ["ExLlamaV2BaseGenerator"],
    "exllamav2.generator.streaming": ["ExLlamaV2StreamingGenerator"],
    "exllamav2.generator.sampler": ["ExLlamaV2Sampler"],
    "exllamav2.generator.dynamic": ["ExLlamaV2DynamicGenerator", "ExLlamaV2DynamicJob"],
    "exllamav2.generator.dynamic_async": ["ExLlamaV2DynamicGeneratorAsync", "ExLlamaV2DynamicJobAsync"],
    "exllamav2.generator.hooks": ["ExLlamaV2PostSamplingHook", "ExLlamaV2PostSamplingResult"],
}

CLASS_MEMBERS: dict[str, list[str]] = {
    "ExLlamaV2": ["load", "load_gen", "load_tp", "load_tp_gen", "load_autosplit", "load_autosplit_gen", "unload",
                  "set_device_map", "set_cache_map", "get_cache_devices", "create_device_context",
                  "drop_device_context", "free_device_context", "get_device_context", "get_modules", "update_loras",
                  "is_quant", "forward", "forward_chunk", "loaded"],
    "ExLlamaV2Config": ["prepare", "set_low_mem", "arch_compat_overrides", "alt_rope_method", "yarn_rope_factor",
                        "yarn_rope_original_max_position_embeddings", "l3_rope_factor", "l3_rope_low_freq_factor",
                        "l3_rope_high_freq_factor", "l3_rope_original_max_position_embeddings",
                        "rotary_embedding_base", "scale_pos_emb", "scale_alpha_value", "scale_long_factor",
                        "scale_short_factor", "num_experts_per_token", "load_in_q4", "vocab_size", "hidden_size",
                        "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                        "intermediate_size", "norm_eps", "bos_token_id", "eos_token_id", "pad_token_id",
                        "tensor_file_map", "tensor_files", "vision_model_type"],
    "ExLlamaV2Cache": ["get_kv_state", "store_kv_state", "copy_states", "roll_left", "footprint", "clone",
                       "all_tensors", "reset", "update_cache_tensors"],
    "ExLlamaV2Tokenizer": ["encode", "decode", "single_id", "single_token", "get_vocab_size", "encode_special",
                           "encode_unspecial", "padding_mask", "num_tokens", "get_id_to_ord_list",
                           "get_id_to_piece_list", "get_piece_to_id_dict", "get_prefix_to_ids_dict",
                           "get_prefix_id_to_ids_dict", "get_char_trie", "get_char_trie_ci", "cached_encode_str",
                           "tokenizer", "Trie"],
    "ExLlamaV2TokenizerBase": ["unk_id", "pad_id", "bos_id", "eos_id", "unk_token", "pad_token", "bos_token",
                               "eos_token", "space_char", "newline_char", "enumerate_tokens", "vocab_size",
                               "id_to_piece", "piece_to_id", "decode", "encode", "clean_special_chars",
                               "piece_to_ord", "id_to_ord", "deduce_char_map"],
    "ExLlamaV2StreamingGenerator": ["set_stop_conditions", "begin_stream", "begin_stream_ex", "stream", "stream_ex",
                                    "get_sd_stats", "reset_sd_stats", "ngram_preload", "warmup", "full",
                                    "generate_simple"],
    "ExLlamaV2BaseGenerator": ["warmup", "full", "generate_simple"],
    "ExLlamaV2DynamicGenerator": ["generate", "enqueue", "iterate", "num_remaining_jobs", "cancel", "clear_queue",
                                  "set_loras", "warmup", "reset_page_table"],
    "ExLlamaV2DynamicJob": ["sequences"],
}
CLASS_HOME = {"ExLlamaV2TokenizerBase": "exllamav2.tokenizer", "ExLlamaV2StreamingGenerator": "exllamav2.generator",
              "ExLlamaV2BaseGenerator": "exllamav2.generator", "ExLlamaV2DynamicGenerator": "exllamav2.generator",
              "ExLlamaV2DynamicJob": "exllamav2.generator"}


@pytest.fixture
def compat() -> Iterator[None]:
    exlpy.compat.install()
    yield
    exlpy.compat.uninstall()


@pytest.mark.parametrize("module", sorted(MODULE_NAMES))
def test_module_names_exist(compat: None, module: str) -> None:
    mod = importlib.import_module(module)
    # exlpy's own module, or for modules exporting __version__ a thin alias over it (exllamav2's version)
    assert isinstance(mod, AliasModule) or mod.__name__.startswith("exlpy")
    missing = [n for n in MODULE_NAMES[module] if not hasattr(mod, n)]
    assert not missing, f"{module} lacks {missing}"


@pytest.mark.parametrize("cls", sorted(CLASS_MEMBERS))
def test_class_members_exist(compat: None, cls: str) -> None:
    owner: Any = getattr(importlib.import_module(CLASS_HOME.get(cls, "exllamav2")), cls)
    missing = [n for n in CLASS_MEMBERS[cls] if not hasattr(owner, n)]
    assert not missing, f"{cls} lacks {missing}"


def test_unsupported_features_raise_typed_errors(compat: None) -> None:
    import exllamav2
    import exllamav2.lora
    from exllamav2.generator import ExLlamaV2MMEmbedding

    from exlpy.lora import ExLlamaV2Lora

    assert exllamav2.ExLlamaV2Lora is exllamav2.lora.ExLlamaV2Lora is ExLlamaV2Lora  # the real class
    with pytest.raises(LoraConfigError, match="not a directory"):
        exllamav2.ExLlamaV2Lora.from_directory(None, "/some/lora")
    with pytest.raises(ConfigError, match="ExLlamaV2Config"):  # real classes now (tests/test_vision_*.py)
        exllamav2.ExLlamaV2VisionTower(None)
    with pytest.raises(NotSupportedError, match="vision"):
        exllamav2.ExLlamaV2MultimodalProjector()
    with pytest.raises(MultimodalError, match="embeddings must be"):
        ExLlamaV2MMEmbedding(None, None)
    with pytest.raises(NotSupportedError, match="Intervention"):
        exllamav2.Intervention(None)
    # NotSupportedError is also a NotImplementedError, for code that catches that.
    assert issubclass(NotSupportedError, NotImplementedError)
