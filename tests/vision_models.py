"""Tiny random vision-language models for the vision tests: written with transformers' own config and model
classes (and a byte-level tokenizer with the models' special tokens), saved into a directory, and the
matching Hugging Face model and image processor returned as the reference; such a model loaded in exlpy beside
its reference (`LoadedVision`), and greedy continuations of a prompt with an image through both generators."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>"]
VOCAB = 256 + len(SPECIALS)  # 256 bytes and the specials: every id a token (none masked by the sampler)
IDS = {t: 256 + i for i, t in enumerate(SPECIALS)}


CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tokenizer(path: Path, specials: list[str] | None = None, config: dict[str, Any] | None = None) -> None:
    """A byte-level BPE tokenizer without merges (one token per byte: id = byte value) plus special tokens
    (ids from 256 on; the Qwen ones by default) and its tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(_byte_chars())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials or SPECIALS)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config or {
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None, "chat_template": CHAT,
        "tokenizer_class": "PreTrainedTokenizerFast"}))


def _byte_chars() -> list[str]:
    # GPT-2's bytes_to_unicode order: the character each byte 0..255 maps to.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    order = sorted(zip(bs, cs))
    return [chr(c) for _, c in order]


def text_ids(text: str) -> list[int]:
    return list(text.encode())


def _randomize(model: Any) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight") or name.endswith("ln_q.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.05 * torch.randn_like(p))


def make_qwen_vl(path: Path, kind: str = "qwen2_vl", seed: int = 0, layers: int = 2, min_pixels: int = 56 * 56,
                 max_pixels: int = 28 * 28 * 16) -> tuple[Any, Any]:
    """(HF model fp32, HF image processor) of a tiny Qwen2-VL (kind qwen2_vl) or Qwen2.5-VL (qwen2_5_vl)."""
    import transformers as tf

    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, bos_token_id=IDS["<|endoftext|>"],
                eos_token_id=IDS["<|im_end|>"], rope_theta=10000.0)
    tokens = dict(image_token_id=IDS["<|image_pad|>"], video_token_id=IDS["<|video_pad|>"],
                  vision_start_token_id=IDS["<|vision_start|>"], vision_end_token_id=IDS["<|vision_end|>"])
    if kind == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2)
        cfg = tf.Qwen2VLConfig(text_config=text, vision_config=vision, **tokens)
        model_cls = tf.Qwen2VLForConditionalGeneration
    else:
        vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                      fullatt_block_indexes=[1])
        cfg = tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens)
        model_cls = tf.Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    _randomize(model)
    model.save_pretrained(path, safe_serialization=True)
    gen = path / "generation_config.json"
    if gen.exists():
        g = json.loads(gen.read_text())
        g.update(bos_token_id=IDS["<|endoftext|>"], eos_token_id=IDS["<|im_end|>"])
        gen.write_text(json.dumps(g))
    (path / "preprocessor_config.json").write_text(json.dumps({
        "min_pixels": min_pixels, "max_pixels": max_pixels, "patch_size": 14, "merge_size": 2,
        "temporal_patch_size": 2, "image_processor_type": "Qwen2VLImageProcessor"}))
    write_tokenizer(path)
    proc = tf.models.qwen2_vl.image_processing_pil_qwen2_vl.Qwen2VLImageProcessorPil(
        min_pixels=min_pixels, max_pixels=max_pixels)
    return model.float(), proc


def random_image(w: int, h: int, seed: int = 0, mode: str = "RGB") -> Any:
    from PIL import Image

    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4}[mode]
    return Image.fromarray(rng.integers(0, 256, (h, w, channels), dtype=np.uint8), mode)


