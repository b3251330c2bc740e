"""Helpers for the converter tests: format invariants of an EXL2 directory (spec §3), bpw from the files, logits."""

from __future__ import annotations

import json
import os

import torch

from exlpy import ExLlamaV2, ExLlamaV2Config
from exlpy.quant.exl2_ref import build_exl2_matrix
from exlpy.weights.safetensors_index import SafetensorsIndex

PARTS = ("q_weight", "q_invperm", "q_scale", "q_scale_max", "q_groups")


def check_format(model_dir: str, src_dir: str) -> float:
    """Check every spec §3 invariant of the converted directory; returns the decoder bpw by the §4.4 cost model
    computed from the stored tensors alone."""
    idx, src = SafetensorsIndex(model_dir), SafetensorsIndex(src_dir)
    files = sorted(os.path.basename(f) for f in idx.files)
    assert files == ["output.safetensors"] or all(f.startswith("output-") for f in files), files
    prefixes = sorted({n.rsplit(".", 1)[0] for n in idx.tensors if n.endswith(".q_weight")})
    bits = numel = 0
    invperms = {}
    for p in prefixes:
        t = {k: idx.get(f"{p}.{k}") for k in PARTS}
        k = t["q_invperm"].numel()
        src_name = f"{p}.weight" if f"{p}.weight" in src else "model.embed_tokens.weight"
        n = src.info(src_name).shape[0]
        qm = build_exl2_matrix(t["q_weight"], t["q_invperm"], t["q_scale"], t["q_scale_max"], t["q_groups"], k, n, p)
        lay = qm.layout
        assert list(lay.group_bits) == sorted(lay.group_bits, reverse=True), p  # widths non-increasing
        sizes = [b - a for a, b in zip(lay.group_rows[:-1], lay.group_rows[1:])]
        assert all(s % 32 == 0 for s in sizes[:-1]) and sum(sizes) == k, (p, sizes)
        assert t["q_weight"].shape[1] % 32 == 0 and t["q_weight"].shape[1] - n < 32
        assert t["q_scale_max"].dtype == torch.float16 and bool((t["q_scale_max"] > 0).all())
        assert torch.equal(torch.sort(t["q_invperm"].long()).values, torch.arange(k))
        words = sum((s * b + 31) // 32 for s, b in zip(sizes, lay.group_bits))
        assert t["q_weight"].shape[0] == words
        invperms[p] = t["q_invperm"]
        if p.startswith("model.layers."):
            g = len(sizes)
            bits += sum(s * n * b for s, b in zip(sizes, lay.group_bits)) + g * 16 + g * 32 + g * n * 4 + k * 32
            numel += k * n
        assert f"{p}.weight" not in idx
    layers = {p.rsplit(".", 1)[0] for p in prefixes if p.startswith("model.layers.")}
    for lay_key in layers:  # projections of one input share their act order
        if lay_key.endswith("self_attn"):
            assert torch.equal(invperms[f"{lay_key}.q_proj"], invperms[f"{lay_key}.k_proj"])
            assert torch.equal(invperms[f"{lay_key}.q_proj"], invperms[f"{lay_key}.v_proj"])
        else:
            assert torch.equal(invperms[f"{lay_key}.gate_proj"], invperms[f"{lay_key}.up_proj"])
    assert "lm_head.q_weight" in idx
    for name, info in idx.tensors.items():
        if ".q_" not in name:
            assert info.dtype in ("F16", "I32", "I16", "I64"), name
    with open(os.path.join(model_dir, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert qc["quant_method"] == "exl2" and qc["head_bits"] in (2, 3, 4, 5, 6, 8)
    return bits / numel


def logits(model_dir: str, ids: torch.Tensor) -> torch.Tensor:
    model = ExLlamaV2(ExLlamaV2Config(model_dir))
    model.load(device="cpu")
    out = model.forward(ids).float()
    model.unload()
    return out


def kl(ref: torch.Tensor, got: torch.Tensor) -> float:
    p, q = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


class Interrupted(Exception):
    """Raised by `assert_resumes_bit_identical`'s patched checkpoint: a conversion stopped mid-way."""


def safetensors_bytes(d: str) -> dict[str, bytes]:
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d)) if n.endswith(".safetensors")}


def assert_resumes_bit_identical(monkeypatch, src: str, work: str, out: str, reference_out: str,  # noqa: ANN001
                                 **kw) -> None:
    """A conversion of `src` stopped after its first quantized layer's checkpoint, then run again in the same `work`
    folder, writes the same bytes as the uninterrupted one in `reference_out`."""
    from exlpy.convert import convert
    from exlpy.convert import job as job_mod

    real = job_mod.Job.checkpoint
    calls = {"n": 0}

    def failing(self, stage, idx, name):  # noqa: ANN001, ANN202
        real(self, stage, idx, name)
        if stage == "quant":
            calls["n"] += 1
            if calls["n"] == 1:  # after the first layer of quantization: the rest resumes from the checkpoint
                raise Interrupted

    monkeypatch.setattr(job_mod.Job, "checkpoint", failing)
    try:
        convert(src, work, out, **kw)
    except Interrupted:
        pass
    else:
        raise AssertionError("the conversion was not interrupted")
    convert(src, work, out, **kw)
    assert calls["n"] >= 2
    assert safetensors_bytes(reference_out) == safetensors_bytes(out)
