"""`TPContext`: which device holds which slice of every tensor-parallel dimension, and the collectives.

A *slot* is one entry of the split (normally one GPU; tests may use several slots on the same `cpu` device).
Splits are lists of `(slot, start, end)`; `all_devs[slot]` is that slot's torch device.
"""

from __future__ import annotations

from typing import Any

import torch

from exlpy.errors import GpuSplitError, TensorParallelError
from exlpy.parallel.costs import ModelShape, cache_spec_of
from exlpy.parallel.tp_comm import Comm, make_comm
from exlpy.parallel.tp_copy import CopyAllReduce, make_prefill_comm
from exlpy.parallel.tp_split import (
    BROADCAST_ID,
    BROADCAST_KV,
    BROADCAST_Q,
    BROADCAST_RS,
    BROADCAST_VC,
    Split,
    plan_split,
)

_ALIGN = 64


def free_memory_mib(n: int) -> list[float]:
    """Free MiB of CUDA devices 0..n-1 (the placement code's query when present)."""
    try:
        from exlpy.parallel.memory import query_devices

        mem = {d.ordinal: d.free for d in query_devices()}
        return [mem.get(i, 0) / 1024**2 for i in range(n)]
    except ImportError:
        return [torch.cuda.mem_get_info(i)[0] / 1024**2 for i in range(n)]


