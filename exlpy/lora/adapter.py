"""`ExLlamaV2Lora`: a PEFT LoRA adapter read from its directory (spec §10) and kept on the CPU; the adapter
registry (exlpy/lora/slots.py) copies it into the model's slot buffers on the devices.

A PEFT directory holds adapter_config.json and adapter_model.safetensors with, per adapted projection,
`base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight` [r, in] and `lora_B.weight` [out, r].
The adapted projection computes y = W x + s · B (A x) with s = lora_scaling · alpha / r (alpha / sqrt(r) with
use_rslora; r and alpha per module from rank_pattern / alpha_pattern, as PEFT reads them); s is folded into B
here. adapter_model.bin (a PyTorch pickle) is read with weights_only=True when there is no safetensors file.

The embedding and the head (`OUTER`) can change too, as exllamav2 and PEFT do it:
  replaced  (PEFT's modules_to_save, exllamav2's replacement lm_head / embed_tokens): `lm_head.weight` /
            `model.embed_tokens.weight` [vocab, hidden] used instead of the model's for the adapter's rows; a
            `base_layer.weight` that PEFT saves beside a LoRA on these modules replaces them too when it differs
            from the model's own (PEFT loads it over the base weights);
  low-rank  LoRA on lm_head (`lora_A` [r, hidden], `lora_B` [vocab, r]: logits += s B A x) or on embed_tokens
            (`lora_embedding_A` [r, vocab], `lora_embedding_B` [hidden, r]: h += s B A[:, id]), as PEFT computes.
Anything else that would change the formula (DoRA, trained biases, other replaced modules, a resized
vocabulary, ...) is refused by name rather than silently ignored.
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
# The embedding and the head: module key (PEFT's module name) by the short name target_modules use.
OUTER = {"embed_tokens": "model.embed_tokens", "lm_head": "lm_head"}
_OUTER_KEY = re.compile(r"^(?:base_model\.model\.)?(model\.embed_tokens|lm_head)\.(?:"
                        r"(?P<replace>(?:modules_to_save\.)?weight)|(?P<base>base_layer\.weight)|"
                        r"(?P<original>original_module\.weight)|lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight|"
                        r"lora_embedding_(?P<eab>[AB])(?:\.[\w-]+)?)$")
# Config fields whose feature changes the math; any truthy value is refused.
_REFUSED = {"use_dora": "DoRA (use_dora)", "fan_in_fan_out": "fan_in_fan_out", "lora_bias": "LoRA biases (lora_bias)",
            "layer_replication": "layer_replication",
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
    ensure_weight_tying: bool = False  # PEFT ties a tied model's adapted embedding and head together

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
    _check_saved(path, raw.get("modules_to_save"))

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
                         patterns["rank_pattern"], patterns["alpha_pattern"], bool(raw.get("ensure_weight_tying")))


def _check_targets(path: str, targets: Any) -> None:
    """A list of target modules must name projections the model has (a string is PEFT's regex or
    'all-linear': the tensors then say which modules are adapted)."""
    if targets is None or isinstance(targets, str):
        return
    if not isinstance(targets, (list, tuple)) or not all(isinstance(t, str) for t in targets):
        raise LoraConfigError(f"{path}: target_modules must be a list of module names or a pattern, got {targets!r}")
    bad = [t for t in targets if t.rsplit(".", 1)[-1] not in BLOCK_OF and t.rsplit(".", 1)[-1] not in OUTER]
    if bad:
        raise LoraConfigError(f"{path}: target module(s) {', '.join(map(repr, bad))} do not exist in this model: "
                              f"exlpy adapts {', '.join([*BLOCK_OF, *OUTER])}")


def _check_saved(path: str, saved: Any) -> None:
    """modules_to_save may name the embedding and the head (replaced by the adapter's copies), nothing else."""
    if not saved:
        return
    if not isinstance(saved, (list, tuple)) or not all(isinstance(t, str) for t in saved):
        raise LoraConfigError(f"{path}: modules_to_save must be a list of module names, got {saved!r}")
    bad = [t for t in saved if t.rsplit(".", 1)[-1] not in OUTER]
    if bad:
        raise LoraConfigError(f"{path}: modules_to_save {', '.join(map(repr, bad))}: replacing these modules "
                              f"(modules_to_save) is not supported by exlpy's LoRA; only {', '.join(OUTER)}")


def read_weights(path: str, spec: Any, cfg: AdapterConfig, lora_scaling: float
                 ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module key: (A [r, in], scaled B [out, r])} in fp32, checked against the base model's shapes."""
    f = _open_tensors(path)
    names = list(f.keys())
    shapes = projection_shapes(spec)
    pairs: dict[str, dict[str, str]] = {}
    for name in names:
        if _OUTER_KEY.match(name):
            continue  # the embedding's and the head's (read_outer)
        m = _KEY.match(name)
        if m is None:
            what = ("a replaced or adapted module other than lm_head / embed_tokens" if "lora_" not in name and
                    name.endswith(".weight") and ".layers." not in name else
                    "a DoRA magnitude" if "magnitude" in name else "not a lora_A / lora_B weight of a layer")
            raise LoraWeightsError(f"unsupported adapter tensor ({what}); exlpy adapts "
                                   f"{', '.join([*BLOCK_OF, *OUTER])} and replaces {', '.join(OUTER)}",
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
    if not pairs and not any(_OUTER_KEY.match(n) for n in names):
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


@dataclass
class OuterWeights:
    """An adapter's change to the embedding or the head: a replacement table [vocab, hidden] (as stored), a
    low-rank pair (fp32; head: A [r, hidden], B [vocab, r]; embedding: A [r, vocab], B [hidden, r]; scaling
    folded into B), or both (the LoRA then adds to the replaced module, as PEFT's base_layer + LoRA does)."""

    table: torch.Tensor | None = None
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None

    @property
    def rank(self) -> int:
        return 0 if self.a is None else int(self.a.shape[0])


def read_outer(path: str, model: Any, cfg: AdapterConfig, lora_scaling: float) -> dict[str, OuterWeights]:
    """{"model.embed_tokens" | "lm_head": OuterWeights} of the adapter file (see the module docstring)."""
    f = _open_tensors(path)
    spec = model.config.spec
    vocab, hidden = spec.vocab_size, spec.hidden_size
    found: dict[str, dict[str, str]] = {}
    for name in f.keys():
        m = _OUTER_KEY.match(name)
        if m is None or m["original"]:
            continue  # block projections (read_weights); original_module: PEFT's copy of the base, as exllamav2
        module = m[1]
        part = ("replace" if m["replace"] else "base" if m["base"] else f"lora_{m['ab']}" if m["ab"] else
                f"emb_{m['eab']}")
        if part.startswith("lora_") and module == "model.embed_tokens" or part.startswith("emb_") and \
                module == "lm_head":
            raise LoraWeightsError(f"{name.rsplit('.', 2)[-2]} is not a LoRA tensor PEFT writes for {module} (an "
                                   "embedding uses lora_embedding_A / _B, a linear lora_A / lora_B)", tensor=name,
                                   file=path)
        if part in found.setdefault(module, {}) or {part, *found[module]} >= {"replace", "base"}:
            other = found[module].get(part) or found[module].get("base" if part == "replace" else "replace")
            raise LoraWeightsError(f"{module} is replaced twice (also by {other})", tensor=name, file=path)
        found[module][part] = name
    out: dict[str, OuterWeights] = {}
    for module, parts in found.items():
        w = OuterWeights()
        table_name = parts.get("replace") or parts.get("base")
        if table_name is not None:
            t = _float_tensor(f, table_name, path)
            if tuple(t.shape) != (vocab, hidden):
                raise LoraWeightsError(f"shape {list(t.shape)}: a replaced {module} must be [{vocab}, {hidden}] "
                                       "(vocab_size, hidden_size of the base model); adapters for a resized "
                                       "vocabulary are not supported", tensor=table_name, file=path)
            if "replace" in parts or not _same_as_base(model, module, t):
                w.table = t.contiguous()
        a_name, b_name = (parts.get("lora_A"), parts.get("lora_B")) if module == "lm_head" else \
            (parts.get("emb_A"), parts.get("emb_B"))
        if (a_name is None) != (b_name is None):
            have = a_name or b_name
            raise LoraWeightsError(f"the other half of {module}'s LoRA pair is missing", tensor=have, file=path)
        if a_name is not None and b_name is not None:
            a, b = _float_tensor(f, a_name, path), _float_tensor(f, b_name, path)
            in_f, out_f = (hidden, vocab) if module == "lm_head" else (vocab, hidden)
            if a.dim() != 2 or a.shape[1] != in_f or a.shape[0] < 1:
                raise LoraWeightsError(f"shape {list(a.shape)} does not fit the base model: must be [r, {in_f}]",
                                       tensor=a_name, file=path)
            r = a.shape[0]
            if tuple(b.shape) != (out_f, r):
                raise LoraWeightsError(f"shape {list(b.shape)} does not fit the base model: must be [{out_f}, {r}]",
                                       tensor=b_name, file=path)
            if r != cfg.rank(module):
                raise LoraWeightsError(f"rank {r}, but {cfg.path} gives rank {cfg.rank(module)} for {module}",
                                       tensor=a_name, file=path)
            w.a, w.b = a.float().contiguous(), (b.float() * (lora_scaling * cfg.scaling(module, r))).contiguous()
        if w.table is not None or w.a is not None:
            out[module] = w
    return out


def _float_tensor(f: Any, name: str, path: str) -> torch.Tensor:
    t = f.get_tensor(name)
    if not t.is_floating_point():
        raise LoraWeightsError(f"dtype {t.dtype} is not a floating-point type", tensor=name, file=path)
    if not bool(torch.isfinite(t).all()):
        raise LoraWeightsError("holds NaN or inf", tensor=name, file=path)
    return t


def _same_as_base(model: Any, module: str, t: torch.Tensor) -> bool:
    """Whether a saved base layer equals the model's own weights (fp16 rounding allowed). A quantized base's
    head stands for the saved one (the adapter was trained on the unquantized model)."""
    index = model.config.index
    name = f"{module}.weight"
    if name not in index and module == "lm_head" and model.config.spec.features.tied_head:
        name = "model.embed_tokens.weight"
    if name not in index:
        return True
    base = index.get(name).float()
    return bool((t.float() - base).abs().max() <= 1e-3 * base.abs().max().clamp(min=1e-6))


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
        self.outer = read_outer(lora_path, model, cfg, float(lora_scaling))
        if self.outer and cfg.ensure_weight_tying and model.config.spec.features.tied_head:
            raise LoraConfigError(f"{lora_config_path}: ensure_weight_tying = true (one shared change of the tied "
                                  f"embedding and head) is not supported for {' and '.join(self.outer)}; exlpy "
                                  "applies the embedding's and the head's changes separately")
        if self.outer and getattr(model, "tp_context", None) is not None:
            raise LoraConfigError(f"{lora_config_path}: adapters that replace or adapt "
                                  f"{' and '.join(self.outer)} are not supported under tensor parallelism (the "
                                  "embedding and the head are split by vocabulary); load the model without TP")
        # exllamav2 stores the effective factor: the user's scale times alpha / r (alpha / sqrt(r) with rsLoRA),
        # from the config's top-level r and lora_alpha (per-module patterns are applied to the weights above).
        self.lora_scaling = float(lora_scaling) * cfg.alpha / (math.sqrt(cfg.r) if cfg.use_rslora else cfg.r)
        order = [*BLOCK_OF, *OUTER]
        self.target_modules = sorted({k.rsplit(".", 1)[1] for k in self.weights} |
                                     {k.rsplit(".", 1)[-1] for k, w in self.outer.items() if w.a is not None},
                                     key=order.index)
        # exllamav2's attributes: the replacement head and embedding tables (None when the adapter has none).
        self.lm_head = self.outer["lm_head"].table if "lm_head" in self.outer else None
        self.embed_tokens = self.outer["model.embed_tokens"].table if "model.embed_tokens" in self.outer else None
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
        if module_key in self.outer:
            return self.outer[module_key].rank
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
        self.weights, self.outer = {}, {}
        self.lm_head = self.embed_tokens = None

    def check_usable(self, model: Any) -> None:
        if model is not None and self.model is not model:
            raise ModelStateError(f"LoRA adapter {self.name!r} was loaded for another model")
        if not self.loaded:
            raise ModelStateError(f"LoRA adapter {self.name!r} was unloaded")

    def __repr__(self) -> str:
        return (f"ExLlamaV2Lora({self.name!r}, r={self.lora_r}, alpha={self.lora_alpha}, "
                f"scaling={self.lora_scaling}, modules={self.target_modules})")
