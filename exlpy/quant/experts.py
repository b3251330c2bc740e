"""One projection of every expert of an MoE layer in EXL2, stacked for the grouped kernels (ExpertStack).

The experts of a layer are separate EXL2 matrices, each with its own act order, bit widths and groups (the
converter chooses them per expert). A grouped launch runs every routed expert at once, so a program must find
any expert's packed words from device memory alone. Stacking: the experts' q_weight rows are laid end to end
(one [W, Np] int32 tensor), likewise their scale rows and per-group maxima, and per expert and sorted row three
int32 tables say where that row's code is:

- `perm[e, r]`: the input feature of sorted row r (act order; x is gathered through it, no permuted copy),
- `word[e, r]`: the stacked q_weight row holding the code's first bit,
- `info[e, r]`: bit offset (bits 0-4) | width (5-8) | stacked group index (9-) of the row's scale.

The tables cost 12 bytes per expert row (0.5-1% of 4-bit weights) and make every layout, mixed widths and groups
of any height included, one code path. Everything is built once at load, on the host.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace

import torch

from exlpy.errors import QuantFormatError
from exlpy.quant.exl2_ref import build_exl2_matrix
from exlpy.quant.layout import QuantMatrix
from exlpy.weights.checks import landed
from exlpy.weights.safetensors_index import SafetensorsIndex

EXL2_PARTS = ("q_weight", "q_invperm", "q_scale", "q_scale_max", "q_groups")
MAX_GROUPS = 1 << 22  # stacked groups addressable by `info`'s 23 high bits


@dataclass
class ExpertStack:
    """The same projection (K inputs, n outputs) of E EXL2 experts; see the module docstring."""

    q_weight: torch.Tensor  # int32 [W, Np]: every expert's packed rows, expert after expert
    scales: torch.Tensor  # int32 [G, Np / 8]: 4-bit scale codes of every expert's groups
    scale_max: torch.Tensor  # fp32 [G]: per-group maxima (times prescale / 256, as QuantMatrix keeps them)
    perm: torch.Tensor  # int32 [E, K]
    word: torch.Tensor  # int32 [E, K]
    info: torch.Tensor  # int32 [E, K]
    k: int
    n: int
    dtype: torch.dtype  # the compute dtype: the reference's dense copies are kept in it
    perm_digest: str  # of `perm`'s contents: stacks with equal digests share their act order (gate and up)
    aligned: bool  # every 32-row block of sorted rows lies in one group (converter layouts: groups of 32-128 rows)
    width: int  # the bit width of every group of every expert, 0 when they differ
    _dense: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def num_experts(self) -> int:
        return self.perm.shape[0]

    @property
    def device(self) -> torch.device:
        return self.q_weight.device

    def tensors(self) -> list[torch.Tensor]:
        return [self.q_weight, self.scales, self.scale_max, self.perm, self.word, self.info]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def to(self, device: torch.device | str) -> ExpertStack:
        return replace(self, q_weight=self.q_weight.to(device), scales=self.scales.to(device),
                       scale_max=self.scale_max.to(device), perm=self.perm.to(device), word=self.word.to(device),
                       info=self.info.to(device), _dense={})

    def dequant(self, e: int) -> torch.Tensor:
        """Expert e's W [K, n] fp32 in input-feature order (y = x @ W), decoded from the stacked tables alone
        (exactly what the kernels compute; tests hold it against exl2_ref.dequant_dense of the expert)."""
        word = self.word[e].cpu().to(torch.int64)
        info = self.info[e].cpu().to(torch.int64)
        off, bits, grp = info & 31, (info >> 5) & 15, info >> 9
        w0, g0 = int(word.min()), int(grp.min())  # only this expert's packed rows and scale rows are read
        qw = self.q_weight[w0:int(word.max()) + 2].cpu().to(torch.int64) & 0xFFFFFFFF
        qw = torch.cat([qw, torch.zeros_like(qw[:1])])  # a straddler of the last word reads a zero word
        word, grp = word - w0, grp - g0
        both = qw[word] | (qw[word + 1] << 32)
        codes = (both >> off[:, None]) & ((1 << bits[:, None]) - 1)
        g1 = int(grp.max()) + g0 + 1
        nib = (self.scales[g0:g1].cpu().to(torch.int64)[grp] & 0xFFFFFFFF)[:, :, None] >> (4 * torch.arange(8))
        scale = ((nib & 15).reshape(len(grp), -1) + 1).float() ** 2 * self.scale_max[g0:g1].cpu()[grp, None]
        ws = ((codes - (1 << (bits[:, None] - 1))).float() * scale)[:, :self.n]
        w = torch.empty_like(ws)
        w[self.perm[e].cpu().long()] = ws
        return w

    def dense(self, e: int) -> torch.Tensor:
        """Expert e's W [K, n] in `dtype` on the stack's device, made once (the torch reference's weights, as
        QuantLinear keeps a dense copy on the CPU path)."""
        w = self._dense.get(e)
        if w is None:
            w = self._dense[e] = self.dequant(e).to(device=self.device, dtype=self.dtype)
        return w


def stack_exl2(mats: list[QuantMatrix], dtype: torch.dtype, name: str) -> ExpertStack:
    """Stack E experts' QuantMatrix (host tensors, all [K, n] EXL2) into one ExpertStack on the host."""
    k, n, n_pad = mats[0].k, mats[0].n, mats[0].q_weight.shape[1]
    for e, qm in enumerate(mats):
        if qm.kind != "exl2" or qm.k != k or qm.n != n or qm.q_weight.shape[1] != n_pad:
            raise QuantFormatError(f"expert {e} is {qm.kind} [{qm.k}, {qm.n}], expert 0 EXL2 [{k}, {n}]: the "
                                   "experts of a layer must share one shape", tensor=name)
    words, groups = 0, 0
    perm, word, info = [], [], []
    aligned = True
    widths: set[int] = set()
    for qm in mats:
        widths.update(qm.layout.group_bits)
        lay = qm.layout
        aligned &= all(r % 32 == 0 for r in lay.group_rows[1:-1])
        w, off = lay.row_words()
        word.append(w + words)
        info.append(off | (lay.row_bits() << 5) | ((lay.row_group() + groups) << 9))
        perm.append(qm.perm.to(torch.int64) if qm.perm is not None else torch.arange(k))
        words += qm.q_weight.shape[0]
        groups += lay.num_groups
    if groups >= MAX_GROUPS or words * n_pad >= 2**62:
        raise QuantFormatError(f"{groups} groups in {words} packed rows: too many to stack", tensor=name)
    smax = torch.cat([qm.scale_max.float() for qm in mats])  # type: ignore[union-attr]
    perms = torch.stack(perm).to(torch.int32)
    digest = hashlib.sha256(perms.numpy().tobytes()).hexdigest()
    return ExpertStack(torch.cat([qm.q_weight for qm in mats]), torch.cat([qm.scales for qm in mats]), smax, perms,
                       torch.stack(word).to(torch.int32), torch.stack(info).to(torch.int32), k, n, dtype, digest,
                       aligned, widths.pop() if len(widths) == 1 else 0)