class TPContext:
    """exllamav2's tensor-parallel context: the five splits of spec §7.2 over the slots' devices, the
    collective backend, and the exllamav2-style helpers (broadcast, gather, scratch) scripts may call.

    It is built from the model's shape and sizes and keeps no reference to the model; the tensor-parallel
    strategy (exlpy/engine/tensor_parallel.py) shards the modules by its splits.
    """

    def __init__(self, model: Any, gpu_split: list[float] | None, expect_cache_tokens: int = 0,
                 expect_cache_base: type | None = None, devices: list[torch.device | str] | None = None,
                 comm_name: str = "auto", prefill_comm_name: str = "default") -> None:
        cfg = model.config
        self.expect_cache_base = expect_cache_base
        if devices is None:
            n = torch.cuda.device_count()
            if n == 0:
                raise TensorParallelError("tensor parallelism needs CUDA devices (none visible); tests may pass "
                                          "devices=[...] explicitly")
            devices = [torch.device("cuda", i) for i in range(n)]
        self.all_devs: list[torch.device] = [torch.device(d) for d in devices]
        if gpu_split is not None:
            if not isinstance(gpu_split, (list, tuple)) or not all(isinstance(g, (int, float)) for g in gpu_split):
                raise GpuSplitError(f"gpu_split must be a list of GB per device, got {gpu_split!r}")
            if len(gpu_split) > len(self.all_devs):
                raise TensorParallelError(f"gpu_split has {len(gpu_split)} entries but only "
                                          f"{len(self.all_devs)} devices are available")
        self.kv_split: Split = []
        self.q_split: Split = []
        self.id_split: Split = []
        self.rs_split: Split = []
        self.vc_split: Split = []
        attn_bytes = [m.weight_bytes() for m in model.modules if hasattr(m, "num_kv_heads")]
        tokens = expect_cache_tokens or cfg.max_seq_len * cfg.max_batch_size
        self.define_split(gpu_split, ModelShape.from_spec(cfg.spec), tokens, attn_bytes, expect_cache_base)
        self.device = min(s for s, _, _ in self.kv_split)
        self.num_devices = max(self.all_devices()) + 1
        self.all_devs = self.all_devs[:self.num_devices]
        self.comm_name = comm_name
        self.prefill_comm_name = prefill_comm_name
        self.hidden_size = cfg.hidden_size  # sizes the one-row all-reduce that picks the collective backend
        self.sin: list[torch.Tensor | None] = [None] * self.num_devices
        self.cos: list[torch.Tensor | None] = [None] * self.num_devices
        self.comm: Comm | None = None
        self.prefill_comm: CopyAllReduce | None = None  # prefill-sized all-reduces, when not the decode backend's
        self.pinned: list[torch.Tensor] = []
        self.streams: list[Any] = []
        self.scratch_bytes = [0] * self.num_devices
        self.scratch: list[torch.Tensor | None] = [None] * self.num_devices
        self.scratch_pos = [0] * self.num_devices

    # --- planning -------------------------------------------------------------------------------------------
    def define_split(self, gpu_split: list[float] | None, shape: ModelShape, cache_tokens: int,
                     attn_bytes: list[int], expect_cache_base: type | None = None) -> None:
        if gpu_split is None:
            if any(d.type != "cuda" for d in self.all_devs):
                raise GpuSplitError("gpu_split=None measures free CUDA memory; pass a split for other devices")
            budgets = free_memory_mib(len(self.all_devs))
        else:
            budgets = [float(g) * 1024 for g in gpu_split]
        spec = cache_spec_of(expect_cache_base, 2)
        plan = plan_split(budgets, shape, (spec.bytes_k + spec.bytes_v) / 2, cache_tokens, attn_bytes)
        self.kv_split, self.q_split, self.id_split = plan.kv, plan.q, plan.id
        self.rs_split, self.vc_split = plan.rs, plan.vc

    def get_split(self, broadcast_type: int) -> Split:
        return {BROADCAST_KV: self.kv_split, BROADCAST_ID: self.id_split, BROADCAST_VC: self.vc_split,
                BROADCAST_RS: self.rs_split, BROADCAST_Q: self.q_split}[broadcast_type]

    def get_devs(self, broadcast_type: int) -> list[int]:
        return [s for s, _, _ in self.get_split(broadcast_type)]

    def all_devices(self) -> list[int]:
        """Slots that hold a share of any split, ascending."""
        slots: set[int] = set()
        for t in (BROADCAST_KV, BROADCAST_ID, BROADCAST_VC, BROADCAST_RS, BROADCAST_Q):
            slots.update(self.get_devs(t))
        return sorted(slots)

    def slot_range(self, broadcast_type: int, slot: int) -> tuple[int, int] | None:
        """This slot's `[start, end)` in the split, None when it has no share."""
        for s, a, b in self.get_split(broadcast_type):
            if s == slot:
                return a, b
        return None

    # --- life cycle -----------------------------------------------------------------------------------------
    def finalize(self, tables: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """RoPE tables per slot (for scripts that ask), streams and the collective backend."""
        devs = [self.all_devs[s] for s in self.all_devices()]
        for s, t in zip(self.all_devices(), tables or []):
            self.cos[s], self.sin[s] = t
        self.prefill_comm = make_prefill_comm(devs, self.prefill_comm_name)
        self.comm = make_comm(devs, None if self.comm_name == "auto" else self.comm_name, self.hidden_size)
        if all(d.type == "cuda" for d in devs):
            self.streams = [torch.cuda.current_stream(d) for d in devs]

    def unload(self) -> None:
        self.pinned = []
        self.streams = []
        self.scratch = [None] * self.num_devices
        self.sin = [None] * self.num_devices
        self.cos = [None] * self.num_devices
        self.comm = None
        self.prefill_comm = None

    # --- exllamav2-style collectives ------------------------------------------------------------------------
    def get_sin_cos(self) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        return self.sin, self.cos

    def get_pinned(self, buffer: int, batch_size: int, q_len: int, dim: int) -> torch.Tensor:
        """A view of pinned host staging buffer `buffer` (0 or 1), grown on demand (the hot path never uses
        them: it reduces device to device)."""
        n = batch_size * q_len * dim
        while len(self.pinned) <= buffer:
            self.pinned.append(torch.empty(0, dtype=torch.float16))
        if n > self.pinned[buffer].numel():
            self.pinned[buffer] = torch.empty(n, dtype=torch.float16, pin_memory=torch.cuda.is_available())
        return self.pinned[buffer][:n].view(batch_size, q_len, dim)

    def wait_streams(self) -> None:
        for s in self.all_devices():
            if self.all_devs[s].type == "cuda":
                torch.cuda.synchronize(self.all_devs[s])

    def broadcast(self, buffer: int, input_tensor: torch.Tensor, broadcast_type: int, dim: int = 1
                  ) -> list[torch.Tensor]:
        """`input_tensor` copied to every slot of the split, in split order."""
        return [input_tensor.to(self.all_devs[s], non_blocking=True) for s in self.get_devs(broadcast_type)]

    def gather(self, buffer: int, inputs: list[torch.Tensor], broadcast_type: int, dim: int = 1) -> torch.Tensor:
        """Per-slot slices `[rows, (b - a) * dim]` joined along the last dim on the first slot's device."""
        split = self.get_split(broadcast_type)
        if len(inputs) != len(split):
            raise TensorParallelError(f"gather got {len(inputs)} tensors for a split of {len(split)} devices")
        dev = self.all_devs[split[0][0]]
        for t, (_, a, b) in zip(inputs, split):
            if t.shape[-1] != (b - a) * dim:
                raise TensorParallelError(f"gather: slice of width {t.shape[-1]} != ({b} - {a}) * {dim}")
        self.wait_streams()
        return torch.cat([t.to(dev) for t in inputs], dim=-1)

    def allgather(self, buffer: int, inputs: list[torch.Tensor], broadcast_type_g: int, broadcast_type_b: int,
                  dim: int = 1) -> list[torch.Tensor]:
        return self.broadcast(buffer, self.gather(buffer, inputs, broadcast_type_g, dim), broadcast_type_b, dim)

    def add_residual(self, target: list[torch.Tensor], source: list[torch.Tensor], broadcast_type: int,
                     dim: int = 1) -> None:
        """target_i += source_i[..., a*dim : b*dim] for every slot of the split."""
        for t, s, (_, a, b) in zip(target, source, self.get_split(broadcast_type)):
            t.add_(s[..., a * dim:b * dim])

    def all_reduce(self, tensors: list[torch.Tensor]) -> None:
        """In-place sum over the slots' tensors (one per slot of `all_devices()`)."""
        assert self.comm is not None, "finalize() first"
        self.comm.all_reduce(tensors)

    # --- scratch --------------------------------------------------------------------------------------------
    def reserve_scratch(self, scratch: int | list[int]) -> None:
        """Grow every slot's scratch reservation to at least `scratch` bytes (an int applies to all)."""
        per = scratch if isinstance(scratch, list) else [scratch] * self.num_devices
        self.scratch_bytes = [max(a, int(b)) for a, b in zip(self.scratch_bytes, per)]

    def begin_scratch_alloc_tp(self) -> None:
        for s in self.all_devices():
            buf = self.scratch[s]
            if self.scratch_bytes[s] and (buf is None or buf.numel() < self.scratch_bytes[s]):
                self.scratch[s] = torch.empty(self.scratch_bytes[s], dtype=torch.uint8, device=self.all_devs[s])
        self.scratch_pos = [0] * self.num_devices

    def _slice(self, slot: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        pos = self.scratch_pos[slot]
        buf = self.scratch[slot]
        if buf is None or pos + nbytes > buf.numel():
            raise TensorParallelError(f"TP scratch on device slot {slot} exhausted: {pos + nbytes} bytes needed, "
                                      f"{0 if buf is None else buf.numel()} reserved (reserve_scratch)")
        self.scratch_pos[slot] = pos + (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        return buf[pos:pos + nbytes].view(dtype)

    def get_scratch_slice_tp(self, rows: int, dtype: torch.dtype, broadcast_type: int, dim: int = 1
                             ) -> list[torch.Tensor]:
        """Per slot of the split, a `[rows, (b - a) * dim]` scratch tensor."""
        return [self._slice(s, rows * (b - a) * dim, dtype).view(rows, (b - a) * dim)
                for s, a, b in self.get_split(broadcast_type)]

    def get_scratch_slice_tp_bc(self, rows: int, dtype: torch.dtype, broadcast_type: int, dim: int = 1
                                ) -> list[torch.Tensor]:
        """Per slot of the split, a full-width `[rows, end * dim]` scratch tensor (broadcast target)."""
        width = self.get_split(broadcast_type)[-1][2] * dim
        return [self._slice(s, rows * width, dtype).view(rows, width) for s in self.get_devs(broadcast_type)]
