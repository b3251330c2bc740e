"""Building blocks of the vision towers, in torch (their work is a few large matmuls and attention over one
image's patches, which torch's own kernels run well on GPUs and CPUs alike)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from exlpy.errors import ConfigError

ACTS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


def act_fn(name: str, where: str):  # noqa: ANN201 - a tensor function
    if name not in ACTS:
        raise ConfigError(f"{where}: vision activation {name!r} is not supported (supported: {', '.join(ACTS)})")
    return ACTS[name]


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen2RMSNorm: in fp32, weight applied after casting back."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_fp32(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NEOX rotation of x [N, H, D] by cos / sin [N, D], computed in fp32 as transformers' vision towers do."""
    xf = x.float()
    c, s = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    return (xf * c + rotate_half(xf) * s).to(x.dtype)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int], scale: float
                      ) -> torch.Tensor:
    """Bidirectional attention within each segment [bounds[i], bounds[i+1]) of q / k / v [N, H, D]: one image,
    or one window of one. Segments of equal length run as one batched SDPA call."""
    out = torch.empty_like(q)
    by_len: dict[int, list[int]] = {}
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:
            by_len.setdefault(b - a, []).append(a)
    for n, starts in by_len.items():
        idx = (torch.tensor(starts, device=q.device).view(-1, 1) + torch.arange(n, device=q.device)).view(-1)
        qs, ks, vs = (t.index_select(0, idx).view(len(starts), n, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
        out.index_copy_(0, idx, o.transpose(1, 2).reshape(-1, *q.shape[1:]))
    return out