def read_exl2_matrix(index: SafetensorsIndex, prefix: str, k: int, n: int, prescale: float = 1.0) -> QuantMatrix:
    """One EXL2 linear's tensors, validated (exl2_ref.build_exl2_matrix), as a host QuantMatrix."""
    for part in EXL2_PARTS:
        if f"{prefix}.{part}" not in index:
            raise QuantFormatError("EXL2 tensor missing", tensor=f"{prefix}.{part}", file=index.model_dir)
    t = {p: index.get(f"{prefix}.{p}") for p in EXL2_PARTS}
    qm = build_exl2_matrix(t["q_weight"], t["q_invperm"], t["q_scale"], t["q_scale_max"], t["q_groups"], k, n,
                           prefix, prescale=prescale)
    landed(index, f"{prefix}.q_scale_max", qm.scale_max)  # a NaN scale makes a whole group of weights NaN
    return qm


def load_exl2_experts(index: SafetensorsIndex, prefixes: list[str], proj: str, k: int, n: int,
                      device: torch.device, dtype: torch.dtype, prescale: float = 1.0) -> ExpertStack:
    """Projection `proj` of the experts under `prefixes`, read, validated, stacked on the host and moved to
    `device` once (the device holds the stack, never a second copy of the experts)."""
    mats = [read_exl2_matrix(index, f"{p}.{proj}", k, n, prescale) for p in prefixes]
    return stack_exl2(mats, dtype, f"{prefixes[0]}.{proj}").to(device)
