"""Per-forward metadata: positions and where each token's K/V lives in the cache, built in one place.

Every cache is addressed as flat rows in pages: a paged cache (the dynamic generator's) has pages of 256
rows and a block table per sequence; a contiguous cache [batch, S, H, D] is a paged cache whose page is a
whole row of S positions and whose block table for sequence b is [b]. `build_batch` turns host-side
integers (where each row starts, its pages) into a `ForwardBatch`; every caller uses it: `model.forward`,
the generators, and the CUDA-graph runner, which asks for the same layout padded to its static shape.

All integer metadata travels to the device as ONE int64 tensor (positions | slots | lengths | block table |
adapter slot per row), copied from a pinned host buffer without waiting for the device, so the host can
prepare step n+1 while the GPU runs step n. The batch's fields are views of that tensor.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

LOGITS_ALL, LOGITS_LAST, LOGITS_NONE = "all", "last", "none"


@dataclass
class ForwardBatch:
    """Everything a forward pass needs besides the hidden state, built once per call."""

    batch_size: int
    q_len: int
    positions: torch.Tensor  # [B, T] int64 absolute positions
    cache: Any = None  # the KVCache this pass reads and writes (a tensor-parallel lane's own part)
    slots: torch.Tensor | None = None  # [B, T] flat cache rows to write; -1 writes nowhere
    block_table: torch.Tensor | None = None  # [B, W] pages of each sequence
    page_size: int = 0
    seqlens: torch.Tensor | None = None  # [B] valid keys after this step (0: a padding row)
    max_seqlen: int = 0  # host-side bound of seqlens, sizes the reference path
    past_len: int | None = None  # uniform past length of a contiguous cache: enables the slicing fast path
    key_mask: torch.Tensor | None = None  # [B, >=max_seqlen] bool, False = padding key
    # RoPE positions when they differ from the cache positions (left-padded rows start at position 0 while
    # their tokens sit further right in the cache); None means `positions`.
    rope_positions: torch.Tensor | None = None
    # LoRA (exlpy/lora/): the adapter slot of each row (-1: none), and `lora` nonzero when some row has one
    # (then the adapter registry's generation: it keys the CUDA graphs that run the adapter kernels).
    adapters: torch.Tensor | None = None  # [B] int64
    lora: int = 0
    # Multimodal inputs (exlpy/vision/mm.py MMInputs): embeddings behind ids >= 1e9 and M-RoPE angles; None
    # for text.
    mm: Any = None
    logits: str = LOGITS_ALL  # what the head computes: every position, the last one, or nothing (prefill)
    keep_last_state: bool = False  # store the head's input in `last_state` (exllamav2's return_last_state)
    last_state: torch.Tensor | None = field(default=None, compare=False)
    # Parallel blocks (Cohere): the attention leaves its normed input here for the MLP of the same layer,
    # keyed by layer. One dict shared by the batch and its per-device copies (a layer split may separate them).
    block_inputs: dict[int, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)
    meta: torch.Tensor | None = field(default=None, repr=False, compare=False)  # the packed int64 metadata
    # The host integers the batch was built from (row starts, page tables): the graph runner re-packs them
    # for its static layout without reading anything back from the device.
    host: tuple[list[int], list[list[int]] | None, list[int] | None] | None = field(default=None, repr=False,
                                                                                    compare=False)
    _per_device: dict[str, ForwardBatch] = field(default_factory=dict, init=False, repr=False, compare=False)
    # Tensor parallelism: (residual, its RMSNorm) when the closing all-reduce also normed the sum for the next
    # block (model/parallel_linear.py RowParallel.next_norm); taken once, by the block whose input it is.
    prenormed: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False, compare=False)
    # A mixed pass (`mixed_batch`): the pass is one row [1, N] of every sequence's tokens end to end; each segment
    # holds the attention metadata of its rows (`positions` / `slots` above are the N tokens'), and the head
    # computes the logits of the first `logit_rows` tokens only (the decode rows, which lead the pass).
    segments: tuple[Segment, ...] | None = None
    logit_rows: int | None = None

    @property
    def rope_pos(self) -> torch.Tensor:
        return self.positions if self.rope_positions is None else self.rope_positions

    def on(self, device: torch.device) -> ForwardBatch:
        """This batch with its tensors on `device` (copied once per device, then reused by every layer)."""
        if self.positions.device == device:
            return self
        key = str(device)
        if key not in self._per_device:
            mv = lambda t: None if t is None else t.to(device, non_blocking=True)
            if self.meta is not None:  # one copy of the packed metadata, then the same views
                moved = unpack(self.meta.to(device, non_blocking=True), self.batch_size, self.q_len,
                               self.block_table.shape[1] if self.block_table is not None else 0)
                names = ("positions", "slots", "seqlens", "block_table") if self.block_table is not None else \
                    ("positions", "slots") if self.slots is not None else ("positions",)
                fields = dict(zip(names, moved))
                fields["adapters"], fields["meta"] = moved[4], moved[5]
            else:
                fields = {"positions": mv(self.positions), "slots": mv(self.slots), "seqlens": mv(self.seqlens),
                          "block_table": mv(self.block_table), "adapters": mv(self.adapters)}
            if self.segments is not None:
                fields["segments"] = tuple(Segment(s.start, s.batch.on(device)) for s in self.segments)
            self._per_device[key] = replace(self, key_mask=mv(self.key_mask), rope_positions=mv(self.rope_positions),
                                            **fields)
        return self._per_device[key]

    def take_prenormed(self, x: torch.Tensor) -> torch.Tensor | None:
        """The normed form of `x` if the collective that produced x left it (see `prenormed`), else None."""
        pre = self.prenormed
        if pre is None:
            return None
        self.prenormed = None
        return pre[1] if pre[0] is x else None

    def with_cache(self, cache: Any) -> ForwardBatch:
        """The same batch reading and writing another cache object (a tensor-parallel slot's part)."""
        return self if cache is self.cache else replace(self, cache=cache)


@dataclass(frozen=True)
class Segment:
    """Rows of one q_len inside a mixed pass: their tokens are [start, start + rows * q_len) of the pass, and
    `batch` is their attention metadata as a batch of rows x q_len (positions, block table, lengths)."""

    start: int
    batch: ForwardBatch


def pack(starts: Sequence[int], q_len: int, tables: Sequence[Sequence[int]] | None, page_size: int,
         rows: int, width: int, adapters: Sequence[int] | None = None,
         lengths: Sequence[int] | None = None) -> list[int]:
    """Host integers of the packed layout for `rows` rows (live rows first, then padding) and block tables
    `width` pages wide: positions [rows*T] | slots [rows*T] | seqlens [rows] | block table [rows*width] |
    adapter slots [rows] (-1: no adapter, as for padding rows).

    `lengths`: row b holds lengths[b] real tokens (1..q_len) followed by padding tokens (a prompt chunk padded
    to a captured size): those write nowhere (slot -1), sit at the row's last real position (inside the RoPE
    tables, and every query sees at least one key), and the row's length counts only its real tokens, so no
    real query reads them (attention is causal by position and bounded by the length)."""
    n = len(starts)
    assert adapters is None or len(adapters) == n, "one adapter slot per row"
    assert lengths is None or (len(lengths) == n and all(1 <= k <= q_len for k in lengths)), "1..q_len per row"
    positions: list[int] = []
    slots: list[int] = []
    for b, s in enumerate(starts):
        real = q_len if lengths is None else lengths[b]
        positions.extend(range(s, s + real))
        if tables is None:
            slots.extend([-1] * real)
        else:
            t = tables[b]
            slots.extend(t[p // page_size] * page_size + p % page_size for p in range(s, s + real))
        positions.extend([s + real - 1] * (q_len - real))
        slots.extend([-1] * (q_len - real))
    pad = rows - n
    positions.extend([0] * (pad * q_len))
    slots.extend([-1] * (pad * q_len))  # padding rows write nowhere...
    ends = [q_len] * n if lengths is None else list(lengths)
    seqlens = [s + k for s, k in zip(starts, ends)] + [0] * pad  # ...and read nothing
    table: list[int] = []
    if width:
        assert tables is not None
        for t in tables:
            table.extend(t)
            table.extend([0] * (width - len(t)))
        table.extend([0] * (pad * width))
    adapter = ([-1] * n if adapters is None else list(adapters)) + [-1] * pad
    return positions + slots + seqlens + table + adapter


def unpack(meta: torch.Tensor, rows: int, q_len: int, width: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views (positions, slots, seqlens, block table, adapter slots, meta) of a packed metadata tensor."""
    a = rows * q_len
    t = 2 * a + rows + rows * width
    return (meta[:a].view(rows, q_len), meta[a:2 * a].view(rows, q_len), meta[2 * a:2 * a + rows],
            meta[2 * a + rows:t].view(rows, width), meta[t:t + rows], meta)


def packed_size(rows: int, q_len: int, width: int) -> int:
    return rows * (2 * q_len + 2 + width)


class _Ring:
    """Pinned host buffers for one CUDA device's metadata uploads, reused round-robin. An event per buffer says
    when its last upload finished, so a buffer is never rewritten while a copy from it may still be in flight."""

    def __init__(self, device: torch.device, n: int) -> None:
        self.device = device
        self.bufs: list[torch.Tensor | None] = [None] * n
        self.events: list[Any] = [None] * n
        self.i = 0

    def upload(self, values: list[int], dst: torch.Tensor) -> None:
        k = self.i
        self.i = (k + 1) % len(self.bufs)
        buf = self.bufs[k]
        if buf is None or buf.numel() < len(values):
            buf = torch.empty(max(len(values), 1024), dtype=torch.int64, pin_memory=True)
            self.bufs[k] = buf
        event = self.events[k]
        if event is not None:
            event.synchronize()  # normally long done: n uploads ago
        else:
            with torch.cuda.device(self.device):  # an event belongs to one device: record it only there
                event = self.events[k] = torch.cuda.Event()
        buf.numpy()[:len(values)] = values
        dst[:len(values)].copy_(buf[:len(values)], non_blocking=True)
        event.record(torch.cuda.current_stream(self.device))


class _Staging:
    """Asynchronous host-to-device uploads of integer lists: one ring of pinned buffers and events per CUDA
    device (keyed by the destination's device index), so an upload to one GPU never records an event created
    on another (a layer split or TP uploads each step's metadata to every GPU in turn)."""

    def __init__(self, n: int = 8) -> None:
        self.n = n
        self.rings: dict[int, _Ring] = {}
        self.lock = threading.Lock()

    def ring(self, device: torch.device) -> _Ring:
        index = device.index if device.index is not None else torch.cuda.current_device()
        r = self.rings.get(index)
        if r is None:
            r = self.rings[index] = _Ring(torch.device("cuda", index), self.n)
        return r

    def upload(self, values: list[int], dst: torch.Tensor) -> None:
        """dst[:len(values)] = values, asynchronously for a CUDA `dst`."""
        if dst.device.type != "cuda":
            dst[:len(values)].copy_(torch.tensor(values, dtype=torch.int64))
            return
        with self.lock:
            self.ring(dst.device).upload(values, dst)


staging = _Staging()


def upload_ids(ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Token ids [B, T] as int64 on `device`; host ids go through pinned memory (no wait for the device)."""
    if ids.device == device:
        return ids if ids.dtype == torch.long else ids.long()
    if ids.device.type == "cpu" and device.type == "cuda":
        out = torch.empty(ids.shape, dtype=torch.long, device=device)
        staging.upload(ids.reshape(-1).tolist(), out.view(-1))
        return out
    return ids.to(device, dtype=torch.long, non_blocking=True)


def build_batch(starts: Sequence[int], q_len: int, device: torch.device, *, cache: Any = None,
                tables: Sequence[Sequence[int]] | None = None, page_size: int = 0,
                rows: int | None = None, width: int | None = None, out: torch.Tensor | None = None,
                key_mask: torch.Tensor | None = None, adapters: Sequence[int] | None = None) -> ForwardBatch:
    """The batch for len(starts) rows of `q_len` new tokens; row b continues its sequence at position
    starts[b] and keeps its K/V in cache pages tables[b] (page_size rows each). `rows` / `width` pad the
    layout to a static shape (CUDA graphs); `out` is the device tensor to upload into (a graph's static
    input) instead of a fresh one. `adapters`: the LoRA slot of each row (-1: none; exlpy/lora/)."""
    n = len(starts)
    rows = n if rows is None else rows
    if cache is None:
        tables, width = None, 0
    elif width is None:
        width = max(len(t) for t in tables) if tables else 0
    assert width is not None
    values = pack(starts, q_len, tables, page_size, rows, width, adapters)
    meta = out if out is not None else torch.empty(len(values), dtype=torch.int64, device=device)
    staging.upload(values, meta)
    positions, slots, seqlens, table, adapter, _ = unpack(meta, rows, q_len, width)
    max_seqlen = max(starts) + q_len if n else 0
    host = (list(starts), None if tables is None else [list(t) for t in tables],
            None if adapters is None else list(adapters))
    lora = int(adapters is not None and any(a >= 0 for a in adapters))
    if cache is None:
        return ForwardBatch(rows, q_len, positions, key_mask=key_mask, max_seqlen=max_seqlen, past_len=0,
                            meta=meta, host=host, adapters=adapter, lora=lora)
    return ForwardBatch(rows, q_len, positions, cache=cache, slots=slots, block_table=table, page_size=page_size,
                        seqlens=seqlens, max_seqlen=max_seqlen, key_mask=key_mask, meta=meta, host=host,
                        adapters=adapter, lora=lora)


def contiguous_batch(batch_size: int, q_len: int, past_len: int, cache: Any, seq_stride: int,
                     device: torch.device, key_mask: torch.Tensor | None = None,
                     row_offset: int = 0, adapters: Sequence[int] | None = None) -> ForwardBatch:
    """Batch for a non-paged cache (rows row_offset.. of it) where every row has the same past length."""
    tables = [[row_offset + b] for b in range(batch_size)]
    batch = build_batch([past_len] * batch_size, q_len, device, cache=cache, tables=tables, page_size=seq_stride,
                        key_mask=key_mask, adapters=adapters)
    batch.past_len = past_len if row_offset == 0 else None
    return batch


def cache_rows_batch(cache: Any, rows: Sequence[int], starts: Sequence[int], q_len: int,
                     device: torch.device, adapters: Sequence[int] | None = None) -> ForwardBatch:
    """Batch over a contiguous cache where row i writes cache row rows[i] from position starts[i] on.

    Each sequence sits unpadded at the start of its own cache row, so positions equal cache indices and rows
    of different lengths need no attention mask (the streaming generator's CFG pair, the base generator).
    """
    return build_batch(starts, q_len, device, cache=cache, tables=[[r] for r in rows], page_size=cache.max_seq_len,
                       adapters=adapters)


def paged_batch(rows: Sequence[tuple[Sequence[int], int, int]], cache: Any, device: torch.device,
                page_size: int, adapters: Sequence[int] | None = None) -> ForwardBatch:
    """Batch for rows of (page ids, first position, q_len) of a paged cache, all rows with the same q_len."""
    q = rows[0][2]
    assert all(r[2] == q for r in rows), "all rows of one batch need the same q_len"
    return build_batch([r[1] for r in rows], q, device, cache=cache, tables=[list(r[0]) for r in rows],
                       page_size=page_size, adapters=adapters)


def mixed_batch(groups: Sequence[Sequence[tuple[Sequence[int], int, int]]], cache: Any, device: torch.device,
                page_size: int, logit_rows: int, first_shape: tuple[int, int] | None = None) -> ForwardBatch:
    """One forward pass over sequences with different q_len: a decode step's rows (q_len 1) and prompt chunks
    beside them, so that the weights are read once for both. `groups`: lists of rows (page ids, first position,
    q_len), one q_len per group. The pass is one row of all their tokens end to end ([1, N]): projections, norms
    and MLPs see N tokens, RoPE and the cache writes use each token's own position and slot, and attention runs
    per group (a `Segment`) over its rows' pages. The head computes the first `logit_rows` tokens' logits
    ([1, logit_rows, V]): the decode rows go first (0: a prefill pass of prompt chunks alone, run with
    preprocess_only, computes no logits). `first_shape` (rows, table width) pads the first group as
    `build_batch` pads a captured step (padding rows are tokens of the pass that write and read nothing; the
    caller gives them ids), and bounds its keys by the table's capacity as a captured step does: its attention
    then has the captured decode step's shapes. No LoRA adapters and no multimodal rows (the generator keeps
    those jobs out of a mixed pass). All metadata is uploaded as one packed tensor, as in `build_batch`."""
    shapes = []
    flat_pos: list[int] = []
    flat_slots: list[int] = []
    parts: list[list[int]] = []
    for g, rows in enumerate(groups):
        q = rows[0][2]
        assert all(r[2] == q for r in rows), "one q_len per group"
        tables = [list(r[0]) for r in rows]
        count, width = len(rows), max(len(t) for t in tables)
        bound = max(r[1] for r in rows) + q
        if g == 0 and first_shape is not None:
            assert first_shape[0] >= count and first_shape[1] >= width
            count, width = first_shape
            bound = width * page_size
        values = pack([r[1] for r in rows], q, tables, page_size, count, width)
        n = count * q
        flat_pos += values[:n]
        flat_slots += values[n:2 * n]
        shapes.append((rows, q, tables, count, width, bound, len(values)))
        parts.append(values)
    total = len(flat_pos)
    assert 0 <= logit_rows <= total
    head = flat_pos + flat_slots + [total] + [-1]  # `pack`'s layout for one row of `total` tokens, no table
    # Each part starts 16-byte aligned, as a batch of its own would: Triton compiles a kernel variant per pointer
    # alignment, so a segment's tensors must not land on offsets that the warm-up never met.
    values = [v for part in (head, *parts) for v in part + [0] * (len(part) % 2)]
    meta = torch.empty(len(values), dtype=torch.int64, device=device)
    staging.upload(values, meta)
    positions, slots, _, _, adapter, own = unpack(meta[:len(head)], 1, total, 0)
    segments = []
    at, token = len(head) + len(head) % 2, 0
    for rows, q, tables, r, width, bound, size in shapes:
        p, s, lens, table, ad, m = unpack(meta[at:at + size], r, q, width)
        starts = [row[1] for row in rows]
        sub = ForwardBatch(r, q, p, cache=cache, slots=s, block_table=table, page_size=page_size, seqlens=lens,
                           max_seqlen=bound, meta=m, host=(starts, tables, None), adapters=ad)
        segments.append(Segment(token, sub))
        at += size + size % 2
        token += r * q
    return ForwardBatch(1, total, positions, cache=cache, slots=slots, page_size=page_size,
                        max_seqlen=max(s.batch.max_seqlen for s in segments), meta=own, adapters=adapter,
                        segments=tuple(segments), logit_rows=logit_rows)
