"""Gemma 3: image preprocessing as transformers' Gemma3ImageProcessor, the SigLIP vision tower and the
multimodal projector.

Preprocessing: resize to image_size x image_size (bilinear, through PIL as the processor does; no pan and
scan), rescale to [0, 1], normalize with mean / std 0.5. Tower: SigLIP (a Conv2d patch embedding whose stride
equals its kernel, i.e. one linear map per patch, plus learned positions; pre-norm LayerNorm blocks of
bidirectional attention and a tanh-GELU MLP; a final LayerNorm). Projector: average pooling of the patch grid
down to mm_tokens_per_image tokens, Gemma's RMSNorm (weight + 1) and one projection to the language model's width.
In the language model the tokens of one image attend to each other in both directions (exlpy/vision/mm.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from exlpy.errors import ConfigError
from exlpy.vision.layers import act_fn, plan_segments, segment_attention
from exlpy.vision.pixels import normalize, resized_pixels
from exlpy.vision.timing import mark


@dataclass(frozen=True)
class SiglipSpec:
    depth: int
    width: int
    num_heads: int
    mlp_dim: int
    act: str
    eps: float
    image_size: int
    patch_size: int
    channels: int
    tokens: int  # mm_tokens_per_image
    out_dim: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale: float
    boi: int | None
    eoi: int | None
    merge_size: int = 1  # no merging: the grid of embedding rows is the pooled grid

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    @property
    def side(self) -> int:
        return self.image_size // self.patch_size


def _int(d: dict[str, Any], key: str, default: int, where: str) -> int:
    v = d.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1 or v > 1 << 20:
        raise ConfigError(f"{where}: {key} must be a positive integer, got {v!r:.60}")
    return v


def parse_spec(cfg: dict[str, Any], pre: dict[str, Any], out_dim: int, where: str) -> SiglipSpec:
    v = cfg.get("vision_config")
    if not isinstance(v, dict):
        raise ConfigError(f"{where}: 'vision_config' is missing or not an object")
    width, heads = _int(v, "hidden_size", 1152, where), _int(v, "num_attention_heads", 16, where)
    image, patch = _int(v, "image_size", 896, where), _int(v, "patch_size", 14, where)
    tokens = _int(cfg, "mm_tokens_per_image", 256, where)
    side = image // patch
    per_side = math.isqrt(tokens)
    if width % heads or image % patch or per_side * per_side != tokens or side % per_side:
        raise ConfigError(f"{where}: vision_config image_size {image} / patch_size {patch} / hidden_size {width} / "
                          f"num_attention_heads {heads} and mm_tokens_per_image {tokens} do not fit together "
                          "(a square patch grid pooled to a square token grid)")
    size = pre.get("size") if isinstance(pre.get("size"), dict) else {}
    if size and (size.get("height"), size.get("width")) != (image, image):
        raise ConfigError(f"{where}: preprocessor_config.json size {size} differs from the tower's image_size {image}")
    if pre.get("do_pan_and_scan"):
        raise ConfigError(f"{where}: preprocessor_config.json do_pan_and_scan (image crops) is not supported")
    return SiglipSpec(
        depth=_int(v, "num_hidden_layers", 27, where), width=width, num_heads=heads,
        mlp_dim=_int(v, "intermediate_size", 4304, where), act=v.get("hidden_act", "gelu_pytorch_tanh"),
        eps=float(v.get("layer_norm_eps", 1e-6)), image_size=image, patch_size=patch,
        channels=_int(v, "num_channels", 3, where), tokens=tokens, out_dim=out_dim,
        image_mean=tuple(pre.get("image_mean", (0.5, 0.5, 0.5))),
        image_std=tuple(pre.get("image_std", (0.5, 0.5, 0.5))),
        rescale=float(pre.get("rescale_factor", 1 / 255)), boi=cfg.get("boi_token_index"),
        eoi=cfg.get("eoi_token_index"))


def preprocess(spec: SiglipSpec, image: Any, device: torch.device | None = None, array: Any = None
               ) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """(pixel values [C, S, S] fp32 on `device` (None: the CPU), the pooled token grid (1, h, w)) of an RGB PIL
    image (`array`: its pixels, if taken out already): resized by PIL (bilinear), uploaded as uint8, normalized
    there."""
    s = spec.image_size
    x = normalize(resized_pixels(image, s, s, "bilinear", device, array), spec.rescale, spec.image_mean,
                  spec.image_std)
    per_side = math.isqrt(spec.tokens)
    return x, (1, per_side, per_side)


class SiglipTower:
    """SigLIP encoder + Gemma 3's projector."""

    def __init__(self, spec: SiglipSpec) -> None:
        self.spec = spec
        self.w: dict[str, torch.Tensor] = {}
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.act = act_fn(spec.act, "vision_config.hidden_act")

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        s = self.spec
        e = s.width
        shapes: dict[str, tuple[int, ...]] = {
            "vision_tower.embeddings.patch_embedding.weight": (e, s.channels, s.patch_size, s.patch_size),
            "vision_tower.embeddings.patch_embedding.bias": (e,),
            "vision_tower.embeddings.position_embedding.weight": (s.side * s.side, e),
            "vision_tower.post_layernorm.weight": (e,), "vision_tower.post_layernorm.bias": (e,),
            "multi_modal_projector.mm_soft_emb_norm.weight": (e,),
            "multi_modal_projector.mm_input_projection_weight": (e, s.out_dim),
        }
        for i in range(s.depth):
            b = f"vision_tower.encoder.layers.{i}"
            for n in ("layer_norm1", "layer_norm2"):
                shapes[f"{b}.{n}.weight"] = shapes[f"{b}.{n}.bias"] = (e,)
            for n in ("q_proj", "k_proj", "v_proj", "out_proj"):
                shapes[f"{b}.self_attn.{n}.weight"], shapes[f"{b}.self_attn.{n}.bias"] = (e, e), (e,)
            shapes.update({f"{b}.mlp.fc1.weight": (s.mlp_dim, e), f"{b}.mlp.fc1.bias": (s.mlp_dim,),
                           f"{b}.mlp.fc2.weight": (e, s.mlp_dim), f"{b}.mlp.fc2.bias": (e,)})
        return shapes

    def load(self, read: Any, device: torch.device, dtype: torch.dtype) -> None:
        self.w = {n: read(n, shape).to(device=device, dtype=dtype) for n, shape in self.tensor_shapes().items()}
        name = "vision_tower.embeddings.patch_embedding.weight"
        self.w[name] = self.w[name].reshape(self.spec.width, -1)
        for i in range(self.spec.depth):  # q|k|v as one projection: one GEMM launch per block instead of three
            a = f"vision_tower.encoder.layers.{i}.self_attn"
            for kind in ("weight", "bias"):
                parts = [self.w.pop(f"{a}.{m}.{kind}") for m in ("q_proj", "k_proj", "v_proj")]
                self.w[f"{a}.qkv.{kind}"] = torch.cat(parts)
        self.device, self.dtype = device, dtype

    def unload(self) -> None:
        self.w = {}

    def _lin(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[f"{name}.weight"], self.w.get(f"{name}.bias"))

    def _ln(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.w[f"{name}.weight"], self.w[f"{name}.bias"], self.spec.eps)

    def forward(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """Projected image tokens [mm_tokens_per_image, out_dim] of pixel values [C, S, S]."""
        s = self.spec
        p, g, e = s.patch_size, s.side, s.width
        x = pixels.to(device=self.device, dtype=self.dtype)
        patches = x.reshape(s.channels, g, p, g, p).permute(1, 3, 0, 2, 4).reshape(g * g, -1)  # row-major patches
        h = self._lin(patches, "vision_tower.embeddings.patch_embedding")
        h = h + self.w["vision_tower.embeddings.position_embedding.weight"]
        n = h.shape[0]
        whole = plan_segments([0, n], h.device)  # every patch sees every patch; planned once, not per block
        mark("tower: patch embed")
        for i in range(s.depth):
            b = f"vision_tower.encoder.layers.{i}"
            a = self._ln(h, f"{b}.layer_norm1")
            q, k, v = self._lin(a, f"{b}.self_attn.qkv").view(n, 3, s.num_heads, s.head_dim).unbind(1)
            o = segment_attention(q, k, v, whole, s.head_dim ** -0.5).reshape(n, e)
            h = h + self._lin(o, f"{b}.self_attn.out_proj")
            mark("tower: attention")
            h = h + self._lin(self.act(self._lin(self._ln(h, f"{b}.layer_norm2"), f"{b}.mlp.fc1")), f"{b}.mlp.fc2")
            mark("tower: mlp")
        h = self._ln(h, "vision_tower.post_layernorm")
        per_side = math.isqrt(s.tokens)
        k = g // per_side
        pooled = F.avg_pool2d(h.t().reshape(1, e, g, g), kernel_size=k, stride=k).flatten(2)[0].t()  # [tokens, e]
        xf = pooled.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + s.eps)
        normed = (xf * (1.0 + self.w["multi_modal_projector.mm_soft_emb_norm.weight"].float())).to(pooled.dtype)
        out = torch.matmul(normed, self.w["multi_modal_projector.mm_input_projection_weight"])
        mark("tower: merger")
        return out

    def postprocess(self, features: torch.Tensor, text_rows: Any) -> tuple[torch.Tensor, int, int]:
        """<start_of_image> + image tokens + <end_of_image> (exllamav2's layout)."""
        s = self.spec
        if s.boi is None or s.eoi is None:
            return features, 0, 0
        ends = text_rows([s.boi, s.eoi]).to(features)
        return torch.cat([ends[:1], features, ends[1:]]), 1, 1
