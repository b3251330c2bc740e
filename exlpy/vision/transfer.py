"""Host tensors to the device without waiting for it.

A copy from pageable host memory (`t.to("cuda")`) waits for everything already queued on the stream. On the image
path that is the vision tower or the prompt's prefill, so such a copy would hold the host back from queueing the
work that follows (the prompt's setup, the next step's launches); through pinned memory the copy is queued like a
kernel.
"""

from __future__ import annotations

import torch


def upload(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host tensor t on `device` (in `dtype`), queued without a wait on a GPU."""
    if device.type != "cuda":
        return t.to(device=device, dtype=dtype or t.dtype)
    return t.pin_memory().to(device, non_blocking=True).to(dtype or t.dtype)
