"""Cross-device tensor moves that survive broken peer-to-peer (spec §6.7).

Some machines advertise P2P between GPUs that silently corrupts copies (IOMMU, certain PCIe switches). The
first move between an unordered device pair runs a round trip of a known tensor (randn(5) + 123, a → b → a)
and compares; the verdict is cached per pair. A pair that failed copies through host memory from then on.
"""

from __future__ import annotations

import threading

import torch

_verdicts: dict[tuple[str, str], bool] = {}
_lock = threading.Lock()


def _pair(a: torch.device, b: torch.device) -> tuple[str, str]:
    x, y = str(a), str(b)
    return (x, y) if x <= y else (y, x)


def _round_trip(a: torch.device, b: torch.device) -> bool:
    probe = torch.randn(5, device=a) + 123
    back = probe.to(b).to(a)
    torch.cuda.synchronize(a)
    torch.cuda.synchronize(b)
    return bool(torch.equal(probe, back))


def peer_copy_ok(a: torch.device | str, b: torch.device | str) -> bool:
    """Whether direct copies between GPUs a and b are trustworthy (tested once per pair, then cached)."""
    a, b = torch.device(a), torch.device(b)
    if a == b or a.type != "cuda" or b.type != "cuda":
        return True
    key = _pair(a, b)
    with _lock:
        if key not in _verdicts:
            try:
                _verdicts[key] = _round_trip(a, b)
            except RuntimeError:
                _verdicts[key] = False
        return _verdicts[key]


def set_peer_verdict(a: torch.device | str, b: torch.device | str, ok: bool) -> None:
    """Record a verdict without testing (a user who knows their topology, or a test)."""
    with _lock:
        _verdicts[_pair(torch.device(a), torch.device(b))] = ok


def clear_peer_verdicts() -> None:
    with _lock:
        _verdicts.clear()


def safe_move_tensor(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` on `device`: a direct copy where trustworthy, staged through the CPU between GPUs that failed the
    test.

    A move onto the CPU synchronizes the source device's stream only through `.to()` itself (blocking copy);
    a move from the CPU onto a GPU is ordered on that GPU's current stream, like any other kernel there.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if t.device == device:
        return t
    if t.device.type == "cuda" and device.type == "cuda" and not peer_copy_ok(t.device, device):
        return t.cpu().to(device)
    return t.to(device)
