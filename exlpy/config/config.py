"""`ExLlamaV2Config`: the exllamav2-compatible, user-mutable configuration object."""

from __future__ import annotations

import os

import torch

from exlpy.config.hf import ModelSpec, load_spec
from exlpy.config.values import MAX_POSITIONS, as_int, as_positive_float, check_compute_dtype
from exlpy.errors import ConfigError, WeightsError
from exlpy.weights.safetensors_index import SafetensorsIndex

LAYER_KEYS = (
    "input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)


class ExLlamaV2Config:
    """Model directory + runtime settings. Architecture facts live in the frozen `spec` once prepared."""

    def __init__(self, model_dir: str | None = None) -> None:
        self.model_dir = model_dir
        self.max_batch_size = 1
        self.max_input_len = 2048
        self.max_attention_size = 2048**2
        self.max_output_len: int | None = None
        self.scale_pos_emb = 1.0
        self.scale_alpha_value = 1.0
        self.no_flash_attn = "EXLLAMA_NO_FLASH_ATTN" in os.environ
        self.no_xformers = "EXLLAMA_NO_XFORMERS" in os.environ
        self.no_sdpa = "EXLLAMA_NO_SDPA" in os.environ
        self.no_graphs = "EXLLAMA_NO_GRAPHS" in os.environ
        self.load_in_q4 = False
        self.max_dq_size = 512 * 1024**2
        # Compute dtype; None picks fp16 on CUDA and fp32 on the CPU (where fp16 matmuls are slow and lossy).
        self.dtype: torch.dtype | None = None
        self.spec: ModelSpec | None = None
        self.index: SafetensorsIndex | None = None
        self.generation_config: dict[str, list[int]] = {}
        self.prepared = False
        if model_dir is not None:
            self.prepare()

    def set_low_mem(self) -> None:
        self.max_input_len = 1024
        self.max_attention_size = 1024**2
        if self.max_output_len is not None:
            self.max_output_len = min(self.max_output_len, 1024)

    def arch_compat_overrides(self, quiet: bool = False, warn_only: bool = False) -> None:
        """exllamav2 switches off attention back ends (flash-attn, xformers) that cannot serve the model's
        logit softcapping or sliding window. exlpy has neither back end and supports no architecture that needs
        either, so nothing is overridden; the method exists so that exllamav2 scripts (model_init) run as they
        are. Like exllamav2's, it needs a prepared config."""
        self._s()

    def prepare(self, no_tensors: bool = False) -> None:
        if self.prepared and (no_tensors or self.index is not None):
            return  # prepare() is idempotent: exllamav2 scripts call it after the constructor already did
        if self.model_dir is None:
            raise ConfigError("ExLlamaV2Config.model_dir is not set")
        spec, gen_eos = load_spec(self.model_dir)
        self.spec = spec
        self.generation_config = {"eos_token_id": gen_eos}
        self.max_seq_len = spec.max_position_embeddings
        self.original_max_seq_len = spec.max_position_embeddings
        if spec.rope_scaling.kind == "linear":
            self.scale_pos_emb = spec.rope_scaling.factor  # exllamav2 exposes linear scaling through this knob
        if not no_tensors:
            self.index = SafetensorsIndex(self.model_dir)
            self._check_keys()
        self.prepared = True

    def _check_keys(self) -> None:
        assert self.spec is not None and self.index is not None
        names = self.index.tensors

        def present(prefix: str) -> bool:
            return any(f"{prefix}.{s}" in names for s in ("q_weight", "qweight", "weight")) or prefix in names

        required = ["model.embed_tokens", "model.norm"]
        if not self.spec.tie_word_embeddings:
            required.append("lm_head")
        for i in range(self.spec.num_hidden_layers):
            required += [f"model.layers.{i}.{k}" for k in LAYER_KEYS]
        for prefix in required:
            if not present(prefix):
                raise WeightsError(f"Could not find {prefix}.* in model", tensor=prefix, file=self.model_dir)

    # exllamav2 exposes architecture values as plain attributes; mirror them read-only from the spec.
    def _s(self) -> ModelSpec:
        if self.spec is None:
            raise ConfigError("config is not prepared; call prepare() first")
        return self.spec

    vocab_size = property(lambda self: self._s().vocab_size)
    hidden_size = property(lambda self: self._s().hidden_size)
    num_hidden_layers = property(lambda self: self._s().num_hidden_layers)
    num_attention_heads = property(lambda self: self._s().num_attention_heads)
    num_key_value_heads = property(lambda self: self._s().num_key_value_heads)
    num_key_value_groups = property(lambda self: self._s().num_attention_heads // self._s().num_key_value_heads)
    head_dim = property(lambda self: self._s().head_dim)
    intermediate_size = property(lambda self: self._s().intermediate_size)
    norm_eps = property(lambda self: self._s().norm_eps)
    rotary_embedding_base = property(lambda self: self._s().rope_theta)
    bos_token_id = property(lambda self: self._s().bos_token_id)
    eos_token_id = property(lambda self: self._s().eos_token_id)
    pad_token_id = property(lambda self: self._s().pad_token_id)
    architecture = property(lambda self: self._s().architecture)
    arch = property(lambda self: self._s().arch)
    tensor_file_map = property(lambda self: {n: t.file for n, t in (self.index.tensors if self.index else {}).items()})

    def check_settings(self) -> None:
        """Check the user-settable knobs (exllamav2 scripts assign them freely between construction and load):
        a ConfigError naming the setting, before anything is sized from it."""
        where = "ExLlamaV2Config"
        if self.prepared:
            as_int(self.max_seq_len, "max_seq_len", where, 1, MAX_POSITIONS, strict=True)
        as_int(self.max_input_len, "max_input_len", where, 1, MAX_POSITIONS, strict=True)
        as_int(self.max_batch_size, "max_batch_size", where, 1, 1 << 20, strict=True)
        as_int(self.max_attention_size, "max_attention_size", where, 1, 1 << 62, strict=True)
        if self.max_output_len is not None:
            as_int(self.max_output_len, "max_output_len", where, 1, MAX_POSITIONS, strict=True)
        as_positive_float(self.scale_pos_emb, "scale_pos_emb", where)
        as_positive_float(self.scale_alpha_value, "scale_alpha_value", where)
        check_compute_dtype(self.dtype)

    def compute_dtype(self, device: torch.device | str) -> torch.dtype:
        if self.dtype is not None:
            return check_compute_dtype(self.dtype)  # type: ignore[return-value]
        return torch.float16 if torch.device(device).type == "cuda" else torch.float32
