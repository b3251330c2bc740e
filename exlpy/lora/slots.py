"""The adapter registry of a model: adapter slots whose weights live in per-block buffers.

A step's rows name a slot each (the packed metadata's adapter field, exlpy/model/batch.py), so one batch can
serve several adapters and none at once. A slot holds one adapter, or a list of adapters applied together
(their ranks concatenated). Slots are assigned on demand and reused least-recently-used, but never while a
running job or stream holds them (`acquire` / `release`).

Buffers are allocated for (slots, max rank, groups in use) and written in place, so CUDA graphs captured over
them survive loading and unloading adapters. They are reallocated only when an adapter needs more rank, a
projection group no adapter used before, or more slots (the count doubles as adapters arrive, up to 8 unless
`configure` sets it; past that, idle slots are reused): then the generation number moves on and the graph runner
recaptures the steps that run adapters (steps without adapters keep theirs). A server configures its count and
rank once, up front.
The buffers are attached to the blocks of the model's loaded strategy (every GPU's copy under tensor
parallelism); a reload (new strategy) gets fresh buffers with the resident slots rewritten. Adapters of the
embedding and the head (replacement tables, LoRA on lm_head / embed_tokens) have their own buffers on those two
modules (outer.py); replacement tables are as many as resident adapters that replace the module, growing
(with a new generation) when one more is needed.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from exlpy.errors import LoraCapacityError, LoraConfigError, ModelStateError
from exlpy.lora.buffers import GROUP_OF
from exlpy.lora.outer import EMBED, HEAD, OuterLora
from exlpy.model.attention import Attention
from exlpy.model.embedding import Embedding
from exlpy.model.head import Head
from exlpy.model.mlp import MLP
from exlpy.model.parallel_linear import RowParallel

DEFAULT_MAX_SLOTS = 8  # slots grow (doubling) up to this many, unless configure() fixes a count
MIN_RANK = 16  # buffer ranks are powers of two from here (the kernels' rank tile)


@dataclass
class _Slot:
    key: tuple[Any, ...]  # the adapters applied together, ordered by uid
    users: int = 0
    last_use: int = 0


def normalize(loras: Any, model: Any = None) -> tuple[Any, ...]:
    """A `loras` argument (None, one adapter, or a list) as the slot key: distinct adapters ordered by uid."""
    from exlpy.lora.adapter import ExLlamaV2Lora

    if loras is None:
        return ()
    items = [loras] if isinstance(loras, ExLlamaV2Lora) else loras
    if not isinstance(items, (list, tuple)):
        raise LoraConfigError(f"loras must be an ExLlamaV2Lora or a list of them, got {type(loras).__name__}")
    for lora in items:
        if not isinstance(lora, ExLlamaV2Lora):
            raise LoraConfigError(f"loras must hold ExLlamaV2Lora objects, got {type(lora).__name__}")
        lora.check_usable(model)
    return tuple(sorted({lora.uid: lora for lora in items}.values(), key=lambda lora: lora.uid))


def _pow2_rank(r: int) -> int:
    n = MIN_RANK
    while n < r:
        n *= 2
    return n


class LoraRegistry:
    def __init__(self, model: Any) -> None:
        self._model = weakref.ref(model)
        self.num_slots = 1  # slots with buffers
        self.max_slots = DEFAULT_MAX_SLOTS
        self.rank = 0  # rank of the buffers (0: none allocated yet)
        self.min_rank = 0  # set by configure(max_rank=...)
        self.groups: set[str] = set()  # projection groups with buffers (and EMBED / HEAD: their low-rank parts)
        self.tables: dict[str, int] = {EMBED: 0, HEAD: 0}  # replacement tables of the embedding / the head
        self.slots: list[_Slot | None] = [None] * self.num_slots
        self.generation = 0
        self._strategy: Any = None  # weakref to the strategy whose blocks hold the current buffers
        self._clock = 0
        self.lock = threading.RLock()

    # --- capacity ---------------------------------------------------------------------------------------------
    def configure(self, max_adapters: int | None = None, max_rank: int | None = None) -> None:
        """A fixed slot count and a minimum buffer rank, allocated now (sizing for the largest rank up front avoids
        a later reallocation, which makes the graph runner recapture its adapter steps)."""
        with self.lock:
            if max_adapters is not None:
                if max_adapters < 1:
                    raise LoraConfigError(f"max_adapters must be >= 1, got {max_adapters}")
                # Slot numbers are what running jobs hold: they never move.
                held = [i for i, s in enumerate(self.slots) if s is not None and s.users and i >= max_adapters]
                if held:
                    raise LoraCapacityError(f"adapter slot(s) {held} are in use by running jobs; cannot shrink to "
                                            f"{max_adapters}")
                self.num_slots = self.max_slots = max_adapters
                self.slots = (self.slots[:max_adapters] + [None] * max_adapters)[:max_adapters]
            if max_rank is not None:
                if max_rank < 1:
                    raise LoraConfigError(f"max_rank must be >= 1, got {max_rank}")
                self.min_rank = _pow2_rank(max_rank)
            self._reallocate(max(self.rank, self.min_rank) if self.rank else 0, self.groups)

    # --- adapters -------------------------------------------------------------------------------------------
    def add(self, lora: Any) -> None:
        """A newly read adapter: copied into a free slot now if the model is loaded (else on first use)."""
        with self.lock:
            model = self._model()
            if model is not None and model.loaded:
                with contextlib.suppress(LoraCapacityError):  # every slot busy: it gets one when first used
                    self.slot_for((lora,))

    def remove(self, lora: Any) -> None:
        with self.lock:
            busy = [s for s in self.slots if s is not None and lora in s.key and s.users]
            if busy:
                raise ModelStateError(f"LoRA adapter {lora.name!r} is in use by {sum(s.users for s in busy)} "
                                      "running job(s) or stream(s); cancel them (or let them finish) first")
            for i, s in enumerate(self.slots):
                if s is not None and lora in s.key:
                    self._clear(i)

    # --- slots ----------------------------------------------------------------------------------------------
    def slot_for(self, key: tuple[Any, ...]) -> int:
        """The slot holding the adapters `key` (written now if none does); -1 for no adapters."""
        if not key:
            return -1
        with self.lock:
            self._clock += 1
            for i, s in enumerate(self.slots):
                if s is not None and s.key == key:
                    s.last_use = self._clock
                    return i
            need_rank, need_groups = _needs(key)
            replaced = _replaced(key)
            if need_rank > self.rank or not need_groups <= self.groups:
                self._reallocate(max(self.rank, self.min_rank, _pow2_rank(need_rank)), self.groups | need_groups)
            i = self._free_slot()
            used = {m: sum(m in _replaced(s.key) for j, s in enumerate(self.slots) if s is not None and j != i)
                    for m in replaced}
            if any(used[m] + 1 > self.tables[m] for m in replaced):
                self.tables.update({m: max(self.tables[m], used[m] + 1) for m in replaced})
                self._reallocate(self.rank, self.groups)
            self.slots[i] = _Slot(key, 0, self._clock)
            self._write(i)
            return i

    def acquire(self, loras: Any, model: Any = None) -> int:
        """Hold the slot of `loras` (a running job or stream) until `release`; -1 for no adapters."""
        with self.lock:
            i = self.slot_for(normalize(loras, model))
            if i >= 0:
                self.slots[i].users += 1  # type: ignore[union-attr]
            return i

    def release(self, i: int) -> None:
        with self.lock:
            s = self.slots[i] if 0 <= i < len(self.slots) else None
            if s is not None and s.users > 0:
                s.users -= 1

    def ensure(self, strategy: Any) -> int:
        """Attach the buffers to `strategy`'s blocks if they are not (a new load); the generation to key graphs."""
        with self.lock:
            if self._strategy is None or self._strategy() is not strategy:
                self._attach(strategy)
            return self.generation

    # --- internals ------------------------------------------------------------------------------------------
    def _free_slot(self) -> int:
        for i, s in enumerate(self.slots):
            if s is None:
                return i
        if self.num_slots < self.max_slots:  # more slots (new buffers; the slot numbers in use stay valid)
            first, self.num_slots = self.num_slots, min(self.max_slots, 2 * self.num_slots)
            self.slots += [None] * (self.num_slots - first)
            self._reallocate(self.rank, self.groups)
            return first
        idle = [i for i, s in enumerate(self.slots) if s is not None and s.users == 0]
        if not idle:
            raise LoraCapacityError(f"all {self.num_slots} adapter slots hold adapters of running jobs; raise the "
                                    "slot count with exlpy.lora.configure(model, max_adapters=N)")
        i = min(idle, key=lambda j: self.slots[j].last_use)  # type: ignore[union-attr]
        self._clear(i)
        return i

    def _blocks(self) -> Iterator[Any]:
        strategy = self._strategy() if self._strategy is not None else None
        if strategy is None:
            return
        for stage in strategy.stages:
            for lane in stage.lanes:
                for m in lane.modules:
                    if isinstance(m, (Attention, MLP, Embedding, Head)) and m.lora is not None:
                        yield m.lora

    # Buffers are created and written in inference mode (forwards run there), whoever calls.
    def _write(self, i: int) -> None:
        s = self.slots[i]
        assert s is not None
        with torch.inference_mode():
            for block in self._blocks():
                block.write(i, s.key)

    def _clear(self, i: int) -> None:
        with torch.inference_mode():
            for block in self._blocks():
                block.clear(i)
        self.slots[i] = None

    def _outer(self, m: Any, key: str) -> OuterLora | None:
        """The embedding's or the head's buffers (None while no adapter changes that module)."""
        low_rank, tables = key in self.groups, self.tables[key]
        if not low_rank and not tables:
            return None
        spec = m.spec
        assert m.device is not None
        return OuterLora(key, spec.vocab_size, spec.hidden_size, low_rank, tables, self.num_slots,
                         max(self.rank, MIN_RANK), m.device, m.dtype(m.device))

    def _reallocate(self, rank: int, groups: set[str]) -> None:
        self.rank, self.groups = rank, set(groups)
        model = self._model()
        if model is not None and model.loaded:
            self._attach(model.strategy_for_forward())
        else:
            self._strategy = None  # unloaded: the next load's first adapter step attaches (ensure)

    def _attach(self, strategy: Any) -> None:
        from exlpy.lora.block import BlockLora

        model = self._model()
        shares = _lane_shares(model, strategy)
        if strategy.name == "streaming":
            raise LoraConfigError("LoRA adapters are not supported on a model loaded for layer streaming "
                                  "(load(lazy=True)): their buffers live on loaded modules; load the model normally")
        outer = {m for m in (EMBED, HEAD) if m in self.groups or self.tables[m]}
        if outer and strategy.name == "tensor_parallel":
            raise LoraConfigError(f"adapters that replace or adapt {' and '.join(sorted(outer))} are not supported "
                                  "under tensor parallelism (the embedding and the head are split by vocabulary)")
        with torch.inference_mode():
            for lane, share_of in zip((ln for st in strategy.stages for ln in st.lanes), shares):
                for m in lane.modules:
                    if isinstance(m, (Attention, MLP)):
                        m.lora = BlockLora(m, share_of(m) if share_of else None, self.groups, self.num_slots,
                                           max(self.rank, MIN_RANK))
                    elif isinstance(m, (Embedding, Head)):
                        m.lora = self._outer(m, EMBED if isinstance(m, Embedding) else HEAD)
        self._strategy = weakref.ref(strategy)
        self.generation += 1
        for i, s in enumerate(self.slots):
            if s is not None:
                self._write(i)


