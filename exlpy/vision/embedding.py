"""`ExLlamaV2MMEmbedding`: an image's (or any) embedding rows, reachable from a prompt through token ids.

exllamav2 reserves ids from 1,000,000,000 up for embeddings: an embedding of n rows owns n consecutive ids,
its text alias in a prompt is replaced by those ids when the tokenizer encodes it with `embeddings=[...]`,
and the model's embedding layer looks them up in the embeddings passed along with the ids.

exlpy hands out the ids by content: embeddings with the same rows (the same image through the same tower
and model, or the same tensor given twice) get the same ids, whatever their aliases. A prompt's page hashes
in the dynamic generator are computed from its ids, so two requests with the same image share cache pages,
and an image computed again (another alias, another request) still matches the pages already cached.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any

import torch

from exlpy.errors import MultimodalError

EMBEDDING_INDEX = 1_000_000_000  # first id reserved for embeddings (exllamav2's value)


class _Allocator:
    """Consecutive id ranges above EMBEDDING_INDEX, one per distinct content digest."""

    def __init__(self) -> None:
        self.next_token_index = EMBEDDING_INDEX
        self.ranges: dict[bytes, int] = {}
        self.lock = threading.Lock()

    def allocate(self, num_tokens: int, digest: bytes | None = None) -> int:
        with self.lock:
            if digest is not None and digest in self.ranges:
                return self.ranges[digest]
            idx = self.next_token_index
            self.next_token_index += num_tokens
            if digest is not None:
                self.ranges[digest] = idx
            return idx


global_allocator = _Allocator()


def content_digest(embeddings: torch.Tensor, *extra: Any) -> bytes:
    """blake2b of the rows' dtype, shape and bytes plus `extra` (the grid: M-RoPE positions depend on it)."""
    h = hashlib.blake2b(digest_size=16)
    t = embeddings.detach().contiguous().cpu()
    h.update(f"{t.dtype}|{tuple(t.shape)}|{extra!r}|".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.digest()


class RowCheck:
    """Whether embedding rows are all finite. On a GPU the reduction is launched and its one-byte answer copied
    to pinned memory without waiting: making an embedding then never waits for the vision tower (a wait there
    would hold back the prompt's host-side setup until the tower is done); the answer is read when the rows are
    first used (`ExLlamaV2MMEmbedding.verify`). Elsewhere (or with defer=False) it is computed at once."""

    def __init__(self, rows: torch.Tensor, defer: bool | None = None) -> None:
        defer = rows.device.type == "cuda" if defer is None else defer
        self._value: bool | None = None
        self._flag: torch.Tensor | None = None
        self._event: Any = None
        if not rows.is_floating_point():
            self._value = False
            return
        flag = torch.isfinite(rows).all()
        if not defer:
            self._value = bool(flag)
        elif rows.device.type == "cuda":
            self._flag = torch.empty((), dtype=torch.bool, pin_memory=True)
            self._flag.copy_(flag, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(rows.device))
        else:
            self._flag = flag

    @property
    def pending(self) -> bool:
        return self._value is None

    def ok(self) -> bool:
        """The answer (waits, on a GPU, for the reduction only: it was queued right after the rows)."""
        value = self._value
        if value is None:
            flag, event = self._flag, self._event
            if flag is None:  # answered by another thread meanwhile (it sets the value before dropping the flag)
                return bool(self._value)
            if event is not None:
                event.synchronize()
            value = bool(flag)
            self._value = value
            self._flag = self._event = None
        return value


class ExLlamaV2MMEmbedding:
    """Embedding rows [num_tokens, hidden_size] for `model`, with the text alias that stands for them.

    `thw_grid` (Qwen2-VL: temporal, height, width of the merged feature grid) and `pre_tokens` /
    `post_tokens` (rows before and after the image features: the image start / end tokens) place the image's
    M-RoPE positions, as in exllamav2; `time_interval` (exlpy: Qwen2.5-VL video) is the M-RoPE time step from one
    temporal patch to the next. `metadata` holds what the tower knows of the image (sizes). exlpy's keywords:
    `digest`, bytes that identify the rows' content (ids are handed out by it instead of by hashing the rows),
    and `device_rows`, the same rows already on a GPU (forward passes there read them instead of a new copy);
    `ready`, an object whose synchronize() returns once `embeddings` (a host copy still being written) holds the
    rows: reading `embeddings` waits for it, forward passes reading `device_rows` do not; `row_check`, the
    finiteness check of these rows when the caller already made one (a RowCheck; default: one of
    `device_rows`, else of `embeddings`). Rows on a GPU are checked without waiting for them: a non-finite
    embedding raises MultimodalError when a forward pass first uses it (before its rows enter the model) or when
    `embeddings` is read; rows elsewhere are checked here."""

    def __init__(self, model: Any, embeddings: torch.Tensor, text_alias: str | None = None,
                 thw_grid: tuple[int, int, int] | None = None, pre_tokens: int = 0, post_tokens: int = 0,
                 time_interval: float = 1.0, *, digest: bytes | None = None,
                 device_rows: torch.Tensor | None = None, ready: Any = None,
                 row_check: RowCheck | None = None) -> None:
        self._ready = ready
        hidden = getattr(getattr(model, "config", None), "hidden_size", "hidden_size")
        if not isinstance(embeddings, torch.Tensor) or embeddings.dim() != 2 or embeddings.shape[0] < 1:
            raise MultimodalError(f"ExLlamaV2MMEmbedding: embeddings must be a [num_tokens >= 1, {hidden}] tensor, "
                                  f"got {getattr(embeddings, 'shape', type(embeddings).__name__)}")
        if embeddings.shape[1] != hidden:
            raise MultimodalError(f"ExLlamaV2MMEmbedding: embedding dimension {embeddings.shape[1]} does not match "
                                  f"the model's hidden_size {hidden}")
        if device_rows is not None and (not isinstance(device_rows, torch.Tensor) or
                                        device_rows.shape != embeddings.shape):
            raise MultimodalError(f"ExLlamaV2MMEmbedding: device_rows must be a tensor of the embeddings' shape "
                                  f"{tuple(embeddings.shape)}, got {getattr(device_rows, 'shape', device_rows)!r}")
        self._embeddings = embeddings
        if not embeddings.is_floating_point():
            raise MultimodalError("ExLlamaV2MMEmbedding: embeddings must be finite floating-point values")
        # the check runs where the rows are fast (a host copy in flight is waited for), deferred on a GPU
        if row_check is not None and not isinstance(row_check, RowCheck):
            raise MultimodalError(f"ExLlamaV2MMEmbedding: row_check must be a RowCheck, got "
                                  f"{type(row_check).__name__}")
        self._check = row_check or RowCheck(device_rows if device_rows is not None else self._host_rows())
        if not self._check.pending and not self._check.ok():
            raise MultimodalError("ExLlamaV2MMEmbedding: embeddings must be finite floating-point values")
        if digest is not None and (not isinstance(digest, bytes) or not digest):
            raise MultimodalError(f"ExLlamaV2MMEmbedding: digest must be non-empty bytes, got {digest!r:.40}")
        if text_alias is not None and (not isinstance(text_alias, str) or not text_alias):
            raise MultimodalError(f"ExLlamaV2MMEmbedding: text_alias must be a non-empty string, got {text_alias!r}")
        if pre_tokens < 0 or post_tokens < 0 or pre_tokens + post_tokens > embeddings.shape[0]:
            raise MultimodalError(f"ExLlamaV2MMEmbedding: pre_tokens {pre_tokens} + post_tokens {post_tokens} "
                                  f"exceed the {embeddings.shape[0]} rows")
        if thw_grid is not None:
            t, h, w = (int(v) for v in thw_grid)
            if t * h * w != embeddings.shape[0] - pre_tokens - post_tokens:
                raise MultimodalError(f"ExLlamaV2MMEmbedding: thw_grid {thw_grid} holds {t * h * w} positions, the "
                                      f"embedding {embeddings.shape[0] - pre_tokens - post_tokens} image rows")
            thw_grid = (t, h, w)
        self.model = model
        self.width = embeddings.shape[1]
        self.thw_grid = thw_grid
        self.pre_tokens = pre_tokens
        self.post_tokens = post_tokens
        self.metadata: dict[str, Any] = {}
        if not isinstance(time_interval, (int, float)) or not 0 < time_interval < 1e6:
            raise MultimodalError(f"ExLlamaV2MMEmbedding: time_interval must be a positive number, got "
                                  f"{time_interval!r}")
        self.time_interval = float(time_interval)
        self.length = embeddings.shape[0]
        # Ids by content: the caller's digest of what determines the rows (the tower: image, preprocessing,
        # tower and model), else a hash of the rows themselves (10 MB for a 1024x1024 image on a 7B model).
        self.digest = content_digest(self._host_rows(), thw_grid, pre_tokens, post_tokens, self.time_interval) \
            if digest is None else hashlib.blake2b(digest + repr((thw_grid, pre_tokens, post_tokens,
                                                                   self.time_interval)).encode(),
                                                   digest_size=16).digest()
        self._on_device: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        if device_rows is not None:
            self._on_device[(str(device_rows.device), device_rows.dtype)] = device_rows
        self.first_index = global_allocator.allocate(self.length, self.digest)
        self.text_alias = text_alias or f"<$EMB_{self.first_index}$>"

    def verify(self) -> None:
        """MultimodalError unless the rows are finite (the first call on rows checked on a GPU waits for that
        check; later calls cost nothing)."""
        if not self._check.ok():
            raise MultimodalError(f"ExLlamaV2MMEmbedding {self.text_alias!r}: embeddings must be finite "
                                  "floating-point values (the rows hold inf or NaN; from a vision tower: its "
                                  "activations overflowed the compute dtype)")

    @property
    def row_check(self) -> RowCheck:
        return self._check

    def _host_rows(self) -> torch.Tensor:
        if self._ready is not None:
            self._ready.synchronize()  # the tower's copy to the host ran beside the prompt's first layers
            self._ready = None
        return self._embeddings

    @property
    def embeddings(self) -> torch.Tensor:
        """The rows [num_tokens, hidden_size] (on the host unless made with embeddings_cpu=False)."""
        rows = self._host_rows()
        self.verify()
        return rows

    @embeddings.setter
    def embeddings(self, value: torch.Tensor) -> None:
        self._ready = None
        self._embeddings = value
        self._check = RowCheck(value)
        self._on_device.clear()  # copies of the old rows

    def rows_on(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The rows on `device` in `dtype`, copied there once and kept (forward passes read them every chunk)."""
        key = (str(device), dtype)
        rows = self._on_device.get(key)
        if rows is None:
            rows = self.embeddings.to(device=device, dtype=dtype)
            self._on_device[key] = rows
        return rows

    def get_ids_tensor(self) -> torch.Tensor:
        return torch.arange(self.first_index, self.first_index + self.length, dtype=torch.long).unsqueeze(0)

    def get_ids(self) -> list[int]:
        return list(range(self.first_index, self.first_index + self.length))

    def get_vision_token_range(self) -> tuple[int, int]:
        return self.first_index + self.pre_tokens, self.first_index + self.length - self.post_tokens

    def get_size_in_bytes(self) -> int:
        return self._embeddings.element_size() * self._embeddings.numel()

    def __repr__(self) -> str:
        return (f"ExLlamaV2MMEmbedding(alias={self.text_alias!r}, tokens={self.length}, ids={self.first_index}.."
                f"{self.first_index + self.length - 1}, grid={self.thw_grid})")


def check_embeddings(embeddings: Any, model: Any = None, what: str = "embeddings") -> list[ExLlamaV2MMEmbedding]:
    """`embeddings` as a list of ExLlamaV2MMEmbedding (None: empty), each of `model` when one is given."""
    if embeddings is None:
        return []
    items = [embeddings] if isinstance(embeddings, ExLlamaV2MMEmbedding) else embeddings
    if not isinstance(items, (list, tuple)):
        raise MultimodalError(f"{what} must be a list of ExLlamaV2MMEmbedding, got {type(embeddings).__name__}")
    for e in items:
        if not isinstance(e, ExLlamaV2MMEmbedding):
            raise MultimodalError(f"{what} must hold ExLlamaV2MMEmbedding objects, got {type(e).__name__}")
        if model is not None and e.model is not model and e.embeddings.shape[1] != model.config.hidden_size:
            raise MultimodalError(f"{what}: {e!r} was made for another model (hidden size {e.embeddings.shape[1]}, "
                                  f"this model {model.config.hidden_size})")
    return list(items)
