"""Round-to-nearest EXL2 (no calibration, no error feedback, natural row order): the baseline the converter's
quality is judged against. Same format and packer as the real conversion, so only the algorithm differs."""

from __future__ import annotations

import os

import torch

from exlpy.config.config import ExLlamaV2Config
from exlpy.convert.compile import compile_output, write_model_dir
from exlpy.convert.gptq import PreparedHessian, gptq_quantize
from exlpy.convert.job import write_tensors
from exlpy.convert.layers import is_decoder, read_bias, read_weight, shapes
from exlpy.convert.packing import check_packed, pack_exl2
from exlpy.convert.qparams import HEAD_OPTIONS, qp
from exlpy.engine import ExLlamaV2


def _plain(k: int) -> PreparedHessian:
    eye = torch.eye(k)
    return PreparedHessian(torch.arange(k), eye, torch.ones(k))


def write_rtn_model(src: str, out_dir: str, bits: int = 4, group_size: int = 128, head_bits: int = 6) -> None:
    """`bits`-bit, `group_size`-row RTN of every decoder linear; the head RTN with the -hb `head_bits` layout.
    Scales are plain: max |w| of each group and column over half the code range (no search)."""
    config = ExLlamaV2Config(src)
    model = ExLlamaV2(config)
    option = qp((bits, 1.0, group_size))
    files = []
    work = os.path.join(out_dir, ".rtn_parts")
    os.makedirs(work, exist_ok=True)
    quantized = set()
    for m in model.modules:
        if not is_decoder(m):
            continue
        tensors = {}
        for name, (k, _) in shapes(m).items():
            prefix = f"{m.key}.{name}"
            w = read_weight(config.index, f"{prefix}.weight", torch.device("cpu"))
            res = gptq_quantize([w], [option], _plain(k), rtn=True, plain_scales=True)[0]
            packed = pack_exl2(res, prefix, read_bias(config.index, prefix))
            check_packed(packed, res, prefix)
            tensors.update(packed)
            quantized.add(prefix)
        files.append(os.path.join(work, f"{m.key}.safetensors"))
        write_tensors(files[-1], tensors)
    spec = config.spec
    assert spec is not None
    name = "lm_head.weight" if "lm_head.weight" in config.index else "model.embed_tokens.weight"
    w = read_weight(config.index, name, torch.device("cpu"))
    res = gptq_quantize([w], [HEAD_OPTIONS[head_bits]], _plain(spec.hidden_size), rtn=True, plain_scales=True)[0]
    packed = pack_exl2(res, "lm_head")
    files.append(os.path.join(work, "lm_head.safetensors"))
    write_tensors(files[-1], packed)
    quantized.add("lm_head")
    compile_output(config.index, files, quantized, out_dir, 0)
    write_model_dir(src, out_dir, {"quant_method": "exl2", "bits": float(bits), "head_bits": head_bits,
                                   "calibration": "none (round-to-nearest baseline)"}, "rtn")
    for f in files:
        os.remove(f)
    os.rmdir(work)
