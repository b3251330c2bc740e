"""Command-line flags of the converter, with exllamav2's names and defaults (spec §4.1)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from exlpy.convert.settings import ConvertSettings

DESCRIPTION = ("Convert a Hugging Face model (fp16/bf16/fp32 safetensors) to EXL2: measure, optimize, quantize "
               "and compile, as a resumable job.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = ConvertSettings()
    p.add_argument("-i", "--in_dir", help="source model directory (not needed to resume a job)")
    p.add_argument("-o", "--out_dir", help="work directory: job state, checkpoints, measurement (default: a "
                   "temporary one, removed after a successful -cf run)")
    p.add_argument("-cf", "--compile_full", help="write the complete converted model directory here")
    p.add_argument("-b", "--bits", type=float, default=d.bits, help=f"target bits per weight (default {d.bits})")
    p.add_argument("-hb", "--head_bits", type=int, default=d.head_bits, help="bits of the output head: 2, 3, 4, 5, "
                   f"6 or 8 (default {d.head_bits})")
    p.add_argument("-c", "--cal_dataset", help="calibration data: .parquet (text column(s)), .txt or .jsonl "
                   "(default: the built-in mixed set)")
    p.add_argument("-m", "--measurement", help="reuse this measurement.json (exlpy's or exllamav2's)")
    p.add_argument("-om", "--output_measurement", action="store_true", help="measure only, write "
                   "OUT_DIR/measurement.json and stop")
    p.add_argument("-r", "--dataset_rows", type=int, default=d.rows, help=f"calibration rows (default {d.rows})")
    p.add_argument("-l", "--length", type=int, default=d.length, help=f"tokens per row (default {d.length})")
    p.add_argument("-mr", "--measurement_rows", type=int, default=d.measurement_rows,
                   help=f"measurement rows (default {d.measurement_rows})")
    p.add_argument("-ml", "--measurement_length", type=int, default=d.measurement_length,
                   help=f"tokens per measurement row (default {d.measurement_length})")
    p.add_argument("-ss", "--shard_size", type=int, default=d.shard_size, help="output shard size in MB, 0 = one "
                   f"file (default {d.shard_size})")
    resume = p.add_mutually_exclusive_group()
    resume.add_argument("-res", "--resume", action="store_true", help="resume the job in OUT_DIR (the default)")
    resume.add_argument("-nr", "--no_resume", action="store_true", help="discard the job in OUT_DIR and restart")
    p.add_argument("-rs", "--rope_scale", type=float, default=None,
                   help="linear RoPE scale for the calibration forward (config.scale_pos_emb)")
    p.add_argument("-ra", "--rope_alpha", type=float, default=None,
                   help="NTK RoPE alpha for the calibration forward (config.scale_alpha_value)")
    p.add_argument("-so", "--status_output", action="store_true",
                   help='print exllamav2\'s status lines on stdout: [STATUS]{"stage": ..., "completion": ...}[/STATUS]')
    p.add_argument("-hsol", "--hidden_state_offload_layers", type=int, default=None,
                   help="accepted for exllamav2 compatibility; no effect (exlpy moves hidden states to host memory "
                   "by itself when they do not fit)")
    p.add_argument("-fst", "--fast_safetensors", action="store_true",
                   help="accepted for exllamav2 compatibility; no effect (deprecated there too)")
    p.add_argument("--learned_rounding", type=int, default=d.learned_rounding, metavar="PASSES",
                   help="passes of learned rounding after GPTQ: every code and scale re-chosen to lower each "
                   f"layer's output error (exlpy; default {d.learned_rounding}; 0 = GPTQ's rounding)")
    p.add_argument("--block_tune", type=int, default=d.block_tune, metavar="STEPS",
                   help="steps of block-wise output tuning after learned rounding: each attention/MLP block's "
                   "weight codes and scales tuned together so the block's output matches the source block's "
                   f"(AutoRound-style; exlpy; default {d.block_tune} = off)")
    p.add_argument("--block_tune_tokens", type=int, default=d.block_tune_tokens, metavar="TOKENS",
                   help=f"calibration tokens per block-tuning step (exlpy; default {d.block_tune_tokens})")
    norms = p.add_mutually_exclusive_group()
    norms.add_argument("--block_tune_norms", dest="block_tune_norms", action="store_true",
                       default=d.block_tune_norms,
                       help="with --block_tune: also tune each block's input-norm weight (a per-channel scale of the "
                       "first projections' inputs, OmniQuant-style), written in place of the source's (exlpy; "
                       f"default {'on' if d.block_tune_norms else 'off'})")
    norms.add_argument("--no_block_tune_norms", dest="block_tune_norms", action="store_false",
                       help="with --block_tune: tune the codes and scales only, keep the source's norms (exlpy)")
    p.add_argument("--target", choices=("quantized", "source"), default=d.target,
                   help="what each layer's quantization aims at: the source weights' output on the quantized "
                   "inputs (GPTQ) or the source model's output (asymmetric calibration) (exlpy; default "
                   f"{d.target})")
    p.add_argument("--objective", choices=("error", "sensitivity", "kl"), default=d.objective,
                   help="what the bit allocation minimizes: the modules' errors, or each weighted by the measured "
                   "sensitivity of the output to noise there (sensitivity) or to the module's own quantization at "
                   f"this bpw (kl) (exlpy; default {d.objective})")
    p.add_argument("--device", help="device to convert on (default: cuda:0 when there is a GPU, else cpu)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars or summary")


def settings_from_args(a: argparse.Namespace) -> dict[str, Any]:
    return {"in_dir": a.in_dir, "out_dir": a.out_dir, "compile_dir": a.compile_full, "bits": a.bits,
            "head_bits": a.head_bits, "cal_dataset": a.cal_dataset, "measurement": a.measurement,
            "output_measurement": a.output_measurement, "rows": a.dataset_rows, "length": a.length,
            "measurement_rows": a.measurement_rows, "measurement_length": a.measurement_length,
            "shard_size": a.shard_size, "no_resume": a.no_resume, "device": a.device, "progress": not a.quiet,
            "rope_scale": a.rope_scale, "rope_alpha": a.rope_alpha, "status_output": a.status_output,
            "learned_rounding": a.learned_rounding,
            "block_tune": a.block_tune, "block_tune_tokens": a.block_tune_tokens,
            "block_tune_norms": a.block_tune_norms, "target": a.target,
            "objective": a.objective}


def deprecated_notices(a: argparse.Namespace) -> list[str]:
    """Notices for exllamav2 flags that are accepted and change nothing."""
    out = []
    if a.fast_safetensors:
        out.append("-fst/--fast_safetensors is deprecated and has no effect")
    if a.hidden_state_offload_layers is not None:
        out.append("-hsol/--hidden_state_offload_layers has no effect: exlpy keeps hidden states on the GPU while "
                   "they fit and moves them to host memory by itself otherwise")
    return out


def run(a: argparse.Namespace) -> int:
    from exlpy.convert.pipeline import convert

    for notice in deprecated_notices(a):
        print(f"exlpy convert: note: {notice}", file=sys.stderr)
    kw = settings_from_args(a)
    convert(kw.pop("in_dir"), kw.pop("out_dir"), kw.pop("compile_dir"), **kw)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m exlpy.convert`: the same flags as `exlpy convert`, typed errors printed without a traceback."""
    from exlpy.errors import ExlpyError

    p = argparse.ArgumentParser(prog="python -m exlpy.convert", description=DESCRIPTION)
    add_arguments(p)
    a = p.parse_args(argv)
    try:
        return run(a)
    except ExlpyError as e:
        print(f"exlpy convert: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("exlpy convert: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
