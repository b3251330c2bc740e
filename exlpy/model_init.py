"""exllamav2's `model_init`: the command-line model setup its example scripts share (spec §6.5).

    parser = argparse.ArgumentParser()
    model_init.add_args(parser)
    args = parser.parse_args()
    model_init.check_args(args)
    model_init.print_options(args)
    model, tokenizer = model_init.init(args)

With `-gs auto` the model comes back unloaded (pass allow_auto_split=True): create a lazy cache and call
`model.load_autosplit(cache)`. A wrong argument ends the script with a one-line message on stderr and exit
status 1 (CommandLineError), where exllamav2 printed it and exited with status 0.

Flags of exllamav2 back ends exlpy does not have (-nfa flash-attn, -nxf xformers, -nsdpa SDPA) are accepted and
set on the config; they change nothing, since exlpy's attention uses none of those libraries. -fst is a no-op
in exllamav2 too.
"""

from __future__ import annotations

import argparse
import glob
import os
import time

import torch

from exlpy.config import ExLlamaV2Config
from exlpy.engine import ExLlamaV2
from exlpy.errors import CommandLineError, ExlpyError
from exlpy.tokenizer import ExLlamaV2Tokenizer

__all__ = ["add_args", "check_args", "init", "post_init_load", "print_options"]


def add_args(parser: argparse.ArgumentParser) -> None:
    """Add exllamav2's model arguments to `parser` (the same short and long names)."""
    a = parser.add_argument
    a("-m", "--model_dir", type=str, help="Path to model directory")
    a("-gs", "--gpu_split", type=str,
      help='"auto", or VRAM allocation per GPU in GB. "auto" is implied by default in tensor-parallel mode.')
    a("-tp", "--tensor_parallel", action="store_true", help="Load in tensor-parallel mode")
    a("-l", "--length", type=int, help="Maximum sequence length")
    a("-rs", "--rope_scale", type=float, help="RoPE scaling factor")
    a("-ra", "--rope_alpha", type=float, help="RoPE alpha value (NTK)")
    a("-ry", "--rope_yarn", type=float,
      help="Set RoPE YaRN factor (use default max_seq_len as original_max_position_embeddings if not configured)")
    a("-nfa", "--no_flash_attn", action="store_true", help="Disable Flash Attention (no effect in exlpy)")
    a("-nxf", "--no_xformers", action="store_true", help="Disable xformers (no effect in exlpy)")
    a("-nsdpa", "--no_sdpa", action="store_true", help="Disable Torch SDPA (no effect in exlpy)")
    a("-ng", "--no_graphs", action="store_true", help="Disable CUDA graphs")
    a("-lm", "--low_mem", action="store_true", help="Enable VRAM optimizations, potentially trading off speed")
    a("-ept", "--experts_per_token", type=int, help="Override MoE model's default number of experts per token")
    a("-lq4", "--load_q4", action="store_true", help="Load weights in Q4 mode")
    a("-fst", "--fast_safetensors", action="store_true", help="Deprecated (does nothing)")
    a("-ic", "--ignore_compatibility", action="store_true",
      help="Do not override model config options in case of compatibility issues")
    a("-chunk", "--chunk_size", type=int, help="Chunk size ('input length')")


_PRINTED = (("gpu_split", "gpu_split: {}"), ("tensor_parallel", "tensor_parallel"), ("length", "length: {}"),
            ("rope_scale", "rope_scale: {}"), ("rope_alpha", "rope_alpha: {}"), ("rope_yarn", "rope_yarn: {}"),
            ("no_flash_attn", "no_flash_attn"), ("no_xformers", "no_xformers"), ("no_sdpa", "no_sdpa"),
            ("no_graphs", "no_graphs"), ("low_mem", "low_mem"), ("experts_per_token", "experts_per_token: {}"),
            ("load_q4", "load_q4"), ("ignore_compatibility", "ignore_compatibility"),
            ("chunk_size", "chunk_size: {}"))


def print_options(args: argparse.Namespace) -> None:
    """Print the model directory and the options that are set, as exllamav2 does."""
    print(f" -- Model: {args.model_dir}")
    opts = []
    for name, fmt in _PRINTED:
        value = getattr(args, name, None)
        if value is not None and value is not False:
            opts.append(fmt.format(value))
    print(f" -- Options: {opts}")


