"""Free and total memory of each visible GPU, in torch's device order.

Sources, first that works wins: NVML (nvidia-ml-py's `pynvml`: no CUDA context is created, so nothing is spent
to ask), `torch.cuda.mem_get_info` (creates a context on each device), `rocm-smi --showmeminfo vram --json`
(AMD). NVML numbers devices by PCI order and ignores CUDA_VISIBLE_DEVICES, so devices are matched to torch
ordinals by UUID when torch can see them, else by parsing CUDA_VISIBLE_DEVICES (indices or GPU-UUIDs, in the
listed order).
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from typing import Any

import torch

from exlpy.errors import DeviceError


@dataclass(frozen=True)
class DeviceMemory:
    ordinal: int  # torch's cuda:N
    total: int
    free: int
    source: str


def visible_entries(var: str = "CUDA_VISIBLE_DEVICES") -> list[str] | None:
    """The entries of CUDA_VISIBLE_DEVICES in order (None when unset). CUDA stops at the first invalid
    entry."""
    raw = os.environ.get(var)
    if raw is None:
        return None
    return [e.strip() for e in raw.split(",") if e.strip()] if raw.strip() else []


def has_context(ordinal: int) -> bool:
    """Whether this process already holds a CUDA context on `ordinal` (then its cost is already out of
    `free`)."""
    probe = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    if probe is None or not torch.cuda.is_available():
        return False
    try:
        return bool(probe(ordinal))
    except Exception:  # noqa: BLE001 - a failed probe only means "charge the overhead"
        return False


def _nvml() -> list[DeviceMemory]:
    import pynvml

    pynvml.nvmlInit()
    try:
        handles: list[Any] = []
        if torch.cuda.is_available() and torch.version.cuda is not None:
            for i in range(torch.cuda.device_count()):
                uuid = str(torch.cuda.get_device_properties(i).uuid)
                handles.append(pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"))
        else:
            entries = visible_entries()
            if entries is None:
                entries = [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
            for e in entries:
                if e.isdigit():
                    handles.append(pynvml.nvmlDeviceGetHandleByIndex(int(e)))
                elif e.startswith("GPU-"):
                    handles.append(pynvml.nvmlDeviceGetHandleByUUID(e))
                else:
                    break  # CUDA ignores everything from the first entry it cannot parse
        out = []
        for i, h in enumerate(handles):
            info = pynvml.nvmlDeviceGetMemoryInfo(h)
            out.append(DeviceMemory(i, int(info.total), int(info.free), "nvml"))
        return out
    finally:
        pynvml.nvmlShutdown()


def _torch() -> list[DeviceMemory]:
    if not torch.cuda.is_available():
        raise RuntimeError("torch.cuda is not available")
    out = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        out.append(DeviceMemory(i, int(total), int(free), "torch"))
    return out


def parse_rocm_smi(text: str) -> list[DeviceMemory]:
    """Parse `rocm-smi --showmeminfo vram --json`: {"card0": {"VRAM Total Memory (B)": "...", "VRAM Total Used
    Memory (B)": "..."}, ...}; HIP_VISIBLE_DEVICES (or CUDA_VISIBLE_DEVICES) selects and renumbers cards."""
    data = json.loads(text)
    cards: dict[int, tuple[int, int]] = {}
    for key, val in data.items():
        if not key.startswith("card") or not isinstance(val, dict):
            continue
        total = next((int(v) for k, v in val.items() if "total" in k.lower() and "used" not in k.lower()), None)
        used = next((int(v) for k, v in val.items() if "used" in k.lower()), None)
        if total is not None and used is not None:
            cards[int(key[4:])] = (total, used)
    entries = visible_entries("HIP_VISIBLE_DEVICES") or visible_entries()
    order = [int(e) for e in entries if e.isdigit()] if entries is not None else sorted(cards)
    return [
        DeviceMemory(i, cards[c][0], cards[c][0] - cards[c][1], "rocm-smi") for i, c in enumerate(order) if c in cards
    ]


def _rocm() -> list[DeviceMemory]:
    res = subprocess.run(
        ["rocm-smi", "--showmeminfo", "vram", "--json"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return parse_rocm_smi(res.stdout)


SOURCES = {"nvml": _nvml, "torch": _torch, "rocm-smi": _rocm}


def query_devices() -> list[DeviceMemory]:
    """Memory of every visible GPU (torch ordinal order); DeviceError when no source can tell."""
    errors = []
    for name, fn in SOURCES.items():
        try:
            devs = fn()
        except Exception as e:  # noqa: BLE001 - each source may be absent in many ways; report them all
            errors.append(f"{name}: {type(e).__name__}: {e}")
            continue
        if devs:
            return devs
        errors.append(f"{name}: no devices")
    raise DeviceError(
        "Unable to read available VRAM from NVML (pynvml), torch.cuda.mem_get_info or rocm-smi; "
        "check the GPU driver and CUDA_VISIBLE_DEVICES. Tried: " + "; ".join(errors)
    )
