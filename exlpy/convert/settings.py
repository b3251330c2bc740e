"""Conversion settings: exllamav2's flags and defaults (spec §4.1), validated before any work starts."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from exlpy.convert.qparams import HEAD_BITS
from exlpy.errors import ConvertSettingsError

MAX_BPW = 8.0


@dataclass
class ConvertSettings:
    in_dir: str | None = None
    out_dir: str | None = None  # work dir (-o); a temporary one when None
    compile_dir: str | None = None  # -cf
    bits: float = 4.125
    head_bits: int = 6
    cal_dataset: str | None = None
    measurement: str | None = None  # -m: reuse
    output_measurement: bool = False  # -om: measure only
    rows: int = 100
    length: int = 2048
    measurement_rows: int = 16
    measurement_length: int = 2048
    shard_size: int = 8192  # MB, 0 = one file
    no_resume: bool = False
    device: str | None = None  # None: cuda:0 when there is a GPU, else the CPU
    # Hessian damping, fraction of its mean diagonal (exllamav2: 0.12). 0.1: with learned rounding on SmolLM2 the KL
    # to the source fell 2.7% at 3.0 bpw and 1.7% at 4.0 against 0.01 (0.003 and 0.3 were worse at 3.0);
    # benchmarks/results/convert_quality.md
    damp: float = 0.1
    scale_norm: float = 2.0  # exponent of the error the scale search minimizes (exllamav2: 3.5)
    act_order: str = "auto"  # "on" (exllamav2), "off", or "auto": per matrix group, whichever errs less
    # What each linear's quantization aims at (exlpy/convert/quantize.py): "quantized", the output of the source
    # weights on the quantized model's inputs (GPTQ, exllamav2), or "source", the unquantized model's output
    # (asymmetric calibration, GPTAQ; it lost on SmolLM2 with 8k calibration tokens: benchmarks/results/
    # convert_quality.md)
    target: str = "quantized"
    # What the bit allocation minimizes (exlpy/convert/optimize.py): "error", the plain sum of the modules'
    # per-token errors, or "sensitivity", each weighted by how much the final distribution reacts to error at
    # that module (exlpy/convert/sensitivity.py; on SmolLM2 it won at 4.0 bpw and lost at 3.0, so it is no default),
    # or "kl", each weighted by the final distribution's KL per unit of error of that module's own quantization
    # with the option "error" picks at this bpw (pipeline._kl_weights; on SmolLM2 within 1% of "error" in KL)
    objective: str = "error"
    sensitivity_tokens: int = 2048  # calibration tokens of the sensitivity pass (from the measurement rows)
    # Passes of learned rounding after GPTQ: codes and scales re-chosen by coordinate descent on each linear's
    # output error (exlpy/convert/gptq.py refine_rounding; on SmolLM2 2 passes cut the KL to the source by 6-7%
    # at 3.0 and 4.0 bpw for about one GPTQ per pass); 0 = GPTQ's rounding
    learned_rounding: int = 2
    # Steps of block-wise output tuning after learned rounding (exlpy/convert/blocktune.py, AutoRound-style): each
    # attention / MLP block's codes and scales tuned together on the block's output error, `block_tune_tokens`
    # calibration tokens a step; 0 = off
    block_tune: int = 0
    block_tune_tokens: int = 1024
    # With block tuning (block_tune > 0), each block's input-norm weight is tuned too (OmniQuant-style per-channel
    # scale of the first projections' inputs) and written in place of the source's fp16 norm: on SmolLM2 it cut the
    # KL to the source by 3.5% at 3.0 bpw and 3.6% at 4.0 against block tuning alone (benchmarks/results/
    # convert_quality.md, fourth round)
    block_tune_norms: bool = True
    progress: bool = True
    rope_scale: float | None = None  # -rs: linear RoPE scale for the calibration forward (config.scale_pos_emb)
    rope_alpha: float | None = None  # -ra: NTK alpha for the calibration forward (config.scale_alpha_value)
    status_output: bool = False  # -so: exllamav2's [STATUS]{...}[/STATUS] lines on stdout

    def validate(self) -> None:
        if self.head_bits not in HEAD_BITS:
            raise ConvertSettingsError(f"-hb/--head_bits must be one of {', '.join(map(str, HEAD_BITS))}, got "
                                       f"{self.head_bits}")
        if not self.bits > 0 or self.bits > MAX_BPW:
            raise ConvertSettingsError(f"-b/--bits {self.bits} is outside the reachable range: EXL2 targets go "
                                       f"up to {MAX_BPW:g} bits per weight")
        for name in ("rows", "length", "measurement_rows", "measurement_length", "sensitivity_tokens"):
            if getattr(self, name) < 1:
                raise ConvertSettingsError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.shard_size < 0:
            raise ConvertSettingsError(f"-ss/--shard_size must be >= 0 MB (0 = one file), got {self.shard_size}")
        if self.output_measurement and self.compile_dir:
            raise ConvertSettingsError("-om (measure only) and -cf (compile a model) exclude each other")
        if self.output_measurement and self.measurement:
            raise ConvertSettingsError("-om (measure) and -m (reuse a measurement) exclude each other")
        if self.out_dir is None and self.compile_dir is None:
            raise ConvertSettingsError("give -o WORK_DIR and/or -cf OUTPUT_DIR")
        if self.out_dir is None and self.output_measurement:
            raise ConvertSettingsError("-om needs -o WORK_DIR: the measurement is written there")
        if self.act_order not in ("on", "off", "auto"):
            raise ConvertSettingsError(f"act_order must be 'on', 'off' or 'auto', got {self.act_order!r}")
        for name, flag in (("rope_scale", "-rs/--rope_scale"), ("rope_alpha", "-ra/--rope_alpha")):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and 0 < v < float("inf")):
                raise ConvertSettingsError(f"{flag} must be a positive number, got {v}")
        if self.target not in ("source", "quantized"):
            raise ConvertSettingsError(f"target must be 'source' or 'quantized', got {self.target!r}")
        if not isinstance(self.learned_rounding, int) or not 0 <= self.learned_rounding <= 100:
            raise ConvertSettingsError(f"--learned_rounding takes 0 to 100 passes, got {self.learned_rounding!r}")
        if not isinstance(self.block_tune, int) or not 0 <= self.block_tune <= 100000:
            raise ConvertSettingsError(f"--block_tune takes 0 to 100000 steps, got {self.block_tune!r}")
        if not isinstance(self.block_tune_tokens, int) or self.block_tune_tokens < 1:
            raise ConvertSettingsError(f"--block_tune_tokens must be a positive integer, got "
                                       f"{self.block_tune_tokens!r}")
        if not isinstance(self.block_tune_norms, bool):
            raise ConvertSettingsError(f"block_tune_norms must be true or false, got {self.block_tune_norms!r}")
        if self.objective not in ("sensitivity", "error", "kl"):
            raise ConvertSettingsError(f"objective must be 'error', 'sensitivity' or 'kl', got {self.objective!r}")
        if not 0 < self.damp < 10:
            raise ConvertSettingsError(f"damp must be in (0, 10), got {self.damp}")

    def fingerprint(self) -> dict[str, Any]:
        """The settings that decide the output: a resumed job must have the same."""
        def ident(path: str | None) -> str | None:
            if path is None:
                return None
            p = os.path.abspath(path)
            return f"{p} ({os.path.getsize(p)} bytes)" if os.path.isfile(p) else p

        d = asdict(self)
        keep = ("bits", "head_bits", "rows", "length", "measurement_rows", "measurement_length", "damp", "scale_norm",
                "act_order", "target", "objective",
                "sensitivity_tokens", "learned_rounding", "block_tune", "block_tune_tokens", "rope_scale", "rope_alpha")
        out = {k: d[k] for k in keep}
        if self.block_tune > 0 and self.block_tune_norms:  # only then does it decide anything (and older jobs,
            out["block_tune_norms"] = True  # without the key, resume)
        out.update(in_dir=os.path.abspath(self.in_dir) if self.in_dir else None, cal_dataset=ident(self.cal_dataset),
                   measurement=ident(self.measurement))
        return out
