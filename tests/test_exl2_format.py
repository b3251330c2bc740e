"""EXL2 loading: exact dequantization of every converter-written linear, and typed errors for bad tensors."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from exlpy.errors import QuantFormatError
from exlpy.quant.exl2_ref import build_exl2_matrix, dequant_sorted
from exlpy.quant.pack import random_exl2
from tests.conftest import rel_err, shared_path

DIRS = ["tiny-llama-exl2-2.5", "tiny-llama-exl2-4.0", "tiny-llama-exl2-6.0", "tiny-llama-exl2-8.0",
        "smollm2-135m-exl2-4.0"]
PARTS = ("q_weight", "q_invperm", "q_scale", "q_scale_max", "q_groups")


@pytest.mark.parametrize("name", DIRS)
def test_dequant_matches_reference(name: str) -> None:
    d = shared_path("models", name)
    f = safe_open(str(d / "output.safetensors"), "pt")
    ref = safe_open(str(d / "reference.safetensors"), "pt")
    keys = [k for k in ref.keys() if k.startswith("dq.")]
    assert keys
    seen_bits: set[int] = set()
    for key in keys:
        prefix = key[3:]
        want = ref.get_tensor(key)  # [K, N_padded], y = x @ W
        k, n_pad = want.shape
        qm = build_exl2_matrix(*(f.get_tensor(f"{prefix}.{p}") for p in PARTS), k, n_pad, prefix)
        seen_bits |= set(qm.layout.group_bits)
        w = torch.empty(k, n_pad)
        w[qm.perm.long()] = dequant_sorted(qm)
        assert rel_err(w, want) <= 1e-3, prefix
    assert seen_bits


def _tensors(groups: list[tuple[int, int]], k: int = 128, n: int = 64) -> dict[str, torch.Tensor]:
    return random_exl2(k, n, groups, torch.Generator().manual_seed(1))


def _build(t: dict[str, torch.Tensor], k: int = 128, n: int = 64) -> None:
    build_exl2_matrix(t["q_weight"], t["q_invperm"], t["q_scale"], t["q_scale_max"], t["q_groups"], k, n, "L")


def test_valid_mixed_layout_builds() -> None:
    _build(_tensors([(8, 32), (4, 64), (2, 32)]))


def test_rows_not_summing_to_k() -> None:
    t = _tensors([(4, 64), (4, 64)])
    with pytest.raises(QuantFormatError, match=r"L\.q_groups.*|K = 160"):
        _build(t, k=160)
    with pytest.raises(QuantFormatError, match="q_groups"):
        t2 = dict(t, q_weight=t["q_weight"][:-1])  # last group short of rows
        _build(t2)


def test_invperm_not_a_permutation() -> None:
    t = _tensors([(4, 128)])
    inv = t["q_invperm"].clone()
    inv[0] = inv[1]
    with pytest.raises(QuantFormatError, match=r"not a permutation.*L\.q_invperm"):
        _build(dict(t, q_invperm=inv))


def test_packed_sizes_mismatch() -> None:
    t = _tensors([(4, 128)])
    with pytest.raises(QuantFormatError, match=r"L\.q_scale"):
        _build(dict(t, q_scale=t["q_scale"][:, :4]))
    with pytest.raises(QuantFormatError, match=r"L\.q_weight"):
        _build(dict(t, q_weight=t["q_weight"][:, :16]))
    with pytest.raises(QuantFormatError, match=r"L\.q_scale_max"):
        _build(dict(t, q_scale_max=torch.ones(3, dtype=torch.float16)))


@pytest.mark.parametrize("bits", [1, 7, 16])
def test_bad_bit_width(bits: int) -> None:
    t = _tensors([(4, 128)])
    qg = t["q_groups"].clone()
    qg[0] = bits
    with pytest.raises(QuantFormatError, match=rf"bit width {bits}.*L\.q_groups"):
        _build(dict(t, q_groups=qg))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_random_words_are_what_pack_stream_writes_for_their_codes(bits: int) -> None:
    """pack.random_words (the GPU tests' fast Mixtral-shaped experts) draws words instead of codes: read back as a
    bit stream, its codes pack to the same words, unused high bits of the last word zero as pack_stream leaves them."""
    from exlpy.quant.pack import pack_stream, random_words

    g = torch.Generator().manual_seed(bits)
    rows = 37  # 37 * bits is not a multiple of 32 for any of these widths but 8 (and 8: whole words)
    words = random_words(rows, bits, 64, g)
    w64 = torch.cat([words.to(torch.int64) & 0xFFFFFFFF, torch.zeros(1, 64, dtype=torch.int64)])
    bit = torch.arange(rows) * bits
    both = w64[bit // 32] | (w64[bit // 32 + 1] << 32)
    codes = (both >> (bit % 32)[:, None]) & ((1 << bits) - 1)
    assert torch.equal(pack_stream(codes, bits), words)
    assert len(set(codes.flatten().tolist())) == 2**bits  # every code drawn: the words are not degenerate
