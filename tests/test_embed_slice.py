"""The vocabulary-parallel embedding lookup of one TP GPU (kernels/embed_slice.py) against its reference, and
the reference against the plain table lookup it stands for (the slices' sum over GPUs is the full lookup)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from exlpy.kernels import reference
from tests.conftest import requires_cuda

CASES = [((2, 5), 40, 0, 17, 48), ((1, 1), 40, 17, 40, 64), ((3, 4), 50, 10, 10, 33), ((2, 3), 30, 25, 30, 300)]


def test_slices_sum_to_the_table_lookup() -> None:
    g = torch.Generator().manual_seed(0)
    table = torch.randn(37, 24, generator=g)
    ids = torch.randint(0, 37, (3, 7), generator=g)
    bounds = [0, 10, 10, 29, 37]  # one slot with no rows
    parts = [reference.embed_slice(ids, table[a:b], a) for a, b in zip(bounds, bounds[1:])]
    torch.testing.assert_close(sum(parts), F.embedding(ids, table), atol=0, rtol=0)


def _case(shape: tuple[int, int], vocab: int, a: int, b: int, hidden: int, dtype: torch.dtype, device: str
          ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(vocab + a + hidden)
    table = torch.randn(vocab, hidden, generator=g).to(dtype)
    ids = torch.randint(0, vocab, shape, generator=g)
    return ids.to(device), table[a:b].to(device)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape,vocab,a,b,hidden", CASES)
def test_kernel_equals_reference_interpreted(shape: tuple[int, int], vocab: int, a: int, b: int, hidden: int,
                                             dtype: torch.dtype) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need TRITON_INTERPRET=1 before triton is imported")
    pytest.importorskip("triton")
    from exlpy.kernels.embed_slice import embed_slice

    ids, w = _case(shape, vocab, a, b, hidden, dtype, "cpu")
    assert torch.equal(embed_slice(ids, w, a), reference.embed_slice(ids, w, a))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("shape,vocab,a,b,hidden", CASES + [((1, 1), 32000, 16000, 32000, 8192)])
def test_kernel_equals_reference_cuda(shape: tuple[int, int], vocab: int, a: int, b: int, hidden: int) -> None:
    from exlpy.kernels.embed_slice import embed_slice

    ids, w = _case(shape, vocab, a, b, hidden, torch.float16, "cuda")
    assert torch.equal(embed_slice(ids, w, a), reference.embed_slice(ids, w, a))
