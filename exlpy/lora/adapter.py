"""`ExLlamaV2Lora`: a PEFT LoRA adapter read from its directory (spec §10) and kept on the CPU; the adapter
registry (exlpy/lora/slots.py) copies it into the model's slot buffers on the devices.

A PEFT directory holds adapter_config.json and adapter_model.safetensors with, per adapted projection,
`base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight` [r, in] and `lora_B.weight` [out, r].
The adapted projection computes y = W x + s · B (A x) with s = lora_scaling · alpha / r (alpha / sqrt(r) with
use_rslora; r and alpha per module from rank_pattern / alpha_pattern, as PEFT reads them); s is folded into B
here. adapter_model.bin (a PyTorch pickle) is read with weights_only=True when there is no safetensors file.
Anything that would change that formula (DoRA, trained biases, replaced heads or embeddings, ...) is
refused by name rather than silently ignored.
"""

from __future__ import annotations

import json
import math
import os
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from exlpy.errors import LoraConfigError, LoraWeightsError, ModelStateError

# The projections exlpy's blocks can adapt, and the block each belongs to.
BLOCK_OF = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
            "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
# Config fields whose feature changes the math; any truthy value is refused.
_REFUSED = {"use_dora": "DoRA (use_dora)", "fan_in_fan_out": "fan_in_fan_out", "lora_bias": "LoRA biases (lora_bias)",
            "modules_to_save": "replaced modules (modules_to_save)", "layer_replication": "layer_replication",
            "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
            "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)", "use_qalora": "QALoRA",
            "target_parameters": "adapted parameters (target_parameters)"}


def projection_shapes(spec: Any) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every adaptable projection of the base model."""
    h, d, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    hq, hk = spec.num_attention_heads * d, spec.num_key_value_heads * d
    return {"q_proj": (h, hq), "k_proj": (h, hk), "v_proj": (h, hk), "o_proj": (hq, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches a module whose name ends with it (at a dot), or,
    starting with '^', as a regular expression from the start of the name."""
    for key, value in patterns.items():
        if re.match(key, module) if key.startswith("^") else re.fullmatch(rf"(.*\.)?(?:{key})", module):
            return value
    return default


@dataclass(frozen=True)
class AdapterConfig:
    """What adapter_config.json says about the math (PEFT's defaults where a field is absent)."""

    path: str
    r: int = 8
    alpha: float = 8.0
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)

    def rank(self, module: str) -> int:
        return int(_pattern_value(self.rank_pattern, module, self.r))

    def scaling(self, module: str, rank: int) -> float:
        alpha = float(_pattern_value(self.alpha_pattern, module, self.alpha))
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def read_config(path: str) -> AdapterConfig:
    if not os.path.isfile(path):
        raise LoraConfigError(f"{path}: not found (a PEFT LoRA adapter directory holds adapter_config.json and "
                              "adapter_model.safetensors)")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoraConfigError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(raw, dict):
        raise LoraConfigError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    kind = raw.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise LoraConfigError(f"{path}: peft_type {kind!r} is not a LoRA adapter (exlpy applies LORA only)")
    for key, what in _REFUSED.items():
        if raw.get(key):
            raise LoraConfigError(f"{path}: {what} = {raw[key]!r} is not supported by exlpy's LoRA")
    if raw.get("bias", "none") != "none":
        raise LoraConfigError(f"{path}: bias = {raw['bias']!r} (trained biases) is not supported; only 'none'")
    _check_targets(path, raw.get("target_modules"))

    def num(key: str, default: float, integer: bool) -> Any:
        v = raw.get(key, default)
        ok = isinstance(v, int) if integer else isinstance(v, (int, float))
        if isinstance(v, bool) or not ok or not math.isfinite(v) or (integer and v < 1):
            raise LoraConfigError(f"{path}: {key} must be a {'positive integer' if integer else 'number'}, "
                                  f"got {v!r}")
        return v

    patterns = {}
    for key, integer in (("rank_pattern", True), ("alpha_pattern", False)):
        pat = raw.get(key) or {}
        if not isinstance(pat, dict):
            raise LoraConfigError(f"{path}: {key} must be an object of module pattern -> value, got {pat!r}")
        for k, v in pat.items():
            bad = isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
            if bad or (integer and (not isinstance(v, int) or v < 1)):
                raise LoraConfigError(f"{path}: {key}[{k!r}] = {v!r} is not a valid "
                                      f"{'rank' if integer else 'alpha'}")
        patterns[key] = dict(pat)
    rslora = raw.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise LoraConfigError(f"{path}: use_rslora must be true or false, got {rslora!r}")
    return AdapterConfig(path, num("r", 8, True), float(num("lora_alpha", 8, False)), rslora,
                         patterns["rank_pattern"], patterns["alpha_pattern"])


