"""The layer-split planner: which device each module goes to, decided by arithmetic before anything is loaded.

Inputs are plain data (module costs, model and run shapes, a cache type, one `DeviceBudget` per device), so a
plan can be made for devices that are simulated (a list of free bytes) as easily as for real ones.

Order semantics are exllamav2's: modules are placed in list order and the device index never goes back; a
device that cannot take the next module is left behind. Two policies decide *when* to move on:

- ``"greedy"``: fill each device as far as it goes (exllamav2's behaviour; used for explicit `gpu_split`
  budgets, where the user said how much each device may take).
- ``"balanced"`` (autosplit default): give each device a share of the model's bytes in proportion to its
  usable memory (free − reserve − context − scratch), moving on at the layer boundary nearest to that share.
  Every device then keeps the same fraction of its usable memory as headroom instead of GPU 0 being full and
  the last one empty. If layer granularity makes the proportional split overflow a device, the greedy split
  is used instead.

Fit solving (`fit_context`, `fit_batch`) binary-searches the planner itself: whatever it accepts is what
loads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from exlpy.errors import InsufficientVRAMError
from exlpy.parallel.costs import (
    CacheSpec,
    ModelShape,
    ModuleCost,
    RunShape,
    cache_bytes_per_layer,
    cache_temp_bytes,
    fmt_mib,
    scratch_by_kind,
)

POLICIES = ("balanced", "greedy")
FIT_STEP = 256  # context lengths are searched in whole pages


@dataclass(frozen=True)
class DeviceBudget:
    """What one device offers: free bytes (or a gpu_split budget), the reserve to keep, context overhead."""

    free: int
    reserve: int = 0
    overhead: int = 0

    @property
    def usable(self) -> int:
        return self.free - self.reserve - self.overhead


@dataclass(frozen=True)
class DeviceUse:
    """Planned bytes on one device."""

    index: int
    free: int
    reserve: int
    overhead: int
    weights: int
    cache: int
    scratch: int

    @property
    def total(self) -> int:
        return self.weights + self.cache + self.scratch + self.overhead

    @property
    def headroom(self) -> int:
        return self.free - self.reserve - self.total


@dataclass(frozen=True)
class Plan:
    """module → device (index into the budgets list), and bytes per device split into weights / cache /
    scratch."""

    modules: tuple[ModuleCost, ...]
    devices: tuple[int, ...]
    usage: tuple[DeviceUse, ...]
    policy: str
    run: RunShape
    cache: CacheSpec
    shape: ModelShape = field(repr=False)

    def device_of(self, name: str) -> int:
        for m, d in zip(self.modules, self.devices):
            if m.name == name:
                return d
        raise KeyError(name)

    def layers_on(self, device: int) -> list[int]:
        """Transformer layer indices whose attention module is on `device`."""
        return [m.layer_idx for m, d in zip(self.modules, self.devices) if d == device and m.layer_idx is not None]

    def used_devices(self) -> list[int]:
        return sorted(set(self.devices))

    def predicted_allocated(self, device: int) -> int:
        """Bytes torch.cuda.memory_allocated should show on `device` right after loading (weights + cache)."""
        u = self.usage[device]
        return u.weights + u.cache


def _cost(m: ModuleCost, layer_cache: int) -> int:
    return m.weight_bytes + (layer_cache if m.kind == "attention" else 0)


class _Fill:
    """Running totals per device while a plan is built."""

    def __init__(self, budgets: Sequence[DeviceBudget], scratch: dict[str, int], temp: int = 0) -> None:
        self.budgets = budgets
        self.scratch_of = scratch
        self.temp = temp  # quantized caches: dequant buffers on each device that hosts attention
        n = len(budgets)
        self.weights, self.cache, self.scratch = [0] * n, [0] * n, [0] * n
        self.has_attn = [False] * n

    def _temp(self, d: int, m: ModuleCost) -> int:
        return self.temp if m.kind == "attention" and not self.has_attn[d] else 0

    def need(self, d: int, m: ModuleCost, layer_cache: int) -> tuple[int, int]:
        """(bytes this module would add including scratch growth, bytes left for it on device d)."""
        grow = max(0, self.scratch_of.get(m.kind, 0) - self.scratch[d])
        left = self.budgets[d].usable - self.weights[d] - self.cache[d] - self.scratch[d]
        return _cost(m, layer_cache) + grow + self._temp(d, m), left

    def fits(self, d: int, m: ModuleCost, layer_cache: int) -> bool:
        need, left = self.need(d, m, layer_cache)
        return need <= left

    def add(self, d: int, m: ModuleCost, layer_cache: int) -> None:
        self.weights[d] += m.weight_bytes
        if m.kind == "attention":
            self.cache[d] += layer_cache + self._temp(d, m)
            self.has_attn[d] = True
        self.scratch[d] = max(self.scratch[d], self.scratch_of.get(m.kind, 0))

    def load(self, d: int) -> int:
        return self.weights[d] + self.cache[d]


def make_plan(
    modules: Sequence[ModuleCost],
    shape: ModelShape,
    run: RunShape,
    cache: CacheSpec,
    budgets: Sequence[DeviceBudget],
    policy: str = "balanced",
    layer_cache: int | None = None,
) -> Plan:
    """Place `modules` in order over `budgets`; InsufficientVRAMError (with the numbers) when they do not fit.

    layer_cache overrides the cache bytes per attention layer (several caches attached to one model)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown placement policy {policy!r}; expected one of {POLICIES}")
    if not budgets:
        raise InsufficientVRAMError("Insufficient VRAM for model and cache: no devices to place the model on")
    if layer_cache is None:
        layer_cache = cache_bytes_per_layer(shape, run, cache)
    scratch = scratch_by_kind(shape, run)
    temp = cache_temp_bytes(shape, run, cache)
    placed = None
    if policy == "balanced" and len(budgets) > 1:
        placed = _place_balanced(modules, budgets, scratch, layer_cache, temp)
    if placed is None:
        placed = _place_greedy(modules, budgets, scratch, layer_cache, shape, run, cache, temp)
    devices, fill = placed
    usage = tuple(
        DeviceUse(
            i,
            b.free,
            b.reserve,
            b.overhead if fill.load(i) else 0,
            fill.weights[i],
            fill.cache[i],
            fill.scratch[i],
        )
        for i, b in enumerate(budgets)
    )
    return Plan(tuple(modules), tuple(devices), usage, policy, run, cache, shape)


