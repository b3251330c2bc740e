"""QParams: how one matrix is quantized (spec §4.4), the option tables, group layouts (§3.3) and bit costs.

An option is a list of (bits, proportion, group size) in non-increasing bit order: the most important rows (act
order) get the most bits. exllamav2's measurement files describe options as QParamsDicts, which load here too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from exlpy.quant.exl2_ref import EXL2_BITS
from exlpy.quant.pack import exl2_group_plan

HEAD_BITS = (2, 3, 4, 5, 6, 8)


@dataclass(frozen=True)
class QParams:
    parts: tuple[tuple[int, float, int], ...]  # (bits, proportion, group size), bits non-increasing

    def groups(self, k: int) -> list[tuple[int, int]]:
        """Per-group (bits, rows) for a matrix with K input rows (spec §3.3)."""
        return exl2_group_plan(k, list(self.parts))

    def total_bits(self, k: int, n: int, bias: bool = False) -> int:
        """Storage cost of a K x N matrix (spec §4.4 cost model)."""
        groups = self.groups(k)
        bits = sum(rows * n * b for b, rows in groups)
        g = len(groups)
        bits += g * 16 + g * 32 + g * n * 4 + k * 32
        return bits + (16 * n if bias else 0)

    def to_dict(self) -> dict[str, Any]:
        """exllamav2's QParamsDict."""
        return {"group_size": {str(b): gs for b, _, gs in self.parts}, "bits": [b for b, _, _ in self.parts],
                "bits_prop": [p for _, p, _ in self.parts], "scale_bits": 4}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> QParams:
        gs = {int(k): int(v) for k, v in d["group_size"].items()}
        bits = [int(b) for b in d["bits"]]
        props = [float(p) for p in d["bits_prop"]]
        if len(bits) != len(props) or not bits or any(b not in EXL2_BITS or b not in gs for b in bits):
            raise ValueError(f"malformed QParams {d}")
        if any(a < b for a, b in zip(bits, bits[1:])) or any(gs[b] % 16 for b in bits):
            raise ValueError(f"QParams bits must be non-increasing with group sizes multiple of 16: {d}")
        return QParams(tuple((b, p, gs[b]) for b, p in zip(bits, props)))

    def __str__(self) -> str:
        return "/".join(f"{p:g}x{b}b" for b, p, _ in self.parts) + " g" + "/".join(str(g) for _, _, g in self.parts)


def qp(*parts: tuple[int, float, int]) -> QParams:
    return QParams(tuple(parts))


def _two(hi: int, lo: int, p: float, gs: int) -> QParams:
    return qp((hi, p, gs), (lo, 1.0 - p, gs))


def _one(b: int, gs: int) -> QParams:
    return qp((b, 1.0, gs))


# Attention (q, k, v, o), 19 entries: spec §4.4.
_A = [
    (_two(3, 2, 0.05, 64),) * 3 + (_two(3, 2, 0.05, 64),),
    (_two(3, 2, 0.1, 64), _two(3, 2, 0.1, 64), _two(3, 2, 0.25, 64), _two(3, 2, 0.1, 64)),
    (_two(3, 2, 0.1, 64), _two(3, 2, 0.1, 64), _two(4, 3, 0.1, 128), _two(3, 2, 0.1, 64)),
    (_two(3, 2, 0.1, 64), _two(3, 2, 0.1, 64), _two(4, 3, 0.1, 128), _two(4, 3, 0.1, 128)),
    (_two(4, 3, 0.1, 128),) * 4,
    (_two(4, 3, 0.1, 128), _two(4, 3, 0.1, 128), _two(4, 3, 0.1, 64), _two(4, 3, 0.1, 128)),
    (_one(4, 128),) * 4,
    (_one(4, 128), _one(4, 128), _one(4, 64), _one(4, 128)),
    (_one(4, 64), _one(4, 64), _one(4, 32), _one(4, 64)),
    (_one(4, 32),) * 4,
    (_two(5, 4, 0.1, 128), _two(5, 4, 0.1, 128), _two(5, 4, 0.1, 64), _two(5, 4, 0.1, 128)),
    (_two(5, 4, 0.1, 64), _two(5, 4, 0.1, 64), _two(5, 4, 0.1, 32), _two(5, 4, 0.1, 64)),
    (_two(5, 4, 0.1, 64), _two(5, 4, 0.1, 64), _one(5, 64), _two(5, 4, 0.1, 64)),
    (_two(5, 4, 0.1, 32), _two(5, 4, 0.1, 32), _one(5, 32), _two(5, 4, 0.1, 32)),
    (_two(6, 5, 0.1, 128), _two(6, 5, 0.1, 128), _one(6, 128), _two(6, 5, 0.1, 128)),
    (_two(6, 5, 0.1, 32), _two(6, 5, 0.1, 32), _one(6, 32), _two(6, 5, 0.1, 32)),
    (_one(6, 128),) * 4,
    (_one(6, 32), _one(6, 32), _one(8, 32), _one(6, 32)),
    (_one(8, 128),) * 4,
]
ATTN_KEYS = ("q_proj", "k_proj", "v_proj", "o_proj")
ATTN_OPTIONS: list[dict[str, QParams]] = [dict(zip(ATTN_KEYS, row)) for row in _A]

