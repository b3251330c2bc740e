"""The format-neutral description of a packed quantized matrix, shared by the references and the kernels.

Both EXL2 and GPTQ store codes as little-endian bit streams running down the K axis of an int32 matrix
[words, Np]. A matrix is cut into *segments* (runs of rows with one bit width, starting on a word boundary; a
GPTQ matrix is one 4-bit segment) and into *groups* (runs of rows sharing one scale/zero per column). Kernels
loop over the groups of one segment at a time, so every bit width is a compile-time constant.

All sizes here are host-side Python ints fixed at load time: launching a kernel never needs a device sync.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Segment:
    bits: int
    g_lo: int  # first group of the segment
    g_hi: int  # one past the last group
    row0: int  # first (sorted) row of the segment
    word0: int  # first q_weight row of the segment


@dataclass(frozen=True)
class QuantLayout:
    k: int
    group_bits: tuple[int, ...]
    group_rows: tuple[int, ...]  # G+1 row boundaries in sorted order
    segments: tuple[Segment, ...]

    @property
    def num_groups(self) -> int:
        return len(self.group_bits)

    def aligned_bits(self) -> frozenset[int]:
        """Bit widths whose segment has every group starting on a 32-row block (cached)."""
        cached = self.__dict__.get("_aligned")
        if cached is None:
            cached = frozenset(s.bits for s in self.segments
                               if all((self.group_rows[g] - s.row0) % 32 == 0 for g in range(s.g_lo, s.g_hi)))
            object.__setattr__(self, "_aligned", cached)
        return cached

    def row_bits(self) -> torch.Tensor:
        """Bit width of every sorted row, [K] int64."""
        counts = torch.tensor([b - a for a, b in zip(self.group_rows[:-1], self.group_rows[1:])])
        return torch.repeat_interleave(torch.tensor(self.group_bits, dtype=torch.int64), counts)

    def row_group(self) -> torch.Tensor:
        """Group index of every sorted row, [K] int64."""
        counts = torch.tensor([b - a for a, b in zip(self.group_rows[:-1], self.group_rows[1:])])
        return torch.repeat_interleave(torch.arange(self.num_groups), counts)

    def row_words(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_weight row, bit offset) where every sorted row's code starts, each [K] int64."""
        word = torch.empty(self.k, dtype=torch.int64)
        off = torch.empty(self.k, dtype=torch.int64)
        for s in self.segments:
            r1 = self.group_rows[s.g_hi]
            bit = torch.arange(r1 - s.row0, dtype=torch.int64) * s.bits
            word[s.row0:r1] = s.word0 + bit // 32
            off[s.row0:r1] = bit % 32
        return word, off


def segments_of(group_bits: list[int], group_rows: list[int], group_words: list[int] | None) -> tuple[Segment, ...]:
    """Split groups into maximal runs of one bit width. group_words: q_weight row where each group starts
    (None: segments are word-aligned by construction, e.g. GPTQ's single segment)."""
    segs: list[Segment] = []
    g = 0
    while g < len(group_bits):
        h = g
        while h < len(group_bits) and group_bits[h] == group_bits[g]:
            h += 1
        word0 = group_words[g] if group_words is not None else 0
        segs.append(Segment(group_bits[g], g, h, group_rows[g], word0))
        g = h
    return tuple(segs)


@dataclass
class QuantMatrix:
    """Packed weights of one quantized linear, in sorted (act-order) row order.

    kind "exl2": scales = q_scale int32 [G, Np/8] (4-bit codes), scale_max = fp32 [G] already multiplied by
        prescale/256, zeros = None (zero point 2^(bits-1)).
    kind "gptq": scales = fp16 [G, Np], zeros = fp16 [G, Np] true zero points, scale_max = None.
    perm: int32 [K] or None; sorted row r is input feature perm[r] (y = x[:, perm] @ W_sorted).
    """

    kind: str
    layout: QuantLayout
    q_weight: torch.Tensor
    scales: torch.Tensor
    scale_max: torch.Tensor | None
    zeros: torch.Tensor | None
    perm: torch.Tensor | None
    n: int  # real output columns (q_weight may hold up to 31 padding columns more)
    group_rows: torch.Tensor | None = None  # int32 [G+1] row boundaries on q_weight's device, for kernels

    def __post_init__(self) -> None:
        if self.group_rows is None or self.group_rows.device != self.q_weight.device:
            self.group_rows = torch.tensor(self.layout.group_rows, dtype=torch.int32, device=self.q_weight.device)

    @property
    def k(self) -> int:
        return self.layout.k

    @property
    def device(self) -> torch.device:
        return self.q_weight.device

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.q_weight, self.scales, self.scale_max, self.zeros, self.perm) if t is not None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def to(self, device: torch.device | str) -> QuantMatrix:
        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return replace(self, q_weight=mv(self.q_weight), scales=mv(self.scales), scale_max=mv(self.scale_max),
                       zeros=mv(self.zeros), perm=mv(self.perm), group_rows=mv(self.group_rows))

    def split_columns(self, start: int, end: int, copy: bool = True) -> QuantMatrix:
        """Columns [start, end) (start a multiple of 8: EXL2 scale codes pack 8 columns per word).
        copy=False returns strided views (kernels take strides), for slicing inside a forward pass."""
        end_p = min(end, self.q_weight.shape[1])
        if self.kind == "exl2":
            scales = self.scales[:, start // 8:(end_p + 7) // 8]
        else:
            scales = self.scales[:, start:end_p]
        zeros = None if self.zeros is None else self.zeros[:, start:end_p]
        qw = self.q_weight[:, start:end_p]
        if copy:
            qw, scales = qw.contiguous(), scales.contiguous()
            zeros = None if zeros is None else zeros.contiguous()
        return replace(self, q_weight=qw, scales=scales, zeros=zeros, n=min(end, self.n) - start)