def _place_greedy(
    modules: Sequence[ModuleCost],
    budgets: Sequence[DeviceBudget],
    scratch: dict[str, int],
    layer_cache: int,
    shape: ModelShape,
    run: RunShape,
    cache: CacheSpec,
    temp: int,
) -> tuple[list[int], _Fill]:
    fill = _Fill(budgets, scratch, temp)
    devices: list[int] = []
    d = 0
    for m in modules:
        while d < len(budgets) and not fill.fits(d, m, layer_cache):
            d += 1
        if d == len(budgets):
            raise _insufficient(m, modules, budgets, fill, layer_cache, shape, run, cache)
        fill.add(d, m, layer_cache)
        devices.append(d)
    return devices, fill


def _place_balanced(
    modules: Sequence[ModuleCost],
    budgets: Sequence[DeviceBudget],
    scratch: dict[str, int],
    layer_cache: int,
    temp: int,
) -> tuple[list[int], _Fill] | None:
    layer_scratch = max(scratch["attention"], scratch["mlp"])
    caps = [max(0, b.usable - layer_scratch) for b in budgets]
    total = sum(_cost(m, layer_cache) for m in modules)
    if sum(caps) <= 0 or total > sum(caps):
        return None
    targets = [total * c / sum(caps) for c in caps]
    fill = _Fill(budgets, scratch, temp)
    devices: list[int] = []
    d = 0
    for m in modules:
        c = _cost(m, layer_cache)
        # Move on at the boundary nearest the target share: when more than half of this module would land
        # beyond it (and there is a later device to take it), or when it does not fit at all.
        while d < len(budgets) - 1 and (
            fill.load(d) + c / 2 > targets[d] and fill.load(d) > 0 or not fill.fits(d, m, layer_cache)
        ):
            d += 1
        if not fill.fits(d, m, layer_cache):
            return None
        fill.add(d, m, layer_cache)
        devices.append(d)
    return devices, fill


def _insufficient(
    m: ModuleCost,
    modules: Sequence[ModuleCost],
    budgets: Sequence[DeviceBudget],
    fill: _Fill,
    layer_cache: int,
    shape: ModelShape,
    run: RunShape,
    cache: CacheSpec,
) -> InsufficientVRAMError:
    need, left = fill.need(len(budgets) - 1, m, layer_cache)
    w = sum(x.weight_bytes for x in modules)
    kv = layer_cache * shape.num_layers
    usable = sum(max(0, b.usable) for b in budgets)
    return InsufficientVRAMError(
        f"Insufficient VRAM for model and cache: {m.name} needs {fmt_mib(need)} (weights "
        f"{fmt_mib(m.weight_bytes)}{f', cache {fmt_mib(layer_cache)}' if m.kind == 'attention' else ''}) "
        f"but the last device has {fmt_mib(max(0, left))} left; whole model: weights {fmt_mib(w)} + "
        f"{cache.name} cache {fmt_mib(kv)} (max_seq_len {run.max_seq_len} × batch {run.batch_size}) vs "
        f"{fmt_mib(usable)} usable over {len(budgets)} device(s) after reserves and context overhead. "
        "Reduce max_seq_len, use a smaller cache type (q4/q6/q8), lower reserve_vram, or add GPUs"
    )


def fits(
    modules: Sequence[ModuleCost],
    shape: ModelShape,
    run: RunShape,
    cache: CacheSpec,
    budgets: Sequence[DeviceBudget],
    policy: str = "balanced",
) -> bool:
    try:
        make_plan(modules, shape, run, cache, budgets, policy)
    except InsufficientVRAMError:
        return False
    return True


def _largest(lo: int, hi: int, ok: Callable[[int], bool]) -> int | None:
    """Largest x in [lo, hi] with ok(x), for ok monotone decreasing; None if ok(lo) fails."""
    if not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def fit_context(
    modules: Sequence[ModuleCost],
    shape: ModelShape,
    run: RunShape,
    cache: CacheSpec,
    budgets: Sequence[DeviceBudget],
    policy: str = "balanced",
    limit: int = 1 << 22,
) -> int | None:
    """Largest max_seq_len (a multiple of 256, ≤ limit) at run.batch_size that fits; None if not even 256."""

    def ok(pages: int) -> bool:
        return fits(modules, shape, run.with_(max_seq_len=pages * FIT_STEP), cache, budgets, policy)

    pages = _largest(1, max(1, limit // FIT_STEP), ok)
    return None if pages is None else pages * FIT_STEP


def fit_batch(
    modules: Sequence[ModuleCost],
    shape: ModelShape,
    run: RunShape,
    cache: CacheSpec,
    budgets: Sequence[DeviceBudget],
    policy: str = "balanced",
    limit: int = 4096,
) -> int | None:
    """Largest batch size (≤ limit) at run.max_seq_len that fits; None if not even 1."""
    return _largest(1, limit, lambda b: fits(modules, shape, run.with_(batch_size=b), cache, budgets, policy))
