"""Checks of what a caller hands the model, run before anything touches a device.

Bad arguments would otherwise fail deep inside torch (an IndexError from the embedding for an id past the
vocabulary, a device-side assert on CUDA), be silently truncated (float ids), or write past the RoPE tables.
Each check costs a few microseconds: the ids' min and max are read in one go, for ids on the host (ids already
on a GPU are not read, which would cost a sync per decode step).
"""

from __future__ import annotations

from typing import Any

import torch

from exlpy.errors import DeviceError, InputError, SequenceLengthError

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def check_ids(input_ids: Any, vocab_size: int, what: str = "input_ids") -> torch.Tensor:
    """`input_ids` as a 2-D integer tensor [batch >= 1, tokens], every id in [0, vocab_size)."""
    if not isinstance(input_ids, torch.Tensor):
        raise InputError(f"{what} must be a torch tensor of token ids, got {type(input_ids).__name__}")
    if input_ids.dtype not in _INT_DTYPES:
        raise InputError(f"{what} must hold integer token ids, got dtype {input_ids.dtype}")
    ids = input_ids.unsqueeze(0) if input_ids.dim() == 1 else input_ids
    if ids.dim() != 2:
        raise InputError(f"{what} must be [batch, tokens] (or 1-D), got shape {tuple(input_ids.shape)}")
    if ids.shape[0] == 0:
        raise InputError(f"{what} has a batch of 0 rows (shape {tuple(ids.shape)}); pass at least one sequence")
    if ids.shape[1] == 0:
        raise InputError(f"{what} holds no tokens (shape {tuple(ids.shape)})")
    if ids.device.type != "cpu":
        # Ids already on a GPU are the model's own picks (a decode loop's argmax): reading them would add a
        # host sync to every step, so only host ids (the tokenizer's, the user's) are range-checked.
        return ids
    lo, hi = (int(v) for v in torch.aminmax(ids))
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise InputError(f"{what} holds token id {bad}, outside the model's vocabulary [0, {vocab_size}) "
                         "(vocab_size)")
    return ids


def check_forward(model: Any, input_ids: Any, cache: Any, embeddings: list[Any] | None = None) -> torch.Tensor:
    """The ids of a model.forward call, checked against the vocabulary (or `embeddings`' id ranges) and the
    RoPE tables' length (config.max_seq_len); with a cache, counted from the tokens it already holds."""
    cfg = model.config
    if embeddings:
        from exlpy.vision.mm import check_mm_ids

        ids = check_ids(input_ids, 2**62)
        check_mm_ids(ids, cfg.vocab_size, embeddings, "input_ids")
    else:
        ids = check_ids(input_ids, cfg.vocab_size)
    past = cache.current_seq_len if cache is not None else 0
    if cache is not None and cache.max_seq_len <= cfg.max_seq_len:
        return ids  # the cache is the tighter bound, and forward() names it (CacheTooSmallError)
    if past + ids.shape[1] > cfg.max_seq_len:
        raise SequenceLengthError(
            f"{past} cached + {ids.shape[1]} new tokens exceed the model's max_seq_len {cfg.max_seq_len} (its "
            "position limit; raise config.max_seq_len, with RoPE scaling if the model needs it, before loading)")
    return ids


def check_load_device(device: Any) -> torch.device:
    """The `device` of model.load(device=...): a valid torch device that exists here."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise DeviceError(f"load(device={device!r}): not a device ({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"load(device={device!r}): no CUDA device is available (torch {torch.__version__}"
                              f"{' is a CPU-only build' if torch.version.cuda is None else ''}); use device='cpu'")
        count = torch.cuda.device_count()
        if dev.index is not None and not 0 <= dev.index < count:
            raise DeviceError(f"load(device={device!r}): there are {count} CUDA devices (cuda:0..cuda:{count - 1})")
    elif dev.type != "cpu":
        raise DeviceError(f"load(device={device!r}): only 'cpu' and 'cuda[:N]' are supported")
    return dev