def _check_targets(path: str, targets: Any) -> None:
    """A list of target modules must name projections the model has (a string is PEFT's regex or
    'all-linear': the tensors then say which modules are adapted)."""
    if targets is None or isinstance(targets, str):
        return
    if not isinstance(targets, (list, tuple)) or not all(isinstance(t, str) for t in targets):
        raise LoraConfigError(f"{path}: target_modules must be a list of module names or a pattern, got {targets!r}")
    bad = [t for t in targets if t.rsplit(".", 1)[-1] not in BLOCK_OF]
    if bad:
        raise LoraConfigError(f"{path}: target module(s) {', '.join(map(repr, bad))} do not exist in this model: "
                              f"exlpy adapts {', '.join(BLOCK_OF)}")


def read_weights(path: str, spec: Any, cfg: AdapterConfig, lora_scaling: float
                 ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module key: (A [r, in], scaled B [out, r])} in fp32, checked against the base model's shapes."""
    f = _open_tensors(path)
    names = list(f.keys())
    shapes = projection_shapes(spec)
    pairs: dict[str, dict[str, str]] = {}
    for name in names:
        m = _KEY.match(name)
        if m is None:
            what = ("a replaced or adapted head / embedding" if ("lm_head" in name or "embed_tokens" in name) else
                    "a DoRA magnitude" if "magnitude" in name else "not a lora_A / lora_B weight of a layer")
            raise LoraWeightsError(f"unsupported adapter tensor ({what}); exlpy adapts {', '.join(BLOCK_OF)}",
                                   tensor=name, file=path)
        layer, block, proj, ab = m.groups()
        if BLOCK_OF.get(proj) != block:
            raise LoraWeightsError(f"adapts {block}.{proj}, which this model does not have; exlpy adapts "
                                   f"{', '.join(BLOCK_OF)}", tensor=name, file=path)
        if int(layer) >= spec.num_hidden_layers:
            raise LoraWeightsError(f"layer {layer} does not exist: the base model has {spec.num_hidden_layers} "
                                   "layers", tensor=name, file=path)
        key = f"model.layers.{int(layer)}.{block}.{proj}"
        if ab in pairs.setdefault(key, {}):
            raise LoraWeightsError(f"lora_{ab} of {key} appears twice (also as {pairs[key][ab]})", tensor=name,
                                   file=path)
        pairs[key][ab] = name
    if not pairs:
        raise LoraWeightsError("the file holds no LoRA weights", file=path)
    out = {}
    for key, d in sorted(pairs.items()):
        if len(d) != 2:
            have = next(iter(d.values()))
            raise LoraWeightsError(f"lora_{'B' if 'A' in d else 'A'} of {key} is missing", tensor=have, file=path)
        a, b = f.get_tensor(d["A"]), f.get_tensor(d["B"])
        in_f, out_f = shapes[key.rsplit(".", 1)[1]]
        for t, n in ((a, d["A"]), (b, d["B"])):
            if not t.is_floating_point():
                raise LoraWeightsError(f"dtype {t.dtype} is not a floating-point type", tensor=n, file=path)
        if a.dim() != 2 or a.shape[1] != in_f or a.shape[0] < 1:
            raise LoraWeightsError(f"shape {list(a.shape)} does not fit the base model: {key} takes {in_f} input "
                                   f"features, so lora_A must be [r, {in_f}]", tensor=d["A"], file=path)
        r = a.shape[0]
        if tuple(b.shape) != (out_f, r):
            raise LoraWeightsError(f"shape {list(b.shape)} does not fit the base model: {key} has {out_f} output "
                                   f"features and lora_A has rank {r}, so lora_B must be [{out_f}, {r}]",
                                   tensor=d["B"], file=path)
        if r != cfg.rank(key):
            raise LoraWeightsError(f"rank {r}, but {cfg.path} gives rank {cfg.rank(key)} for {key}",
                                   tensor=d["A"], file=path)
        scale = lora_scaling * cfg.scaling(key, r)
        out[key] = (a.float().contiguous(), (b.float() * scale).contiguous())
    return out


def check_architecture(spec: Any) -> None:
    """The adapter hooks (exlpy/lora/block.py) compute a Llama-style block around the adapted projections:
    RMSNorm before q|k|v and gate|up, SwiGLU, block outputs added unscaled. Other blocks are refused by name."""
    a, f = spec.arch, spec.features
    why = ("its mixture-of-experts layers" if spec.moe is not None else
           "its LayerNorms" if a.norm != "rms" else
           "its non-gated MLP" if not a.gated_mlp else
           f"its {f.act} activation" if f.act != "silu" else
           "its parallel attention and MLP" if a.parallel_blocks else
           "its residual multiplier" if f.residual_scale != 1.0 else "")
    if why:
        raise LoraConfigError(f"LoRA adapters on {spec.architecture} are not supported ({why}); exlpy applies "
                              "adapters to RMSNorm / SwiGLU blocks")


