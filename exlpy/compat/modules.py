"""exllamav2 classes that scripts import from their module paths (`exllamav2.mlp`, `.moe_mlp`,
`.parallel_decoder`, `.conversion.tokenize`, `.conversion.quantize`), mostly for isinstance checks over
`model.modules` (test_inference.py). exlpy's MLP and MoE block are exllamav2's MLP and MoE MLP; the parallel
decoder block belongs to architectures exlpy runs with its MLP, so no module is ever one of them."""

from __future__ import annotations

import gc
from typing import Any

import torch

from exlpy.errors import NotSupportedError
from exlpy.model.mlp import MLP as ExLlamaV2MLP
from exlpy.model.moe import MoEMLP as ExLlamaV2MoEMLP


class ExLlamaV2ParallelDecoder:
    """exllamav2's parallel attention + MLP block (Cohere, ...): not supported by exlpy."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotSupportedError("ExLlamaV2ParallelDecoder: parallel-decoder models are not supported by exlpy")


def get_tokens(num_rows: int, length: int, filename: str, tokenizer: Any) -> torch.Tensor:
    """exllamav2.conversion.tokenize.get_tokens: [num_rows, length] token ids, the first num_rows·length tokens
    of a .parquet (or .txt / .jsonl) dataset."""
    from exlpy.eval.perplexity import dataset_rows

    return dataset_rows(filename, tokenizer, num_rows, length)


def list_live_tensors() -> None:
    """exllamav2.conversion.quantize.list_live_tensors: print the tensors alive in this process (a debugging
    aid), grouped by shape and dtype."""
    counts: dict[str, int] = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor):
                key = f"{tuple(obj.shape)} {obj.dtype} {obj.device}"
                counts[key] = counts.get(key, 0) + 1
        except ReferenceError:  # a weakly referenced object gone while walking
            continue
    for key, n in sorted(counts.items()):
        print(f"{n:>6} x {key}")


__all__ = ["ExLlamaV2MLP", "ExLlamaV2MoEMLP", "ExLlamaV2ParallelDecoder", "get_tokens", "list_live_tensors"]
