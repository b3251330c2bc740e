"""Image pixels as tensors on the tower's device: one upload of the uint8 image, then resizing (on a GPU),
rescaling and normalization there, with the arithmetic of transformers' PIL image processors.

On the CPU the resize is PIL's own (bit-equal to transformers' processors). On a GPU a PIL-style resize runs on
the device instead of tens of milliseconds of host time: PIL resamples 8-bit images in two separable passes,
horizontal then vertical, each rounded (half up) and clipped to 0..255; torch's antialiased interpolation uses
PIL's filters (bicubic a = -0.5, support scaled when shrinking), so the same two passes with the same rounding
agree with PIL to one level on a few pixels in a thousand (PIL computes in fixed point), closer than
transformers' own torchvision processors, which resize in one unrounded pass.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F


def image_tensor(image: Any, device: torch.device) -> torch.Tensor:
    """The RGB PIL image as uint8 [H, W, C] on `device` (through pinned memory to a GPU, without waiting)."""
    a = np.asarray(image, dtype=np.uint8)
    if device.type != "cuda":
        return torch.from_numpy(a.copy())  # a writable copy: PIL's buffer is read-only
    host = torch.empty(a.shape, dtype=torch.uint8, pin_memory=True)
    host.numpy()[...] = a
    return host.to(device, non_blocking=True)


def resize_like_pil(x: torch.Tensor, height: int, width: int, mode: str) -> torch.Tensor:
    """uint8-valued float [C, H, W] resized as PIL resizes 8-bit images (mode: bicubic or bilinear)."""
    y = x.float().unsqueeze(0)
    if y.shape[-1] != width:
        y = F.interpolate(y, size=(y.shape[-2], width), mode=mode, antialias=True)
        y = torch.floor(y + 0.5).clamp_(0, 255)
    if y.shape[-2] != height:
        y = F.interpolate(y, size=(height, width), mode=mode, antialias=True)
        y = torch.floor(y + 0.5).clamp_(0, 255)
    return y[0]


def normalize(x: torch.Tensor, rescale: float, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """[C, H, W] fp32 of uint8-valued x [C, H, W]: rescaled in float64 and normalized in float32, as transformers'
    processors do (so the CPU result is bit-equal to theirs)."""
    y = x.contiguous().to(torch.float64).mul_(rescale).to(torch.float32)  # contiguous: x is often an HWC view
    m = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1).to(x.device, non_blocking=True)
    s = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1).to(x.device, non_blocking=True)
    return y.sub_(m).div_(s)


def resized_pixels(image: Any, height: int, width: int, mode: str, device: torch.device | None) -> torch.Tensor:
    """uint8-valued [C, height, width] of a PIL image on `device` (None: the CPU): resized by PIL on the host,
    or for bicubic on a GPU by resize_like_pil on the device (bilinear stays on PIL: torch's antialiased bilinear
    differs from PIL's by up to two levels on a few percent of pixels)."""
    from PIL import Image

    dev = torch.device("cpu") if device is None else torch.device(device)
    same = (image.width, image.height) == (width, height)
    on_device = dev.type == "cuda" and mode == "bicubic"
    if not same and not on_device:
        image = image.resize((width, height), resample=Image.BICUBIC if mode == "bicubic" else Image.BILINEAR)
    x = image_tensor(image, dev).permute(2, 0, 1)
    if not same and on_device:
        return resize_like_pil(x, height, width, mode)
    return x
