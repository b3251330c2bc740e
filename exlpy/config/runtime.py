"""exllamav2's runtime RoPE attributes on `ExLlamaV2Config` (spec §2 "RoPE scaling", §6.5 `--rope_yarn`).

exllamav2 scripts change RoPE by assigning config attributes after `prepare()` (`alt_rope_method`,
`yarn_rope_factor`, `l3_rope_*`, `rotary_embedding_base`, ...). Here those attributes are views of one
override table; each assignment rebuilds `config.spec` (what the model reads) as config.json's spec with the
overrides applied, so it changes the RoPE tables the next load builds. Changing them while a model built on
this config is loaded raises ModelStateError instead of being ignored (the tables already exist on the devices).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

from exlpy.config.hf import ModelSpec
from exlpy.config.rope import RopeScaling
from exlpy.errors import ConfigError, ModelStateError, NotSupportedError

ROPE_METHODS = (None, "yarn", "llama3", "su")
# attribute -> (RopeScaling kind it belongs to, RopeScaling field)
SCALING_ATTRS: dict[str, tuple[str, str]] = {
    "yarn_rope_factor": ("yarn", "factor"),
    "yarn_rope_original_max_position_embeddings": ("yarn", "original_max_position_embeddings"),
    "l3_rope_factor": ("llama3", "factor"),
    "l3_rope_low_freq_factor": ("llama3", "low_freq_factor"),
    "l3_rope_high_freq_factor": ("llama3", "high_freq_factor"),
    "l3_rope_original_max_position_embeddings": ("llama3", "original_max_position_embeddings"),
}


def _number(name: str, value: Any, integer: bool = False) -> Any:
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    if not ok or (integer and int(value) != value):
        kind = "a positive integer" if integer else "a positive number"
        raise ConfigError(f"config.{name} must be {kind} or None, got {value!r}")
    return int(value) if integer else float(value)


def _override(name: str) -> property:
    kind, field = SCALING_ATTRS[name]

    def get(self: RuntimeSettings) -> Any:
        if name in self._rope_overrides:
            return self._rope_overrides[name]
        base = self._base_spec
        if base is None or base.rope_scaling.kind != kind:
            return None
        return getattr(base.rope_scaling, field)

    def set_(self: RuntimeSettings, value: Any) -> None:
        self._set_rope(name, _number(name, value, integer=field == "original_max_position_embeddings"))

    return property(get, set_, doc=f"RoPE setting ({kind} scaling: {field}); None when the model has none")


class RuntimeSettings:
    """Mixin of ExLlamaV2Config: the RoPE attributes and the effective `spec`."""

    _base_spec: ModelSpec | None
    _rope_overrides: dict[str, Any]
    _scale_pos_emb: float
    _scale_alpha_value: float

    def _init_runtime(self) -> None:
        self._base_spec = None
        self._rope_overrides = {}
        self.spec: ModelSpec | None = None
        # Models built on this config that are loaded: their RoPE tables exist, so RoPE settings are frozen.
        self._loaded_models: weakref.WeakSet[Any] = weakref.WeakSet()

    # --- the spec the model reads -----------------------------------------------------------------------------
    # `spec` stays a plain attribute (modules read it on every forward): each RoPE assignment rebuilds it.
    def _set_base_spec(self, spec: ModelSpec | None) -> None:
        """prepare() read config.json: like exllamav2's, it resets every RoPE attribute to the file's values."""
        self._base_spec = spec
        self._rope_overrides = {}
        self.spec = spec

    def _refresh_spec(self) -> None:
        base = self._base_spec
        if base is not None:
            self.spec = dataclasses.replace(base, rope_theta=self.rotary_embedding_base, rope_scaling=self._scaling())

    def _scaling(self) -> RopeScaling:
        base = self._base_spec
        assert base is not None
        method = self.alt_rope_method
        if method is None:
            # No alternative method: plain RoPE (linear scaling lives in scale_pos_emb, as in exllamav2).
            return RopeScaling()
        fields = {f: getattr(self, a) for a, (k, f) in SCALING_ATTRS.items() if k == method}
        missing = [a for a, (k, f) in SCALING_ATTRS.items() if k == method and fields[f] is None]
        if missing:
            # Scripts set the method and its values one by one: an incomplete setting is only an error if the
            # RoPE tables are built from it (rope.py raises this message then).
            return RopeScaling("invalid", problem=f"config.alt_rope_method is {method!r} but "
                                                  f"{', '.join('config.' + m for m in missing)} is not set")
        keep = base.rope_scaling if base.rope_scaling.kind == method else RopeScaling(method)
        return dataclasses.replace(keep, kind=method, **fields)

    def _set_rope(self, name: str, value: Any) -> None:
        models = list(getattr(self, "_loaded_models", ()))
        if models:
            raise ModelStateError(f"config.{name} cannot change while a model built on this config is loaded (its "
                                  "RoPE tables are already on the devices): call model.unload(), change it, then "
                                  "load the model again")
        if name in ("scale_pos_emb", "scale_alpha_value"):
            setattr(self, "_" + name, value)  # plain values, read by the RoPE tables directly
            return
        self._rope_overrides[name] = value
        self._refresh_spec()

    # --- attributes ------------------------------------------------------------------------------------------
    @property
    def rotary_embedding_base(self) -> float:
        if "rotary_embedding_base" in self._rope_overrides:
            return float(self._rope_overrides["rotary_embedding_base"])
        if self._base_spec is None:
            raise ConfigError("config is not prepared; call prepare() first")
        return self._base_spec.rope_theta

    @rotary_embedding_base.setter
    def rotary_embedding_base(self, value: float) -> None:
        self._set_rope("rotary_embedding_base", _number("rotary_embedding_base", value))

    @property
    def alt_rope_method(self) -> str | None:
        """None (plain RoPE, or linear through scale_pos_emb), "yarn" or "llama3" ("su"/longrope is not
        supported)."""
        if "alt_rope_method" in self._rope_overrides:
            return self._rope_overrides["alt_rope_method"]
        base = self._base_spec
        return base.rope_scaling.kind if base is not None and base.rope_scaling.kind in ("yarn", "llama3") else None

    @alt_rope_method.setter
    def alt_rope_method(self, value: str | None) -> None:
        if value not in ROPE_METHODS:
            raise ConfigError(f"config.alt_rope_method must be one of {ROPE_METHODS}, got {value!r}")
        if value == "su":
            raise NotSupportedError("config.alt_rope_method = 'su' (LongRoPE / Phi-3 scaling) is not supported by "
                                    "exlpy; supported: None (with scale_pos_emb / scale_alpha_value), 'yarn', "
                                    "'llama3'")
        self._set_rope("alt_rope_method", value)

    yarn_rope_factor = _override("yarn_rope_factor")
    yarn_rope_original_max_position_embeddings = _override("yarn_rope_original_max_position_embeddings")
    l3_rope_factor = _override("l3_rope_factor")
    l3_rope_low_freq_factor = _override("l3_rope_low_freq_factor")
    l3_rope_high_freq_factor = _override("l3_rope_high_freq_factor")
    l3_rope_original_max_position_embeddings = _override("l3_rope_original_max_position_embeddings")

    @property
    def scale_pos_emb(self) -> float:
        """Linear RoPE scaling: positions are divided by this."""
        return self._scale_pos_emb

    @scale_pos_emb.setter
    def scale_pos_emb(self, value: float) -> None:
        # None means "no scaling" in exllamav2 scripts (`if cfg.scale_pos_emb: ...`).
        self._set_rope("scale_pos_emb", 1.0 if value is None else _number("scale_pos_emb", value))

    @property
    def scale_alpha_value(self) -> float:
        """NTK-aware alpha: the RoPE base is stretched by alpha^(d/(d-2))."""
        return self._scale_alpha_value

    @scale_alpha_value.setter
    def scale_alpha_value(self, value: float) -> None:
        self._set_rope("scale_alpha_value", 1.0 if value is None else _number("scale_alpha_value", value))

    @property
    def scale_long_factor(self) -> None:
        return None  # LongRoPE ("su") factors: exlpy rejects such models at prepare()

    @scale_long_factor.setter
    def scale_long_factor(self, value: Any) -> None:
        if value is not None:
            raise NotSupportedError("config.scale_long_factor (LongRoPE / 'su' scaling) is not supported by exlpy")

    @property
    def scale_short_factor(self) -> None:
        return None

    @scale_short_factor.setter
    def scale_short_factor(self, value: Any) -> None:
        if value is not None:
            raise NotSupportedError("config.scale_short_factor (LongRoPE / 'su' scaling) is not supported by exlpy")