def hf_inputs(before: str, after: str, n_image_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF input_ids [1, n] of before + <vision_start> <image_pad> x n <vision_end> + after, and mm_token_type_ids."""
    ids = text_ids(before) + [IDS["<|vision_start|>"]] + [IDS["<|image_pad|>"]] * n_image_tokens + \
        [IDS["<|vision_end|>"]] + text_ids(after)
    t = torch.tensor([ids])
    return t, (t == IDS["<|image_pad|>"]).int()


GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<image_soft_token>", "<start_of_image>", "<end_of_image>",
                  "<start_of_turn>", "<end_of_turn>"]
GEMMA_IDS = {t: 256 + i for i, t in enumerate(GEMMA_SPECIALS)}
GEMMA_TOKENIZER_CONFIG = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}


def make_gemma3(path: Path, seed: int = 0, layers: int = 3, image_size: int = 56, tokens: int = 4) -> tuple[Any, Any]:
    """(HF model fp32, HF image processor) of a tiny Gemma 3 with a SigLIP tower (layers alternate local /
    global with a window of 8, so images of `tokens` + 2 rows cross window boundaries)."""
    import transformers as tf

    vocab = 256 + len(GEMMA_SPECIALS)
    types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    cfg = tf.Gemma3Config(
        text_config=dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                         sliding_window=8, query_pre_attn_scalar=16,
                         rope_scaling={"rope_type": "linear", "factor": 8.0},
                         layer_types=types, bos_token_id=GEMMA_IDS["<bos>"], eos_token_id=GEMMA_IDS["<eos>"],
                         pad_token_id=GEMMA_IDS["<pad>"]),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=image_size, patch_size=14),
        mm_tokens_per_image=tokens, image_token_index=GEMMA_IDS["<image_soft_token>"],
        boi_token_index=GEMMA_IDS["<start_of_image>"], eoi_token_index=GEMMA_IDS["<end_of_image>"])
    torch.manual_seed(seed)
    model = tf.Gemma3ForConditionalGeneration(cfg).eval()
    _randomize(model)
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "size": {"height": image_size, "width": image_size}, "image_processor_type": "Gemma3ImageProcessor"}))
    write_tokenizer(path, GEMMA_SPECIALS, GEMMA_TOKENIZER_CONFIG)
    proc = tf.models.gemma3.image_processing_pil_gemma3.Gemma3ImageProcessorPil(
        size={"height": image_size, "width": image_size})
    return model.float(), proc


def gemma_hf_inputs(before: str, after: str, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF input_ids of before + <start_of_image> <image_soft_token> x tokens <end_of_image> + after, and
    token_type_ids (1 on image tokens)."""
    ids = text_ids(before) + [GEMMA_IDS["<start_of_image>"]] + [GEMMA_IDS["<image_soft_token>"]] * tokens + \
        [GEMMA_IDS["<end_of_image>"]] + text_ids(after)
    t = torch.tensor([ids])
    return t, (t == GEMMA_IDS["<image_soft_token>"]).long()


PIXTRAL_SPECIALS = ["<unk>", "<s>", "</s>", "[IMG]", "[IMG_BREAK]", "[IMG_END]", "[INST]", "[/INST]"]
PIXTRAL_IDS = {t: 256 + i for i, t in enumerate(PIXTRAL_SPECIALS)}


def make_mistral3(path: Path, seed: int = 0, layers: int = 2, longest_edge: int = 112) -> tuple[Any, Any]:
    """(HF model fp32, HF image processor) of a tiny Mistral 3.1 (Pixtral tower, 2x2 patch merger)."""
    import transformers as tf

    vocab = 256 + len(PIXTRAL_SPECIALS)
    cfg = tf.Mistral3Config(
        text_config=dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                         rms_norm_eps=1e-5, bos_token_id=PIXTRAL_IDS["<s>"], eos_token_id=PIXTRAL_IDS["</s>"],
                         sliding_window=None, tie_word_embeddings=False),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=longest_edge, patch_size=14, head_dim=16),
        image_token_index=PIXTRAL_IDS["[IMG]"], spatial_merge_size=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = tf.Mistral3ForConditionalGeneration(cfg).eval()
    _randomize(model)
    with torch.no_grad():  # default init (std 0.02) leaves the projected features tiny: fp32 noise would dominate
        for lin in (model.model.multi_modal_projector.linear_1, model.model.multi_modal_projector.linear_2):
            lin.weight.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "size": {"longest_edge": longest_edge}, "patch_size": {"height": 14, "width": 14},
        "image_processor_type": "PixtralImageProcessor"}))
    _pixtral_tokenizer(path)
    proc = tf.models.pixtral.image_processing_pil_pixtral.PixtralImageProcessorPil(
        size={"longest_edge": longest_edge}, patch_size={"height": 28, "width": 28})
    return model.float(), proc


def pixtral_hf_inputs(before: str, after: str, rows: int, cols: int) -> torch.Tensor:
    """HF input_ids: before + rows of [IMG] x cols each ending in [IMG_BREAK] (the last in [IMG_END]) + after."""
    image = ([PIXTRAL_IDS["[IMG]"]] * cols + [PIXTRAL_IDS["[IMG_BREAK]"]]) * rows
    image[-1] = PIXTRAL_IDS["[IMG_END]"]
    return torch.tensor([text_ids(before) + image + text_ids(after)])


