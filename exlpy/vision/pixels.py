"""Image pixels as tensors on the tower's device: one upload of the uint8 image, then resizing (on a GPU),
rescaling and normalization there, with the arithmetic of transformers' PIL image processors.

The resize on a GPU is PIL's own algorithm for 8-bit images (Pillow's Resample.c), so the pixels equal those of
the CPU path bit for bit: two separable passes, horizontal then vertical, each output pixel the sum of its
taps' uint8 values times fixed-point coefficients (22 fractional bits, computed from the filter exactly as
Pillow computes them, in double precision on the host, once per size), plus a half, shifted and clipped to
0..255, in 32-bit integers as Pillow does. On the CPU Pillow itself resizes.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import torch


def image_tensor(image: Any, device: torch.device, array: np.ndarray | None = None) -> torch.Tensor:
    """The RGB PIL image (`array`: its pixels, if already taken out) as uint8 [H, W, C] on `device` (through
    pinned memory to a GPU, without waiting)."""
    a = np.asarray(image, dtype=np.uint8) if array is None else array
    if device.type != "cuda":
        return torch.from_numpy(a.copy())  # a writable copy: PIL's buffer is read-only
    host = torch.empty(a.shape, dtype=torch.uint8, pin_memory=True)
    host.numpy()[...] = a
    return host.to(device, non_blocking=True)


def _bicubic(x: torch.Tensor) -> torch.Tensor:  # Pillow's bicubic_filter, a = -0.5
    a = -0.5
    x = x.abs()
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return torch.where(x < 1.0, near, torch.where(x < 2.0, far, torch.zeros_like(x)))


def _bilinear(x: torch.Tensor) -> torch.Tensor:  # Pillow's bilinear_filter
    x = x.abs()
    return torch.where(x < 1.0, 1.0 - x, torch.zeros_like(x))


FILTERS = {"bicubic": (_bicubic, 2.0), "bilinear": (_bilinear, 1.0)}
PRECISION_BITS = 32 - 8 - 2  # Pillow's fixed point for 8-bit images
DEVICE_RESIZE_PIXELS = 16_000_000


@functools.lru_cache(maxsize=32)
def pil_taps(in_size: int, out_size: int, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(source index [out, ksize] int64, fixed-point coefficient [out, ksize] int32) of each output pixel of a
    resize from in_size to out_size, as Pillow's precompute_coeffs + normalize_coeffs_8bpc compute them (unused
    taps: coefficient 0, index 0)."""
    fn, support = FILTERS[mode]
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support = support * filterscale
    ksize = math.ceil(support) * 2 + 1
    center = (torch.arange(out_size, dtype=torch.float64) + 0.5) * scale
    xmin = (center - support + 0.5).trunc().clamp(min=0)  # C's (int) cast truncates toward zero
    xmax = (center + support + 0.5).trunc().clamp(max=in_size) - xmin
    x = torch.arange(ksize, dtype=torch.float64)
    w = fn((x + xmin[:, None] - center[:, None] + 0.5) * (1.0 / filterscale))
    used = x < xmax[:, None]
    w = torch.where(used, w, torch.zeros_like(w))
    ww = w.sum(1, keepdim=True)
    w = torch.where(ww != 0.0, w / torch.where(ww != 0.0, ww, torch.ones_like(ww)), w)
    fixed = torch.where(w < 0, (-0.5 + w * (1 << PRECISION_BITS)).trunc(), (0.5 + w * (1 << PRECISION_BITS)).trunc())
    index = torch.where(used, x.long() + xmin.long()[:, None], torch.zeros_like(x.long()))
    return index, fixed.to(torch.int32)


def _pass(x: torch.Tensor, out_size: int, dim: int, mode: str) -> torch.Tensor:
    """One Pillow resampling pass of uint8-valued int32 x along `dim`."""
    index, coef = pil_taps(x.shape[dim], out_size, mode)
    index, coef = index.to(x.device, non_blocking=True), coef.to(x.device, non_blocking=True)
    shape = [1] * x.dim()
    shape[dim] = out_size
    acc = None
    for k in range(index.shape[1]):
        term = x.index_select(dim, index[:, k]) * coef[:, k].view(shape)
        acc = term if acc is None else acc.add_(term)
    assert acc is not None
    acc.add_(1 << (PRECISION_BITS - 1))
    return (acc >> PRECISION_BITS).clamp_(0, 255)


def resize_like_pil(x: torch.Tensor, height: int, width: int, mode: str) -> torch.Tensor:
    """uint8 [C, H, W] (any device) resized exactly as Pillow resizes 8-bit images (mode: bicubic or bilinear)."""
    y = x.to(torch.int32)
    if y.shape[-1] != width:
        y = _pass(y, width, 2, mode)
    if y.shape[-2] != height:
        y = _pass(y, height, 1, mode)
    return y.to(torch.uint8)


def normalize(x: torch.Tensor, rescale: float, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """[C, H, W] fp32 of uint8-valued x [C, H, W]: rescaled in float64 and normalized in float32, as transformers'
    processors do (so the CPU result is bit-equal to theirs)."""
    y = x.contiguous().to(torch.float64).mul_(rescale).to(torch.float32)  # contiguous: x is often an HWC view
    m = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1).to(x.device, non_blocking=True)
    s = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1).to(x.device, non_blocking=True)
    return y.sub_(m).div_(s)


def resized_pixels(image: Any, height: int, width: int, mode: str, device: torch.device | None,
                   array: np.ndarray | None = None) -> torch.Tensor:
    """uint8 [C, height, width] of a PIL image on `device` (None: the CPU): resized by Pillow on the CPU, by
    resize_like_pil (the same pixels) on a GPU after uploading the original image (up to DEVICE_RESIZE_PIXELS:
    its int32 working copies of larger images would take GPU memory the model may need). `array`: the image's
    pixels as image.image_array gives them, where the caller has them already."""
    from PIL import Image

    dev = torch.device("cpu") if device is None else torch.device(device)
    same = (image.width, image.height) == (width, height)
    on_device = dev.type == "cuda" and image.width * image.height <= DEVICE_RESIZE_PIXELS
    if not same and not on_device:
        image = image.resize((width, height), resample=Image.BICUBIC if mode == "bicubic" else Image.BILINEAR)
        array = None  # the resized image's pixels, not the original's
    x = image_tensor(image, dev, array).permute(2, 0, 1)
    if not same and on_device:
        return resize_like_pil(x, height, width, mode)
    return x
