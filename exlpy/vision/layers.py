"""Building blocks of the vision towers: mostly torch (their work is a few large matmuls and attention over one
image's patches, which torch's own kernels run well on GPUs and CPUs alike); the memory-bound elementwise steps
(RMSNorm here, RoPE and SwiGLU in the Qwen tower) go through the kernel dispatch, one pass each on GPUs where torch
needs several over fp32 copies."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from exlpy.errors import ConfigError
from exlpy.kernels import ops

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
    """transformers' Qwen2RMSNorm: in fp32, weight applied after casting back (w in x's dtype). Through the
    kernel dispatch: on GPUs one Triton kernel reads x once and writes the result (torch's rms_norm needed the
    fp32 copy, the norm, the cast and the multiply: four passes over [patches, width])."""
    return ops.rms_norm(x, w, eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_fp32(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NEOX rotation of x [N, ..., D] (q [N, H, D], or q and k together [N, 2, H, D]) by cos / sin [N, D],
    computed in fp32 as transformers' vision towers do."""
    xf = x.float()
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape).float(), sin.view(shape).float()
    return (xf * c + rotate_half(xf) * s).to(x.dtype)


@dataclass(frozen=True)
class Segments:
    """Bidirectional attention segments of N rows (one image, or the windows of one), planned once per image
    shape: segments of equal length form one group that runs as one batched SDPA call (no mask, so flash-style
    kernels apply). A group whose segments lie next to each other is a slice of the rows from `start` (index
    None: no gather); otherwise `index` holds its rows [count * length] on the device."""

    groups: tuple[tuple[int, int, torch.Tensor | None, int], ...]  # (count, length, row index or None, start)


def plan_segments(bounds: torch.Tensor | list[int], device: torch.device) -> Segments:
    """The groups of segments [bounds[i], bounds[i + 1]) (bounds ascending, from 0 to N), indices uploaded once."""
    b = torch.as_tensor(bounds, dtype=torch.long)
    starts, lengths = b[:-1], b[1:] - b[:-1]
    keep = lengths > 0
    starts, lengths = starts[keep], lengths[keep]
    groups = []
    for n in torch.unique(lengths).tolist():  # a few distinct lengths (full windows, edge windows), not segments
        first = starts[lengths == n]
        a = int(first[0])
        if torch.equal(first, a + n * torch.arange(first.numel())):  # adjacent: a slice of the rows
            groups.append((first.numel(), n, None, a))
            continue
        idx = (first.view(-1, 1) + torch.arange(n)).view(-1)
        groups.append((first.numel(), n, idx.to(device, non_blocking=True), a))
    return Segments(tuple(groups))


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments | list[int],
                      scale: float) -> torch.Tensor:
    """Bidirectional attention of q / k / v [N, H, D] within each segment (a `Segments` plan, or bounds)."""
    if not isinstance(segments, Segments):
        segments = plan_segments(segments, q.device)
    n_rows = q.shape[0]
    out = None
    for count, n, idx, start in segments.groups:
        if idx is None:  # 4-D [count, H, n, D] views of the rows: torch's fused kernels take only 4-D inputs
            rows = slice(start, start + count * n)
            qs, ks, vs = (t[rows].view(count, n, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(1, 2)
            if count * n == n_rows:  # one group spans every row (one image's full attention, or equal windows)
                return o.reshape(q.shape)
            if out is None:
                out = torch.empty_like(q)
            out[rows].view(count, n, *q.shape[1:]).copy_(o)  # one copy, straight from the transposed output
            continue
        qs, ks, vs = (t.index_select(0, idx).view(count, n, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
        if out is None:
            out = torch.empty_like(q)
        out.index_copy_(0, idx, o.transpose(1, 2).reshape(-1, *q.shape[1:]))
    assert out is not None
    return out
