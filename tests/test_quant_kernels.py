"""Triton packed-matrix kernels vs the torch reference: CPU interpreter at small shapes, CUDA at real shapes."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from exlpy.kernels.exl2_matmul import exl2_matmul, exl2_matmul_ref  # noqa: E402
from exlpy.kernels.gptq_matmul import gptq_matmul, gptq_matmul_ref  # noqa: E402
from exlpy.quant.exl2_ref import build_exl2_matrix  # noqa: E402
from exlpy.quant.gptq_ref import build_gptq_matrix  # noqa: E402
from exlpy.quant.layout import QuantMatrix  # noqa: E402
from exlpy.quant.pack import quantize_gptq, random_exl2  # noqa: E402
from tests.conftest import rel_err, requires_cuda  # noqa: E402

CASES = {  # name: (K, N, groups (bits, rows))
    **{f"{b}bit": (96, 72, [(b, 32)] * 3) for b in (2, 3, 4, 5, 6, 8)},
    "mixed_all": (224, 40, [(8, 32), (6, 32), (5, 32), (4, 64), (3, 32), (2, 16), (2, 16)]),
    "partial_last_group": (116, 100, [(4, 32)] * 3 + [(4, 20)]),
    "odd_n_3bit_partial": (104, 33, [(3, 64), (3, 40)]),
    "unaligned_2bit": (96, 136, [(6, 64), (2, 16), (2, 16)]),
}


def _exl2(name: str, gen: torch.Generator, device: str = "cpu") -> QuantMatrix:
    k, n, groups = CASES[name]
    t = random_exl2(k, n, groups, gen)
    qm = build_exl2_matrix(t["q_weight"], t["q_invperm"], t["q_scale"], t["q_scale_max"], t["q_groups"], k, n, "t")
    return qm.to(device)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("m", [1, 5, 40])
def test_exl2_kernels_interpreter(name: str, m: int) -> None:
    gen = torch.Generator().manual_seed(sum(map(ord, name)) + m)
    qm = _exl2(name, gen)
    x = torch.randn(m, qm.k, generator=gen).half()
    bias = torch.randn(qm.n, generator=gen).half()
    y = exl2_matmul(x, qm, bias)
    assert y.shape == (m, qm.n) and y.dtype == torch.float16
    assert rel_err(y, exl2_matmul_ref(x.float(), qm, bias.float())) < 2e-3


@pytest.mark.parametrize("act_order,v2", [(False, False), (True, False), (False, True), (True, True)])
def test_gptq_kernels_interpreter(act_order: bool, v2: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(200, 48, generator=gen)
    t, dq = quantize_gptq(w, 64, gen, act_order, v2)
    qm = build_gptq_matrix(t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"), 200, 48, "g", v2)
    for m in (1, 6, 40):
        x = torch.randn(m, 200, generator=gen).half()
        ref = x.float() @ dq
        assert rel_err(gptq_matmul(x, qm), ref) < 2e-3
        assert rel_err(gptq_matmul_ref(x.float(), qm), ref) < 1e-5


@requires_cuda
@pytest.mark.parametrize("groups", [[(4, 128)] * 32, [(8, 128), (6, 128)] + [(5, 128)] * 2 + [(3, 128)] * 12
                                    + [(2, 128)] * 16])
@pytest.mark.parametrize("m", [1, 7, 32, 300])
def test_exl2_kernels_cuda(groups: list[tuple[int, int]], m: int) -> None:
    gen = torch.Generator().manual_seed(m)
    t = random_exl2(4096, 1000, groups, gen)
    qm = build_exl2_matrix(t["q_weight"], t["q_invperm"], t["q_scale"], t["q_scale_max"], t["q_groups"], 4096,
                           1000, "t")
    x = torch.randn(m, 4096, generator=gen).half()
    ref = exl2_matmul_ref(x.float(), qm)
    y = exl2_matmul(x.cuda(), qm.to("cuda"))
    assert rel_err(y.cpu(), ref) < 2e-3