_D0 = qp((6, 0.05, 32), (3, 0.2, 64), (2, 0.75, 64))
_D4 = qp((8, 0.05, 32), (4, 0.1, 128), (3, 0.85, 128))
_D5 = qp((8, 0.05, 32), (4, 0.1, 32), (3, 0.85, 32))
_D6 = qp((8, 0.05, 32), (4, 0.95, 128))
# MLP (gate, up, down), 17 entries: spec §4.4.
_M = [
    (_two(3, 2, 0.05, 64), _two(3, 2, 0.05, 64), _D0),
    (_two(3, 2, 0.1, 64), _two(3, 2, 0.25, 64), _D0),
    (_two(3, 2, 0.1, 64), _two(3, 2, 0.3, 64), qp((5, 0.05, 32), (3, 0.95, 32))),
    (_two(3, 2, 0.1, 64), _two(3, 2, 0.3, 64), qp((5, 0.05, 32), (4, 0.95, 32))),
    (_two(4, 3, 0.1, 128), _two(4, 3, 0.25, 128), _D4),
    (_two(4, 3, 0.1, 32), _two(4, 3, 0.25, 32), _D5),
    (_two(4, 3, 0.1, 32), _two(4, 3, 0.25, 32), _D6),
    (_one(4, 128), _one(4, 32), _D6),
    (_one(4, 32), _one(4, 32), qp((8, 0.05, 32), (4, 0.95, 32))),
    (_two(5, 4, 0.1, 128), _two(5, 4, 0.25, 128), qp((8, 0.05, 32), (5, 0.1, 128), (4, 0.85, 128))),
    (_two(5, 4, 0.1, 32), _two(5, 4, 0.25, 32), qp((8, 0.05, 32), (5, 0.1, 32), (4, 0.85, 32))),
    (_two(6, 5, 0.1, 128), _two(6, 5, 0.25, 128), qp((8, 0.05, 32), (6, 0.1, 128), (5, 0.85, 128))),
    (_two(6, 5, 0.1, 32), _two(6, 5, 0.25, 32), qp((8, 0.05, 32), (6, 0.1, 32), (5, 0.85, 32))),
    (_one(6, 128), _one(6, 128), qp((8, 0.05, 32), (6, 0.95, 128))),
    (_two(8, 6, 0.1, 128), _two(8, 6, 0.1, 128), qp((8, 0.15, 128), (6, 0.85, 128))),
    (_two(8, 6, 0.1, 128), _two(8, 6, 0.1, 128), _one(8, 128)),
    (_one(8, 128),) * 3,
]
MLP_KEYS = ("gate_proj", "up_proj", "down_proj")
MLP_OPTIONS: list[dict[str, QParams]] = [dict(zip(MLP_KEYS, row)) for row in _M]

HEAD_OPTIONS: dict[int, QParams] = {
    2: qp((4, 0.3, 32), (2, 0.7, 32)),
    3: qp((4, 0.15, 32), (3, 0.85, 32)),
    4: qp((6, 0.15, 32), (4, 0.85, 32)),
    5: qp((6, 0.15, 128), (5, 0.85, 128)),
    6: qp((8, 0.15, 128), (6, 0.85, 128)),
    8: qp((8, 1.0, 128)),
}


def distinct(options: list[dict[str, QParams]], key: str) -> list[QParams]:
    """The distinct QParams that a slot's option list uses for one matrix, in first-seen order."""
    seen: list[QParams] = []
    for o in options:
        if o[key] not in seen:
            seen.append(o[key])
    return seen


def bpw(total_bits: float, numel: int) -> float:
    return total_bits / numel if numel else math.nan