def _needs(key: tuple[Any, ...]) -> tuple[int, set[str]]:
    """Largest summed rank over the projections of `key`'s adapters, and the groups they touch (EMBED / HEAD
    for low-rank changes of the embedding / head)."""
    ranks: dict[str, int] = {}
    groups: set[str] = set()
    for lora in key:
        for mod, (a, _) in lora.weights.items():
            ranks[mod] = ranks.get(mod, 0) + int(a.shape[0])
            groups.add(GROUP_OF[mod.rsplit(".", 1)[1]])
        for mod, w in lora.outer.items():
            if w.a is not None:
                ranks[mod] = ranks.get(mod, 0) + w.rank
                groups.add(mod)
    return max(ranks.values(), default=0), groups


def _replaced(key: tuple[Any, ...]) -> set[str]:
    """The modules (EMBED, HEAD) that `key`'s adapters replace; two adapters replacing one module clash."""
    out: dict[str, Any] = {}
    for lora in key:
        for mod, w in lora.outer.items():
            if w.table is not None:
                if mod in out:
                    raise LoraConfigError(f"LoRA adapters {out[mod].name!r} and {lora.name!r} both replace {mod}; "
                                          "they cannot be applied together")
                out[mod] = lora
    return set(out)


def _lane_shares(model: Any, strategy: Any) -> Sequence[Any]:
    """Per lane, a function giving each module copy its tensor-parallel Share (None: whole blocks)."""
    lanes = [ln for st in strategy.stages for ln in st.lanes]
    ctx = getattr(model, "tp_context", None)
    if strategy.name != "tensor_parallel" or ctx is None:
        return [None] * len(lanes)
    from exlpy.engine.tensor_parallel import shares

    def row_layout(m: Any) -> bool:
        return isinstance(m.o_proj if isinstance(m, Attention) else m.down_proj, RowParallel)

    per_slot = shares(ctx, row_layout)
    return [per_slot[slot] for slot in ctx.all_devices()]