def make_llava_pixtral(path: Path, seed: int = 0) -> tuple[Any, Any]:
    """(HF model fp32, HF image processor) of a tiny Pixtral-12B-style Llava (Pixtral tower, no patch merger,
    projector with biases, patch size 16)."""
    import transformers as tf

    cfg = tf.LlavaConfig(
        vision_config=tf.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=2, image_size=112, patch_size=16, head_dim=16),
        text_config=tf.MistralConfig(vocab_size=256 + len(PIXTRAL_SPECIALS), hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     bos_token_id=PIXTRAL_IDS["<s>"], eos_token_id=PIXTRAL_IDS["</s>"],
                                     sliding_window=None),
        image_token_index=PIXTRAL_IDS["[IMG]"], vision_feature_layer=-1, vision_feature_select_strategy="full",
        projector_hidden_act="gelu", multimodal_projector_bias=True)
    torch.manual_seed(seed)
    model = tf.LlavaForConditionalGeneration(cfg).eval()
    _randomize(model)
    model.save_pretrained(path, safe_serialization=True)
    (path / "preprocessor_config.json").write_text(json.dumps({"size": {"longest_edge": 112},
                                                               "patch_size": {"height": 16, "width": 16}}))
    _pixtral_tokenizer(path)
    proc = tf.models.pixtral.image_processing_pil_pixtral.PixtralImageProcessorPil(
        size={"longest_edge": 112}, patch_size={"height": 16, "width": 16})
    return model.float(), proc


def _pixtral_tokenizer(path: Path) -> None:
    write_tokenizer(path, PIXTRAL_SPECIALS, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})


class LoadedVision:
    """A model written by one of the make_* functions above, loaded in exlpy on the CPU in fp32 (against
    transformers fp32 on the CPU; GPU: test_vision_gpu.py) with its tokenizer and vision tower, beside the Hugging
    Face model and processor that make_* returned (`hf`, `proc`)."""

    def __init__(self, path: Path, hf_and_proc: tuple[Any, Any]) -> None:
        from exlpy import ExLlamaV2, ExLlamaV2Config, ExLlamaV2Tokenizer, ExLlamaV2VisionTower

        self.hf, self.proc = hf_and_proc
        self.config = ExLlamaV2Config(str(path))
        self.model = ExLlamaV2(self.config)
        self.model.load(device="cpu")
        self.tokenizer = ExLlamaV2Tokenizer(self.config)
        self.tower = ExLlamaV2VisionTower(self.config)
        self.tower.load(device="cpu")

    def embed(self, img: Any, alias: str) -> Any:
        return self.tower.get_image_embeddings(model=self.model, tokenizer=self.tokenizer, image=img, text_alias=alias)


def greedy_dynamic(gen: Any, ids: torch.Tensor, emb: Any, n: int) -> list[int]:
    """The n greedy tokens after ids (holding the image `emb`) from dynamic generator `gen`; no result may be an
    error."""
    from exlpy.generator import ExLlamaV2DynamicJob, ExLlamaV2Sampler

    job = ExLlamaV2DynamicJob(ids, max_new_tokens=n, gen_settings=ExLlamaV2Sampler.Settings.greedy(),
                              embeddings=[emb], stop_conditions=[])
    gen.enqueue(job)
    got: list[int] = []
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            assert "error" not in r, r.get("error_message")
            if r["stage"] == "streaming" and "token_ids" in r:
                got += r["token_ids"][0].tolist()
    return got


def greedy_streaming(loaded: LoadedVision, cache: Any, ids: torch.Tensor, emb: Any, n: int) -> list[int]:
    """The first n greedy tokens after ids (holding the image `emb`) from a streaming generator over `cache`."""
    from exlpy.generator import ExLlamaV2Sampler, ExLlamaV2StreamingGenerator

    stream = ExLlamaV2StreamingGenerator(loaded.model, cache, loaded.tokenizer)
    stream.set_stop_conditions([])
    stream.begin_stream_ex(ids, ExLlamaV2Sampler.Settings.greedy(), input_embeddings=[emb])
    got: list[int] = []
    while len(got) < n:
        got += stream.stream_ex()["chunk_token_ids"][0].tolist()
    return got[:n]
