"""Pixtral / Mistral 3.1: image preprocessing as transformers' PixtralImageProcessor, the Pixtral vision tower
and the multimodal projector of Mistral3ForConditionalGeneration (LlavaForConditionalGeneration for Pixtral-12B).

Preprocessing: scale down (never up) so the longer side fits `longest_edge`, round each side up to a multiple of
patch_size x spatial_merge_size (bicubic, through PIL), rescale, CLIP normalization. Tower: a Conv2d patch
embedding without bias (one linear map per patch), RMSNorm, blocks of RMSNorm -> attention with 2D RoPE (even
frequencies rotated by the patch row, odd ones by the column) -> RMSNorm -> gated MLP (config's hidden_act); the
last block's output is the feature. Projector: Mistral 3.1 normalizes (RMSNorm), merges each 2x2 block of
patches with one linear map (the patch merger), then linear -> GELU -> linear; Pixtral-12B has only the last
three (with biases). The image's rows in the prompt follow the processor's layout: each row of image tokens ends
with [IMG_BREAK], the last one with [IMG_END].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from exlpy.errors import ConfigError, MultimodalError
from exlpy.vision.layers import act_fn, rms_norm, rope_fp32, segment_attention
from exlpy.vision.qwen2 import CLIP_MEAN, CLIP_STD


@dataclass(frozen=True)
class PixtralSpec:
    depth: int
    width: int
    num_heads: int
    head_dim: int
    mlp_dim: int
    act: str
    patch_size: int
    channels: int
    rope_theta: float
    merge: int  # spatial_merge_size (Mistral 3.1: 2, Pixtral-12B: 1)
    merger: bool  # Mistral 3.1's norm + patch merger
    proj_bias: bool
    proj_act: str
    norm_eps: float  # the projector norm's (the language model's rms_norm_eps)
    out_dim: int
    longest_edge: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale: float
    merge_size: int = 1  # the embedding rows are already the merged grid (tower.py's metadata)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge


def _int(d: dict[str, Any], key: str, default: int, where: str) -> int:
    v = d.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1 or v > 1 << 20:
        raise ConfigError(f"{where}: {key} must be a positive integer, got {v!r:.60}")
    return v


def parse_spec(cfg: dict[str, Any], pre: dict[str, Any], out_dim: int, norm_eps: float, mistral3: bool, where: str
               ) -> PixtralSpec:
    v = cfg.get("vision_config")
    if not isinstance(v, dict) or v.get("model_type", "pixtral") != "pixtral":
        raise ConfigError(f"{where}: only Pixtral vision towers are supported in {cfg.get('architectures')}")
    layer = cfg.get("vision_feature_layer", -1)
    if layer != -1:
        raise ConfigError(f"{where}: vision_feature_layer {layer!r} is not supported (only -1, the last layer)")
    width, heads = _int(v, "hidden_size", 1024, where), _int(v, "num_attention_heads", 16, where)
    head_dim = _int(v, "head_dim", width // heads, where)
    if head_dim * heads != width or head_dim % 4:
        raise ConfigError(f"{where}: vision head_dim {head_dim} x {heads} heads must equal hidden_size {width}, "
                          "with head_dim divisible by 4 (2D RoPE)")
    rp = v.get("rope_parameters") or {}
    theta = float(rp.get("rope_theta", v.get("rope_theta", 10000.0))) if isinstance(rp, dict) else 10000.0
    size = pre.get("size") if isinstance(pre.get("size"), dict) else {}
    return PixtralSpec(
        depth=_int(v, "num_hidden_layers", 24, where), width=width, num_heads=heads, head_dim=head_dim,
        mlp_dim=_int(v, "intermediate_size", 4096, where), act=v.get("hidden_act", "gelu"),
        patch_size=_int(v, "patch_size", 16, where),
        channels=_int(v, "num_channels", 3, where), rope_theta=theta,
        merge=_int(cfg, "spatial_merge_size", 2, where) if mistral3 else 1, merger=mistral3,
        proj_bias=bool(cfg.get("multimodal_projector_bias", not mistral3)),
        proj_act=cfg.get("projector_hidden_act", "gelu"), norm_eps=norm_eps, out_dim=out_dim,
        longest_edge=_int(size, "longest_edge", 1540 if mistral3 else 1024, where),
        image_mean=tuple(pre.get("image_mean", CLIP_MEAN)), image_std=tuple(pre.get("image_std", CLIP_STD)),
        rescale=float(pre.get("rescale_factor", 1 / 255)))


def preprocess(spec: PixtralSpec, image: Any) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """(pixel values [C, H, W] fp32, the merged token grid (1, rows, columns)) of an RGB PIL image."""
    from PIL import Image

    h, w = image.height, image.width
    ratio = max(h / spec.longest_edge, w / spec.longest_edge)
    if ratio > 1:
        h, w = int(np.floor(h / ratio)), int(np.floor(w / ratio))
    f = spec.factor
    h, w = ((h - 1) // f + 1) * f, ((w - 1) // f + 1) * f
    if (w, h) != (image.width, image.height):
        image = image.resize((w, h), resample=Image.BICUBIC)
    a = np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)
    x = (a.astype(np.float64) * spec.rescale).astype(np.float32)
    x = (x - np.asarray(spec.image_mean, dtype=np.float32).reshape(-1, 1, 1)) / \
        np.asarray(spec.image_std, dtype=np.float32).reshape(-1, 1, 1)
    return torch.from_numpy(np.ascontiguousarray(x)), (1, h // f, w // f)


class PixtralTower:
    def __init__(self, spec: PixtralSpec) -> None:
        self.spec = spec
        self.w: dict[str, torch.Tensor] = {}
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.proj_act = act_fn(spec.proj_act, "projector_hidden_act")
        self.act = act_fn(spec.act, "vision_config.hidden_act")

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        s = self.spec
        e, p = s.width, s.patch_size
        shapes: dict[str, tuple[int, ...]] = {"vision_tower.patch_conv.weight": (e, s.channels, p, p),
                                              "vision_tower.ln_pre.weight": (e,)}
        for i in range(s.depth):
            b = f"vision_tower.transformer.layers.{i}"
            shapes.update({f"{b}.attention_norm.weight": (e,), f"{b}.ffn_norm.weight": (e,)})
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                shapes[f"{b}.attention.{n}.weight"] = (e, e)
            shapes.update({f"{b}.feed_forward.gate_proj.weight": (s.mlp_dim, e),
                           f"{b}.feed_forward.up_proj.weight": (s.mlp_dim, e),
                           f"{b}.feed_forward.down_proj.weight": (e, s.mlp_dim)})
        pr = "multi_modal_projector"
        if s.merger:
            shapes.update({f"{pr}.norm.weight": (e,), f"{pr}.patch_merger.merging_layer.weight": (e, e * s.merge ** 2)})
        shapes.update({f"{pr}.linear_1.weight": (s.out_dim, e), f"{pr}.linear_2.weight": (s.out_dim, s.out_dim)})
        if s.proj_bias:
            shapes.update({f"{pr}.linear_1.bias": (s.out_dim,), f"{pr}.linear_2.bias": (s.out_dim,)})
        return shapes

    def load(self, read: Any, device: torch.device, dtype: torch.dtype) -> None:
        self.w = {n: read(n, shape).to(device=device, dtype=dtype) for n, shape in self.tensor_shapes().items()}
        self.w["vision_tower.patch_conv.weight"] = self.w["vision_tower.patch_conv.weight"].reshape(self.spec.width, -1)
        self.device, self.dtype = device, dtype

    def unload(self) -> None:
        self.w = {}

    def _lin(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[f"{name}.weight"], self.w.get(f"{name}.bias"))

    def _rope(self, gh: int, gw: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec
        inv = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.float) / s.head_dim))
        hp, wp = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
        half = torch.cat([hp.reshape(-1, 1).float() * inv[0::2], wp.reshape(-1, 1).float() * inv[1::2]], dim=-1)
        emb = torch.cat([half, half], dim=-1)
        return emb.cos().to(self.device), emb.sin().to(self.device)

    def forward(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """Projected image features [rows * columns, out_dim] of pixel values [C, H, W]."""
        s = self.spec
        p, e = s.patch_size, s.width
        x = pixels.to(device=self.device, dtype=self.dtype)
        gh, gw = x.shape[1] // p, x.shape[2] // p
        patches = x.reshape(s.channels, gh, p, gw, p).permute(1, 3, 0, 2, 4).reshape(gh * gw, -1)
        h = rms_norm(F.linear(patches, self.w["vision_tower.patch_conv.weight"]), self.w["vision_tower.ln_pre.weight"],
                     1e-5)
        n = h.shape[0]
        cos, sin = self._rope(gh, gw)
        for i in range(s.depth):
            b = f"vision_tower.transformer.layers.{i}"
            a = rms_norm(h, self.w[f"{b}.attention_norm.weight"], 1e-5)
            q, k, v = (self._lin(a, f"{b}.attention.{m}").view(n, s.num_heads, s.head_dim)
                       for m in ("q_proj", "k_proj", "v_proj"))
            q, k = rope_fp32(q, cos, sin), rope_fp32(k, cos, sin)
            o = segment_attention(q, k, v, [0, n], s.head_dim ** -0.5).reshape(n, e)
            h = h + self._lin(o, f"{b}.attention.o_proj")
            a = rms_norm(h, self.w[f"{b}.ffn_norm.weight"], 1e-5)
            h = h + self._lin(self.act(self._lin(a, f"{b}.feed_forward.gate_proj")) *
                              self._lin(a, f"{b}.feed_forward.up_proj"), f"{b}.feed_forward.down_proj")
        pr = "multi_modal_projector"
        if s.merger:
            h = rms_norm(h, self.w[f"{pr}.norm.weight"], s.norm_eps)
            m = s.merge
            blocks = F.unfold(h.view(gh, gw, e).permute(2, 0, 1).unsqueeze(0), kernel_size=m, stride=m)
            h = F.linear(blocks.view(e * m * m, -1).t(), self.w[f"{pr}.patch_merger.merging_layer.weight"])
        return self._lin(self.proj_act(self._lin(h, f"{pr}.linear_1")), f"{pr}.linear_2")

    def postprocess(self, features: torch.Tensor, text_rows: Any, grid: tuple[int, int, int], tokenizer: Any
                    ) -> tuple[torch.Tensor, int, int]:
        """Rows of the image in the processor's layout: each row of tokens, then [IMG_BREAK] ([IMG_END] last)."""
        ids = []
        for name in ("[IMG_BREAK]", "[IMG_END]"):
            i = tokenizer.single_id(name) if tokenizer is not None else None
            if i is None:
                raise MultimodalError(f"the tokenizer has no {name} token, which Pixtral images need")
            ids.append(i)
        ends = text_rows(ids).to(features)
        _, rows, cols = grid
        grid_rows = features.view(rows, cols, -1)
        breaks = ends[0].expand(rows, 1, -1).clone()
        breaks[-1, 0] = ends[1]
        return torch.cat([grid_rows, breaks], dim=1).reshape(rows * (cols + 1), -1), 0, 0
