"""Compile (spec §3.7): the quantized layers plus every other source tensor (fp16) into output shards, and with
-cf a complete model directory (config.json with quantization_config, tokenizer and every other source file)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from exlpy.convert.job import atomic_write, write_json, write_tensors
from exlpy.errors import JobConflictError
from exlpy.weights.safetensors_index import SafetensorsIndex

MARKER = ".exlpy-convert.json"
# Source files not copied: weights (ours replace them) and indexes that describe the source's weight files.
_SKIP_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".safetensors.index.json", ".bin.index.json")


def check_output_dir(out_dir: str, job_id: str, no_resume: bool) -> None:
    """An output dir must be new, empty, or one this converter wrote (for this job, or any with -nr)."""
    if not os.path.isdir(out_dir) or not os.listdir(out_dir):
        return
    marker = os.path.join(out_dir, MARKER)
    if os.path.exists(marker):
        try:
            with open(marker, encoding="utf-8") as f:
                owner = json.load(f).get("job")
        except (OSError, json.JSONDecodeError):
            owner = None
        if owner == job_id or no_resume:
            return
        raise JobConflictError(f"output dir {out_dir} holds the output of a different conversion job; run with "
                               "-nr to overwrite it, or choose another -cf")
    raise JobConflictError(f"output dir {out_dir} is not empty and was not written by exlpy convert; choose an "
                           "empty or new directory")


def _source_tensors(index: SafetensorsIndex, quantized: set[str], written: set[str]
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    for name in sorted(index.tensors, key=_order):
        prefix = name.rsplit(".", 1)[0]
        if prefix in quantized or name in written:
            continue  # replaced by the quantized tensors (a bias is written with them) or by a tuned norm
        t = index.get(name)
        yield name, t.to(torch.float16) if t.is_floating_point() else t


def _order(name: str) -> tuple[int, str]:
    parts = name.split(".")
    if len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2]) + 1, name
    return (0 if "embed" in name else 10**9), name


def stored_names(index: SafetensorsIndex, prefixes: list[str]) -> dict[str, str]:
    """Canonical -> stored tensor-name prefix of every tensor under `prefixes` that the source stores under
    another name by a plain rename (Mixtral's block_sparse_moe.experts.E.w1 for mlp.experts.E.gate_proj), so that
    the output keeps the source's names (exllamav2 loads them; exlpy renames them again). Views of fused
    tensors keep their canonical names (their source has no tensor of that name)."""
    out = {}
    for name, info in index.stored.items():
        if any(name.startswith(p + ".") for p in prefixes) and info.name != name:
            canon, _, leaf = name.rpartition(".")
            stored, _, stored_leaf = info.name.rpartition(".")
            if leaf == stored_leaf:
                out[canon] = stored
    return out


def _renamer(prefixes: dict[str, str]) -> Callable[[str], str]:
    def rename(name: str) -> str:
        prefix, _, leaf = name.rpartition(".")
        return f"{prefixes[prefix]}.{leaf}" if prefix in prefixes else name
    return rename


def compile_output(index: SafetensorsIndex, tensor_files: list[str], quantized: set[str], out_dir: str,
                   shard_mb: int, stored: dict[str, str] | None = None) -> list[str]:
    """Write output(-0000i-of-0000N).safetensors into out_dir; returns the file names. `stored`: canonical ->
    source name prefixes (`stored_names`) the output takes for those tensors, quantized parts included."""
    rename = _renamer(stored or {})
    os.makedirs(out_dir, exist_ok=True)
    limit = shard_mb * 1024**2 if shard_mb > 0 else None
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0

    def add(name: str, t: torch.Tensor) -> None:
        nonlocal size
        nbytes = t.numel() * t.element_size()
        if limit is not None and size and size + nbytes > limit:
            flush()
        shards[-1][name] = t
        size += nbytes

    tmp_names: list[str] = []

    def flush() -> None:
        nonlocal size
        name = os.path.join(out_dir, f".output-part{len(tmp_names)}.tmp.safetensors")
        write_tensors(name, shards[-1])
        tmp_names.append(name)
        shards[-1] = {}
        size = 0

    written: set[str] = set()  # what the job's tensor files hold (block tuning may write a block's norm weight)
    for path in tensor_files:
        with safe_open(path, "pt") as f:
            written.update(f.keys())
    for name, t in _source_tensors(index, quantized, written):
        add(rename(name), t)
    for path in tensor_files:
        for name, t in load_file(path).items():
            add(rename(name), t)
    if shards[-1]:
        flush()
    n = len(tmp_names)
    final = ["output.safetensors"] if n == 1 else [f"output-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for old in os.listdir(out_dir):  # shards of an earlier compile of this job
        if old.startswith("output") and old.endswith(".safetensors") and old not in final:
            os.remove(os.path.join(out_dir, old))
    for tmp, name in zip(tmp_names, final):
        atomic_write(os.path.join(out_dir, name), lambda dst, tmp=tmp: shutil.move(tmp, dst))
    return final


def write_model_dir(src_dir: str, out_dir: str, qconfig: dict, job_id: str) -> None:
    """config.json with quantization_config, and every other non-weight file of the source."""
    with open(os.path.join(src_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"] = qconfig
    write_json(os.path.join(out_dir, "config.json"), config)
    for name in sorted(os.listdir(src_dir)):
        src = os.path.join(src_dir, name)
        if name == "config.json" or not os.path.isfile(src) or name.endswith(_SKIP_SUFFIXES):
            continue
        atomic_write(os.path.join(out_dir, name), lambda dst, src=src: shutil.copyfile(src, dst))
    write_json(os.path.join(out_dir, MARKER), {"job": job_id})
