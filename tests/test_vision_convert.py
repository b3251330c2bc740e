"""EXL2 conversion of a vision-language model (CPU): the language model is quantized, the vision tower and
its merger are written unchanged in fp16, and the converted model reads images as the source does."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from tests.conftest import rel_err
from tests.convert_util import kl
from tests.vision_models import VOCAB, make_qwen_vl, random_image

pytest.importorskip("PIL")


def test_qwen25_vl_converts_with_fp16_tower(tmp_path: Path) -> None:
    from safetensors import safe_open

    from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Tokenizer, ExLlamaV2VisionTower
    from exlpy.convert import convert
    from exlpy.generator import ExLlamaV2DynamicGenerator, ExLlamaV2Sampler

    src, out = tmp_path / "src", tmp_path / "q"
    hf, _ = make_qwen_vl(src, "qwen2_5_vl", layers=1)
    g = torch.Generator().manual_seed(5)
    cal = tmp_path / "c.jsonl"
    cal.write_text("\n".join(json.dumps({"input_ids": torch.randint(0, 256, (32,), generator=g).tolist()})
                             for _ in range(4)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        convert(str(src), str(tmp_path / "w"), str(out), bits=6.0, cal_dataset=str(cal), rows=2, length=32,
                measurement_rows=2, measurement_length=32, progress=False)
    assert (out / "preprocessor_config.json").exists()
    source = dict(hf.state_dict())
    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as f:
        tower = {k: f.get_tensor(k) for k in f.keys() if k.startswith("visual.")}
        assert any(k.endswith(".q_weight") for k in f.keys())  # the language model is quantized
    assert len(tower) == sum(k.startswith("model.visual.") for k in source) > 0
    for k, t in tower.items():
        assert t.dtype == torch.float16 and torch.equal(t, source["model." + k].half()), k

    config = ExLlamaV2Config(str(out))
    model = ExLlamaV2(config)
    model.load()
    tok = ExLlamaV2Tokenizer(config)
    vt = ExLlamaV2VisionTower(config)
    vt.load()
    ref = ExLlamaV2VisionTower(ExLlamaV2Config(str(src)))
    ref.load()
    img = random_image(90, 60, seed=2)
    px, grid = vt.preprocess(img)
    assert rel_err(vt.image_features(px, grid), ref.image_features(px, grid)) < 2e-3  # fp16-stored weights
    emb = vt.get_image_embeddings(model=model, tokenizer=tok, image=img, text_alias="<i>")
    # the quantized language model with the image stays close to the source model with the same image
    src_model = ExLlamaV2(ref.config)
    src_model.load()
    src_emb = ref.get_image_embeddings(model=src_model, tokenizer=tok, image=img, text_alias="<i>")
    ids = tok.encode("<i> what is this?", embeddings=[emb])
    src_ids = tok.encode("<i> what is this?", embeddings=[src_emb])  # other rows (fp32 tower): other ids
    assert src_emb.get_ids() != emb.get_ids() and src_ids.shape == ids.shape
    assert kl(src_model.forward(src_ids, indexed_embeddings=[src_emb]),
              model.forward(ids, indexed_embeddings=[emb])) < 2e-3
    gen = ExLlamaV2DynamicGenerator(model, ExLlamaV2Cache(model, max_seq_len=256), tok)
    out_text = gen.generate("<i> what?", 4, gen_settings=ExLlamaV2Sampler.Settings.greedy(), embeddings=[emb],
                            completion_only=True, stop_conditions=[])
    assert isinstance(out_text, str) and VOCAB > 256