_registries: weakref.WeakKeyDictionary[Any, LoraRegistry] = weakref.WeakKeyDictionary()
_registries_lock = threading.Lock()


def registry_of(model: Any) -> LoraRegistry:
    with _registries_lock:
        reg = _registries.get(model)
        if reg is None:
            reg = _registries[model] = LoraRegistry(model)
        return reg


def configure(model: Any, max_adapters: int | None = None, max_rank: int | None = None) -> None:
    """Adapter slots of `model`: how many adapters (or adapter lists) can be resident at once (default: up to
    8, allocated as adapters arrive), and a rank to size the buffers for up front (default: the largest rank
    loaded so far, at least 16)."""
    registry_of(model).configure(max_adapters, max_rank)


@contextlib.contextmanager
def adapter_rows(model: Any, loras: Any) -> Iterator[tuple[int, int]]:
    """(slot, generation) for a forward whose rows all use `loras` (-1, 0 for none), the slot held meanwhile."""
    key = normalize(loras, model)
    if not key:
        yield -1, 0
        return
    reg = registry_of(model)
    strategy = model.strategy_for_forward()
    with reg.lock:
        generation = reg.ensure(strategy)
        slot = reg.acquire(key, model)
        generation = reg.generation
    try:
        yield slot, generation
    finally:
        reg.release(slot)