def check_args(args: argparse.Namespace) -> None:
    """The model directory exists and holds config.json, a tokenizer and *.safetensors files."""
    if not args.model_dir:
        raise CommandLineError(" ## Error: No model directory specified (-m / --model_dir)")
    if not os.path.isdir(args.model_dir):
        raise CommandLineError(f" ## Error: Can't find model directory: {args.model_dir}")
    for alternatives in (["config.json"], ["tokenizer.model", "tokenizer.json"], ["*.safetensors"]):
        if not any(glob.glob(os.path.join(args.model_dir, f)) for f in alternatives):
            raise CommandLineError(f" ## Error: Cannot find {' or '.join(alternatives)} in {args.model_dir}")


def _configure(config: ExLlamaV2Config, args: argparse.Namespace, max_batch_size: int | None,
               max_input_len: int | None, max_output_len: int | None) -> None:
    if args.rope_yarn:
        if config.alt_rope_method != "yarn":
            # No YaRN in config.json: the model's current length is the length it was trained for.
            config.yarn_rope_original_max_position_embeddings = config.max_seq_len
        config.alt_rope_method = "yarn"
        config.yarn_rope_factor = args.rope_yarn
    if args.length:
        config.max_seq_len = args.length
    if args.rope_scale:
        config.scale_pos_emb = args.rope_scale
    if args.rope_alpha:
        config.scale_alpha_value = args.rope_alpha
    config.no_flash_attn = config.no_flash_attn or bool(args.no_flash_attn)
    config.no_xformers = config.no_xformers or bool(args.no_xformers)
    config.no_sdpa = config.no_sdpa or bool(args.no_sdpa)
    config.no_graphs = config.no_graphs or bool(args.no_graphs)
    if args.experts_per_token:
        config.num_experts_per_token = args.experts_per_token
    if max_batch_size:
        config.max_batch_size = max_batch_size
    config.max_output_len = max_output_len
    if max_input_len:
        config.max_input_len = max_input_len
    if args.low_mem:
        config.set_low_mem()
    if args.load_q4:
        config.load_in_q4 = True
    if args.chunk_size is not None:
        if args.chunk_size < 1:
            raise CommandLineError(f" ## Error: --chunk_size must be >= 1, got {args.chunk_size}")
        config.max_input_len = args.chunk_size
        config.max_attention_size = args.chunk_size**2
    config.arch_compat_overrides(warn_only=bool(args.ignore_compatibility))


def init(args: argparse.Namespace, quiet: bool = False, allow_auto_split: bool = False, skip_load: bool = False,
         benchmark: bool = False, max_batch_size: int | None = None, max_input_len: int | None = None,
         max_output_len: int | None = None, progress: bool = False) -> tuple[ExLlamaV2, ExLlamaV2Tokenizer]:
    """Config from the arguments, the model (loaded unless skip_load or `-gs auto`) and the tokenizer."""
    config = ExLlamaV2Config()
    config.model_dir = args.model_dir
    try:
        config.prepare()
        _configure(config, args, max_batch_size, max_input_len, max_output_len)
    except ExlpyError as e:  # a setting the arguments asked for: report it as a command-line error
        raise CommandLineError(f" ## Error: {e}") from e
    model = ExLlamaV2(config)
    if not skip_load:
        post_init_load(model, args, quiet, allow_auto_split, benchmark, progress)
    if not quiet:
        print(" -- Loading tokenizer...")
    return model, ExLlamaV2Tokenizer(config)


def _split(args: argparse.Namespace) -> list[float] | None:
    if not args.gpu_split or args.gpu_split == "auto":
        return None
    try:
        split = [float(x) for x in args.gpu_split.split(",")]
    except ValueError:
        raise CommandLineError(f' ## Error: --gpu_split must be "auto" or comma-separated GB per GPU, got '
                               f"{args.gpu_split!r}") from None
    if len(split) > torch.cuda.device_count():
        raise CommandLineError(f" ## Error: Too many entries in gpu_split. {torch.cuda.device_count()} CUDA devices "
                               "are available.")
    return split


def post_init_load(model: ExLlamaV2, args: argparse.Namespace, quiet: bool = False, allow_auto_split: bool = False,
                   benchmark: bool = False, progress: bool = False) -> None:
    """Load the model as the arguments say: tensor-parallel, by gpu_split budgets, or (with `-gs auto`) not at
    all, leaving it to `model.load_autosplit(cache)`."""
    split = _split(args)
    if args.tensor_parallel:
        model.load_tp(split, progress=progress)
    elif args.gpu_split != "auto":
        if not quiet and not progress:
            print(" -- Loading model...")
        t = time.time()
        model.load(split, progress=progress)
        if benchmark and not quiet:
            print(f" -- Loaded model in {time.time() - t:.4f} seconds")
    elif not allow_auto_split:
        raise CommandLineError(' ## Error: --gpu_split auto is not allowed by this script (it loads the model '
                               "itself); give a split in GB per GPU")
