"""`ExLlamaV2Config`: the exllamav2-compatible, user-mutable configuration object."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from exlpy.config.arch import remap_key
from exlpy.config.hf import ModelSpec, load_spec
from exlpy.config.runtime import RuntimeSettings
from exlpy.config.values import MAX_POSITIONS, as_int, as_positive_float, check_compute_dtype
from exlpy.errors import ConfigError, NotSupportedError, WeightsError
from exlpy.runtime import options
from exlpy.weights.safetensors_index import SafetensorsIndex
from exlpy.weights.views import add_arch_views


class _from_file:  # used like `property`, hence the lower-case name
    """An architecture value from config.json: readable like exllamav2's plain attribute, but assigning it is
    an error (the loaded weights have that shape; a new value would not change them)."""

    def __init__(self, read: Callable[[ModelSpec], Any]) -> None:
        self.read = read
        self.name = "?"

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: ExLlamaV2Config | None, owner: type | None = None) -> Any:
        return self if obj is None else self.read(obj._s())

    def __set__(self, obj: ExLlamaV2Config, value: Any) -> None:
        raise ConfigError(f"config.{self.name} comes from the model's config.json and cannot be changed at runtime "
                          f"(tried to set it to {value!r})")


def layer_keys(spec: ModelSpec, layer: int = 0) -> list[str]:
    """The tensor prefixes decoder layer `layer` of `spec` must have (canonical names, exlpy/config/arch.py)."""
    keys = [name for _, name in spec.arch.norms]
    keys += [f"self_attn.{p}_proj" for p in "qkvo"]
    if spec.is_sparse(layer):
        assert spec.moe is not None
        keys += ["mlp.router"] + [f"mlp.experts.{e}.{p}_proj" for e in range(spec.moe.num_experts)
                                  for p in ("gate", "up", "down")]
    elif spec.arch.gated_mlp:
        keys += ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    else:
        keys += ["mlp.up_proj", "mlp.down_proj"]
    if spec.features.qk_norm:
        keys += ["self_attn.q_norm", "self_attn.k_norm"]
    return keys


class ExLlamaV2Config(RuntimeSettings):
    """Model directory + runtime settings. Architecture facts live in the frozen `spec` once prepared; the
    RoPE attributes exllamav2 scripts set (alt_rope_method, yarn_rope_factor, ...) are in RuntimeSettings."""

    def __init__(self, model_dir: str | None = None) -> None:
        self._init_runtime()
        self.model_dir = model_dir
        self.max_batch_size = 1
        self.max_input_len = 2048
        self.max_attention_size = 2048**2
        self.max_output_len: int | None = None
        self.scale_pos_emb = 1.0
        self.scale_alpha_value = 1.0
        opts = options()  # exllamav2 reads these from the environment; exlpy's one snapshot of it
        # Without a CUDA device none of exllamav2's attention back ends exists: report them off, so callers that
        # probe the GPU unless no_flash_attn is set (TabbyAPI) take their no-GPU path.
        no_cuda = not torch.cuda.is_available()
        self.no_flash_attn = opts.no_flash_attn or no_cuda
        self.no_xformers = opts.no_xformers or no_cuda
        self.no_sdpa = opts.no_sdpa or no_cuda
        self.no_graphs = opts.no_graphs  # graphs need CUDA anyway; this stays the user's setting
        self._load_in_q4 = False
        self._experts_per_token: int | None = None  # exllamav2's -ept: overrides num_experts_per_tok
        # exlpy dequantizes inside its kernels (no temporary fp16 weight buffer), so this bound has nothing to
        # limit; kept so exllamav2 scripts can set it.
        self.max_dq_size = 512 * 1024**2
        self.fasttensors = False  # deprecated no-op in exllamav2 too
        # Compute dtype; None picks fp16 on CUDA and fp32 on the CPU (where fp16 matmuls are slow and lossy).
        self.dtype: torch.dtype | None = None
        self._set_base_spec(None)
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
        logit softcapping or sliding window. exlpy has neither back end (its own kernels and their torch
        fallbacks serve both), so nothing is overridden; the method exists so that exllamav2 scripts
        (model_init) run as they are. Like exllamav2's, it needs a prepared config."""
        self._s()

    def prepare(self, no_tensors: bool = False) -> None:
        if self.prepared and (no_tensors or self.index is not None):
            return  # prepare() is idempotent: exllamav2 scripts call it after the constructor already did
        if self.model_dir is None:
            raise ConfigError("ExLlamaV2Config.model_dir is not set")
        spec, gen_eos = load_spec(self.model_dir)
        self._set_base_spec(spec)
        self.generation_config = {"eos_token_id": gen_eos}
        self.max_seq_len = spec.max_position_embeddings
        self.original_max_seq_len = spec.max_position_embeddings
        if spec.rope_scaling.kind == "linear":
            self.scale_pos_emb = spec.rope_scaling.factor  # exllamav2 exposes linear scaling through this knob
        if not no_tensors:
            remap = spec.arch.remap
            self.index = SafetensorsIndex(self.model_dir, (lambda n: remap_key(n, remap)) if remap else None)
            add_arch_views(self.index, spec)
            self._check_keys()
        self.prepared = True

    def _check_keys(self) -> None:
        assert self.spec is not None and self.index is not None
        names = self.index.tensors

        def present(prefix: str) -> bool:
            return any(f"{prefix}.{s}" in names for s in ("q_weight", "qweight", "weight")) or prefix in names

        required = ["model.embed_tokens", "model.norm"]
        if not self.spec.features.tied_head:
            required.append("lm_head")
        if self.spec.features.learned_positions:
            required.append("model.wpe")
        for i in range(self.spec.num_hidden_layers):
            required += [f"model.layers.{i}.{k}" for k in layer_keys(self.spec, i)]
        for prefix in required:
            if not present(prefix):
                raise WeightsError(f"Could not find {prefix}.* in model", tensor=prefix, file=self.model_dir)

    # exllamav2 exposes architecture values as plain attributes; mirror them read-only from the spec.
    def _s(self) -> ModelSpec:
        if self.spec is None:
            raise ConfigError("config is not prepared; call prepare() first")
        return self.spec

    vocab_size = _from_file(lambda s: s.vocab_size)
    hidden_size = _from_file(lambda s: s.hidden_size)
    num_hidden_layers = _from_file(lambda s: s.num_hidden_layers)
    num_attention_heads = _from_file(lambda s: s.num_attention_heads)
    num_key_value_heads = _from_file(lambda s: s.num_key_value_heads)
    num_key_value_groups = _from_file(lambda s: s.num_attention_heads // s.num_key_value_heads)
    head_dim = _from_file(lambda s: s.head_dim)
    intermediate_size = _from_file(lambda s: s.intermediate_size)
    num_experts = _from_file(lambda s: s.moe.num_experts if s.moe else None)  # None for dense models
    norm_eps = _from_file(lambda s: s.norm_eps)
    bos_token_id = _from_file(lambda s: s.bos_token_id)
    eos_token_id = _from_file(lambda s: s.eos_token_id)
    pad_token_id = _from_file(lambda s: s.pad_token_id)
    architecture = _from_file(lambda s: s.architecture)
    arch = _from_file(lambda s: s.arch)
    sliding_window = _from_file(lambda s: s.sliding_window or 0)
    use_qk_norm = _from_file(lambda s: s.features.qk_norm)
    partial_rotary_factor = _from_file(lambda s: s.features.rotary_dim / s.head_dim)
    logit_scale = _from_file(lambda s: s.features.logit_scale)
    final_logit_softcapping = _from_file(lambda s: s.features.final_softcap or None)
    attn_logit_softcapping = _from_file(lambda s: s.features.attn_softcap or None)
    scale_emb = _from_file(lambda s: s.features.embed_scale)
    scale_depth = _from_file(lambda s: s.features.residual_scale)
    norm_head = _from_file(lambda s: s.features.norm_head)
    # Features of architectures exlpy does not load (vision): fixed values.
    vision_model_type = _from_file(lambda s: None)
    tensor_file_map = property(lambda self: {n: t.file for n, t in (self.index.tensors if self.index else {}).items()})
    tensor_files = property(lambda self: sorted({t.file for t in (self.index.tensors if self.index else {}).values()}))
    model_config = property(lambda self: os.path.join(self.model_dir, "config.json") if self.model_dir else None)

    @property
    def num_experts_per_token(self) -> int | None:
        """Experts each token is routed to: config.json's num_experts_per_tok unless set here (exllamav2's
        `-ept`); None for a dense model."""
        moe = self.spec.moe if self.spec is not None else None
        if moe is None:
            return None
        return self._experts_per_token or moe.top_k

    @num_experts_per_token.setter
    def num_experts_per_token(self, value: int | None) -> None:
        moe = self.spec.moe if self.spec is not None else None
        if value is None:
            self._experts_per_token = None
            return
        if moe is None:
            raise ConfigError(f"config.num_experts_per_token = {value}: this model has no experts")
        self._experts_per_token = as_int(value, "num_experts_per_token", "config", 1, moe.num_experts, strict=True)

    @property
    def load_in_q4(self) -> bool:
        return self._load_in_q4

    @load_in_q4.setter
    def load_in_q4(self, value: bool) -> None:
        if value:
            raise NotSupportedError("config.load_in_q4 (exllamav2's development mode that requantizes fp16 weights "
                                    "to Q4 at load) is not supported by exlpy; load an EXL2 or GPTQ model instead")
        self._load_in_q4 = False

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