class _BinTensors:
    """The tensors of an adapter_model.bin (a PyTorch pickle), read with weights_only=True: plain tensors and
    containers only, no code from the file runs."""

    def __init__(self, path: str) -> None:
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # an unpickling error, a truncated zip, a file that is not a checkpoint
            raise LoraWeightsError(f"not a readable PyTorch weights file ({type(e).__name__}: {e})",
                                   file=path) from None
        if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                 for k, v in data.items()):
            raise LoraWeightsError("expected a dict of tensor name -> tensor", file=path)
        self.data = data

    def keys(self) -> list[str]:
        return list(self.data)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.data[name]


def _open_tensors(path: str) -> Any:
    """The adapter's tensors: adapter_model.safetensors, or else adapter_model.bin beside it (or `path` itself
    when it names a .bin file), as exllamav2 reads them."""
    if not path.endswith(".bin") and os.path.isfile(path):
        from safetensors import safe_open

        try:
            return safe_open(path, "pt")
        except Exception as e:  # the library raises several types for a corrupt header
            raise LoraWeightsError(f"not a readable safetensors file ({e})", file=path) from None
    binary = path if path.endswith(".bin") else os.path.join(os.path.dirname(path), "adapter_model.bin")
    if os.path.isfile(binary):
        return _BinTensors(binary)
    raise LoraWeightsError("adapter weights not found (expected adapter_model.safetensors or adapter_model.bin)",
                           file=path)


class ExLlamaV2Lora:
    """A LoRA adapter for `model` (exllamav2's class). Pass it to `model.forward(..., loras=[lora])`, the
    generators' `set_loras([lora])` / `loras=`, or a dynamic job's `loras=`; `unload()` drops it.

    While the model is loaded the adapter is copied into a free adapter slot at once (exlpy/lora/slots.py), so
    the first request that uses it pays nothing; a model loaded later gets it on first use.
    """

    def __init__(self, model: Any, lora_config_path: str, lora_path: str, lora_scaling: float = 1.0) -> None:
        if isinstance(lora_scaling, bool) or not isinstance(lora_scaling, (int, float)) or \
                not math.isfinite(lora_scaling):
            raise LoraConfigError(f"lora_scaling must be a finite number, got {lora_scaling!r}")
        cfg = read_config(lora_config_path)
        check_architecture(model.config.spec)
        self.model = model
        self.lora_config_path, self.lora_path = lora_config_path, lora_path
        self.directory = os.path.dirname(os.path.abspath(lora_config_path))
        self.name = os.path.basename(self.directory)
        self.lora_r, self.lora_alpha, self.use_rslora = cfg.r, cfg.alpha, cfg.use_rslora
        self.weights = read_weights(lora_path, model.config.spec, cfg, float(lora_scaling))
        # exllamav2 stores the effective factor: the user's scale times alpha / r (alpha / sqrt(r) with rsLoRA),
        # from the config's top-level r and lora_alpha (per-module patterns are applied to the weights above).
        self.lora_scaling = float(lora_scaling) * cfg.alpha / (math.sqrt(cfg.r) if cfg.use_rslora else cfg.r)
        self.target_modules = sorted({k.rsplit(".", 1)[1] for k in self.weights}, key=list(BLOCK_OF).index)
        self.uid = uuid.uuid4().bytes  # identity in slot keys and in the generator's prefix-cache hashes
        self.loaded = True
        from exlpy.lora.slots import registry_of

        registry_of(model).add(self)

    @classmethod
    def from_directory(cls, model: Any, directory: str, lora_scaling: float = 1.0) -> ExLlamaV2Lora:
        if not os.path.isdir(directory):
            raise LoraConfigError(f"{directory}: not a directory (a PEFT LoRA adapter directory holds "
                                  "adapter_config.json and adapter_model.safetensors)")
        return cls(model, os.path.join(directory, "adapter_config.json"),
                   os.path.join(directory, "adapter_model.safetensors"), lora_scaling)

    def rank(self, module_key: str) -> int:
        w = self.weights.get(module_key)
        return 0 if w is None else int(w[0].shape[0])

    def unload(self) -> None:
        """Free the adapter's slots (zeroed; captured graphs stay valid) and its CPU copy. Refused while a
        running job or stream uses it."""
        if not self.loaded:
            return
        from exlpy.lora.slots import registry_of

        registry_of(self.model).remove(self)
        self.loaded = False
        self.weights = {}

    def check_usable(self, model: Any) -> None:
        if model is not None and self.model is not model:
            raise ModelStateError(f"LoRA adapter {self.name!r} was loaded for another model")
        if not self.loaded:
            raise ModelStateError(f"LoRA adapter {self.name!r} was unloaded")

    def __repr__(self) -> str:
        return (f"ExLlamaV2Lora({self.name!r}, r={self.lora_r}, alpha={self.lora_alpha}, "
                f"scaling={self.lora_scaling}, modules={self.target_modules})")
