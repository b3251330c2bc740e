"""Quantization of cached K/V vectors: a 32-point Hadamard rotation per group, then absmax integer codes.

The rotation spreads outliers over the whole group before rounding, which is why exllamav2's Q4 cache beats a
plain FP8 cache on perplexity (spec §5). Each group of 32 consecutive elements of a token's [Hkv*D] vector gets
one fp16 scale. 4-bit codes are packed two per byte.
"""

from __future__ import annotations

import functools

import torch

GROUP = 32


@functools.lru_cache(maxsize=8)
def _hadamard(device: str, dtype: torch.dtype) -> torch.Tensor:
    """Orthonormal 32x32 Sylvester Hadamard matrix (symmetric, its own inverse)."""
    h = torch.ones(1, 1)
    while h.shape[0] < GROUP:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / GROUP**0.5).to(device=device, dtype=dtype)


def quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., E] (E multiple of 32) -> (codes uint8 [..., E*bits/8], scales fp16 [..., E/32])."""
    shape = x.shape
    g = x.float().reshape(*shape[:-1], -1, GROUP) @ _hadamard(str(x.device), torch.float32)
    half = 2 ** (bits - 1)
    absmax = g.abs().amax(-1, keepdim=True).clamp(min=1e-8)
    scale = absmax / half
    q = torch.clamp(torch.round(g / scale) + half, 0, 2 * half - 1).to(torch.uint8).reshape(*shape)
    if bits == 4:
        q = q[..., 0::2] | (q[..., 1::2] << 4)
    return q, scale.squeeze(-1).to(torch.float16)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize`: -> [..., E] in `dtype`."""
    if bits == 4:
        codes = torch.stack([codes & 0x0F, codes >> 4], dim=-1).flatten(-2)
    half = 2 ** (bits - 1)
    g = (codes.float() - half).reshape(*codes.shape[:-1], -1, GROUP) * scales.float().unsqueeze(-1)
    g = g @ _hadamard(str(codes.device), torch.float32)
    return g.reshape(codes.shape).to(dtype)


def fp8_encode(x: torch.Tensor) -> torch.Tensor:
    """exllamav2's "FP8" cache: the upper byte of the fp16 value (E5M2 by truncation)."""
    return (x.to(torch.float16).view(torch.int16) >> 8).to(torch.uint8)


def fp8_decode(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.to(torch.int16) << 8).view(torch.float16).to(dtype)
