"""Qwen2-VL and Qwen2.5-VL: image preprocessing as transformers' Qwen2VLImageProcessor, and the vision tower.

Preprocessing: `smart_resize` to sides that are multiples of patch_size x merge_size with the pixel count
inside [min_pixels, max_pixels] (bicubic, through PIL as the processor does), rescale to [0, 1], normalize
with the CLIP mean / std, and cut into patches of temporal_patch_size x patch_size x patch_size (an image is
its own frame repeated), ordered by merge block.

Tower: the Conv3d patch embedding, whose stride equals its kernel, is one linear map of each flattened patch;
blocks of pre-norm attention (2D RoPE: half of each head's frequencies rotated by the patch row, half by the
column) and MLP; Qwen2-VL: LayerNorm, quick-GELU MLP, full attention per image; Qwen2.5-VL: RMSNorm, gated
SiLU MLP, and attention within windows of window_size pixels except in `fullatt_block_indexes` (the patches
are put in window order once, as transformers does, and back after the merger). The patch merger
concatenates each merge_size x merge_size block of patches and projects them to the language model's width.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from exlpy.errors import ConfigError, ImageError
from exlpy.kernels import ops
from exlpy.vision.layers import Segments, act_fn, plan_segments, rms_norm, segment_attention
from exlpy.vision.pixels import normalize, resized_pixels
from exlpy.vision.timing import mark
from exlpy.vision.transfer import upload

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class QwenVisionSpec:
    kind: str  # qwen2_vl | qwen2_5_vl
    depth: int
    embed_dim: int
    num_heads: int
    mlp_dim: int
    out_dim: int  # the language model's hidden size
    act: str
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    in_channels: int
    rope_theta: float
    window_size: int  # Qwen2.5-VL (pixels); 0 for Qwen2-VL
    fullatt_blocks: tuple[int, ...]
    tokens_per_second: float  # Qwen2.5-VL video: M-RoPE time steps per second of video
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale: float
    vision_start: int | None
    vision_end: int | None
    image_token: int | None

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads


def _int(d: dict[str, Any], key: str, default: Any, where: str) -> int:
    v = d.get(key, default)
    if isinstance(v, list) and v and all(x == v[0] for x in v):  # patch sizes given per axis
        v = v[0]
    if not isinstance(v, int) or isinstance(v, bool) or v < 1 or v > 1 << 20:
        raise ConfigError(f"{where}: vision_config.{key} must be a positive integer, got {v!r:.60}")
    return v


def parse_spec(kind: str, cfg: dict[str, Any], pre: dict[str, Any], out_default: int, where: str
               ) -> QwenVisionSpec:
    v = cfg.get("vision_config")
    if not isinstance(v, dict):
        raise ConfigError(f"{where}: 'vision_config' is missing or not an object")
    q25 = kind == "qwen2_5_vl"
    embed = _int(v, "hidden_size" if q25 else "embed_dim", 1280, where)
    heads = _int(v, "num_heads", 16, where)
    if embed % heads or (embed // heads) % 4:
        raise ConfigError(f"{where}: vision head dim {embed}/{heads} must be an integer divisible by 4 (2D RoPE)")
    if q25:
        mlp = _int(v, "intermediate_size", 3420, where)
        out = _int(v, "out_hidden_size", out_default, where)
    else:
        ratio = v.get("mlp_ratio", 4)
        if not isinstance(ratio, (int, float)) or ratio <= 0:
            raise ConfigError(f"{where}: vision_config.mlp_ratio must be a positive number, got {ratio!r:.60}")
        mlp = int(embed * ratio)
        out = _int(v, "hidden_size", out_default, where)
    rp = v.get("rope_parameters") or {}
    theta = float(rp.get("rope_theta", 10000.0)) if isinstance(rp, dict) else 10000.0
    size = pre.get("size") if isinstance(pre.get("size"), dict) else {}
    min_px = pre.get("min_pixels", size.get("shortest_edge", 56 * 56))
    max_px = pre.get("max_pixels", size.get("longest_edge", 28 * 28 * 1280))
    for name, val in (("min_pixels", min_px), ("max_pixels", max_px)):
        if not isinstance(val, int) or val < 1:
            raise ConfigError(f"{where}: preprocessor_config.json {name} must be a positive integer, got {val!r:.60}")
    if min_px > max_px:
        raise ConfigError(f"{where}: preprocessor_config.json min_pixels {min_px} exceeds max_pixels {max_px}")
    depth = _int(v, "depth", 32, where)
    full = tuple(v.get("fullatt_block_indexes", (7, 15, 23, 31))) if q25 else ()
    return QwenVisionSpec(
        kind=kind, depth=depth, embed_dim=embed, num_heads=heads, mlp_dim=mlp, out_dim=out,
        act=v.get("hidden_act", "silu" if q25 else "quick_gelu"),
        patch_size=_int(v, "patch_size", 14, where), temporal_patch_size=_int(v, "temporal_patch_size", 2, where),
        merge_size=_int(v, "spatial_merge_size", 2, where), in_channels=_int(v, "in_channels", 3, where),
        rope_theta=theta, window_size=_int(v, "window_size", 112, where) if q25 else 0, fullatt_blocks=full,
        tokens_per_second=float(v.get("tokens_per_second", 4)) if q25 else 1.0,
        min_pixels=min_px, max_pixels=max_px,
        image_mean=tuple(pre.get("image_mean", CLIP_MEAN)), image_std=tuple(pre.get("image_std", CLIP_STD)),
        rescale=float(pre.get("rescale_factor", 1 / 255)),
        vision_start=cfg.get("vision_start_token_id"), vision_end=cfg.get("vision_end_token_id"),
        image_token=cfg.get("image_token_id"),
    )


# --- preprocessing --------------------------------------------------------------------------------------------

def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' smart_resize: sides multiples of `factor`, area within [min_pixels, max_pixels]."""
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"image aspect ratio {max(height, width) / min(height, width):.0f}:1 exceeds Qwen2-VL's "
                         "limit of 200:1")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def preprocess(spec: QwenVisionSpec, image: Any, device: torch.device | None = None, array: Any = None
               ) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """(pixel values [patches, C * tp * p * p] fp32, grid (t, h, w) in patches) of an RGB PIL image, computed on
    `device` (None: the CPU, bit-equal to transformers' processor) after one upload of the uint8 image (`array`:
    its pixels, where the caller has taken them out already)."""
    p, m = spec.patch_size, spec.merge_size
    h, w = smart_resize(image.height, image.width, p * m, spec.min_pixels, spec.max_pixels)
    x = resized_pixels(image, h, w, "bicubic", device, array)
    return patchify(spec, normalize(x, spec.rescale, spec.image_mean, spec.image_std)), (1, h // p, w // p)


def patchify(spec: QwenVisionSpec, x: torch.Tensor) -> torch.Tensor:
    """[patches, C * tp * p * p] of one frame [C, H, W], patches in merge-block order, the frame repeated over
    temporal_patch_size (an image is its own frame repeated)."""
    p, m, tp = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    c, gh, gw = x.shape[0], x.shape[1] // p, x.shape[2] // p
    x = x.reshape(c, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)  # gh', gw', mh, mw, C, ph, pw
    x = x.unsqueeze(5).expand(*x.shape[:5], tp, p, p)
    return x.reshape(gh * gw, c * tp * p * p)


def preprocess_video(spec: QwenVisionSpec, frames: list[Any], device: torch.device | None = None
                     ) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """(pixel values [patches, C * tp * p * p], grid (t, h, w)) of a video given as RGB PIL frames of one size:
    each frame resized and normalized as an image, the frame count padded to a multiple of temporal_patch_size
    with the last frame, and patches cut from each group of tp frames (transformers' Qwen2-VL video layout)."""
    if not frames:
        raise ImageError("a video needs at least one frame")
    size = (frames[0].width, frames[0].height)
    if any((f.width, f.height) != size for f in frames):
        raise ImageError(f"all video frames must have the same size (first frame {size[0]}x{size[1]})")
    p, m, tp = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    h, w = smart_resize(size[1], size[0], p * m, spec.min_pixels, spec.max_pixels)
    arrays = [normalize(resized_pixels(f, h, w, "bicubic", device), spec.rescale, spec.image_mean, spec.image_std)
              for f in frames]
    arrays += [arrays[-1]] * (-len(arrays) % tp)
    x = torch.stack(arrays)  # F, C, H, W
    c, gt, gh, gw = x.shape[1], x.shape[0] // tp, h // p, w // p
    x = x.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, c * tp * p * p), (gt, gh, gw)


# --- the tower ------------------------------------------------------------------------------------------------

def patch_positions(grid: tuple[int, int, int], m: int) -> torch.Tensor:
    """(row, column) of each patch [N, 2] in merge-block order (transformers' get_vision_position_ids)."""
    t, h, w = grid
    hp, wp = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    shape = (h // m, m, w // m, m)
    hp = hp.reshape(shape).transpose(1, 2).flatten()
    wp = wp.reshape(shape).transpose(1, 2).flatten()
    return torch.stack([hp, wp], dim=-1).repeat(t, 1)


def window_index(grid: tuple[int, int, int], m: int, window: int, patch: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL: merge blocks in window order, and the window bounds in patches (transformers'
    get_vision_window_index for one image, except that within each frame the windows are ordered by size, largest
    first: attention stays within windows and the merger within merge blocks, so the order of windows changes
    nothing but lets each window size's windows lie next to each other, attended as one slice without gathers)."""
    t, gh, gw = grid
    size = window // m // patch
    lh, lw = gh // m, gw // m
    index = torch.arange(t * lh * lw).reshape(t, lh, lw)
    pad_h, pad_w = size - lh % size, size - lw % size
    nh, nw = (lh + pad_h) // size, (lw + pad_w) // size
    padded = F.pad(index, (0, pad_w, 0, pad_h), "constant", -100)
    padded = padded.reshape(t, nh, size, nw, size).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, size * size)
    seqlens = (padded != -100).sum(2)  # [t, windows]
    by_size = torch.sort(seqlens, dim=1, descending=True, stable=True).indices
    padded = padded.gather(1, by_size.unsqueeze(-1).expand_as(padded))
    seqlens = seqlens.gather(1, by_size).reshape(-1)
    flat = padded.reshape(-1)
    bounds = [0] + (seqlens.cumsum(0) * m * m).tolist()
    return flat[flat != -100], sorted(set(bounds))


LAYOUTS = 16  # image shapes whose rotary tables and window plans a tower keeps on its device


@dataclass(frozen=True)
class _Layout:
    """What a forward pass needs for one image shape, on the tower's device: the 2D RoPE cos / sin of each patch
    (fp32, in processing order), the attention segments of full and windowed blocks, and for Qwen2.5-VL the
    merge-block order into windows and back."""

    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor  # [1, N]: row i of cos / sin is patch i's (the RoPE kernel's table lookup)
    full: Segments
    windows: Segments | None
    order: torch.Tensor | None
    restore: torch.Tensor | None


# Qwen2.5-VL's MLP width (3420 in the 7B's tower) padded to a multiple of this on GPUs, with zero rows of gate and
# up (silu(0) * 0 = 0) and zero columns of down, so the sum is the same: at 3420 the rows of the down projection's
# input are not 16-byte aligned (3420 x 2 bytes), which keeps cuBLAS off its fastest fp16 kernels; 3456 costs 1%
# more arithmetic.
MLP_ALIGN = 128


def pad_rows(w: torch.Tensor, multiple: int) -> torch.Tensor:
    """w with zero rows appended up to a multiple of `multiple` rows (w itself when there is none to add)."""
    extra = -w.shape[0] % multiple
    if not extra:
        return w
    return torch.cat([w, w.new_zeros((extra,) + tuple(w.shape[1:]))])


class QwenVisionTower:
    """The weights and forward pass of one Qwen2-VL / Qwen2.5-VL vision encoder with its patch merger."""

    def __init__(self, spec: QwenVisionSpec) -> None:
        self.spec = spec
        self.mlp_align: int | None = None  # None: MLP_ALIGN on GPUs, no padding elsewhere
        self.w: dict[str, torch.Tensor] = {}
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.act = act_fn(spec.act, "vision_config.hidden_act")
        self._layouts: OrderedDict[tuple[int, int, int], _Layout] = OrderedDict()
        self._lock = threading.Lock()

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        s = self.spec
        e, p, tp, c = s.embed_dim, s.patch_size, s.temporal_patch_size, s.in_channels
        merged = e * s.merge_size ** 2
        shapes: dict[str, tuple[int, ...]] = {"visual.patch_embed.proj.weight": (e, c, tp, p, p)}
        norms = ("weight",) if s.kind == "qwen2_5_vl" else ("weight", "bias")
        for i in range(s.depth):
            b = f"visual.blocks.{i}"
            for n in ("norm1", "norm2"):
                for part in norms:
                    shapes[f"{b}.{n}.{part}"] = (e,)
            shapes.update({f"{b}.attn.qkv.weight": (3 * e, e), f"{b}.attn.qkv.bias": (3 * e,),
                           f"{b}.attn.proj.weight": (e, e), f"{b}.attn.proj.bias": (e,)})
            if s.kind == "qwen2_5_vl":
                for n, shape in (("gate_proj", (s.mlp_dim, e)), ("up_proj", (s.mlp_dim, e)),
                                 ("down_proj", (e, s.mlp_dim))):
                    shapes[f"{b}.mlp.{n}.weight"] = shape
                    shapes[f"{b}.mlp.{n}.bias"] = (shape[0],)
            else:
                shapes.update({f"{b}.mlp.fc1.weight": (s.mlp_dim, e), f"{b}.mlp.fc1.bias": (s.mlp_dim,),
                               f"{b}.mlp.fc2.weight": (e, s.mlp_dim), f"{b}.mlp.fc2.bias": (e,)})
        for part in norms:
            shapes[f"visual.merger.ln_q.{part}"] = (e,)
        shapes.update({"visual.merger.mlp.0.weight": (merged, merged), "visual.merger.mlp.0.bias": (merged,),
                       "visual.merger.mlp.2.weight": (s.out_dim, merged), "visual.merger.mlp.2.bias": (s.out_dim,)})
        return shapes

    def load(self, read: Any, device: torch.device, dtype: torch.dtype) -> None:
        """`read(name, shape)` gives each checkpoint tensor; kept on `device` in `dtype`."""
        self.w = {n: read(n, shape).to(device=device, dtype=dtype) for n, shape in self.tensor_shapes().items()}
        e = self.spec.embed_dim
        self.w["visual.patch_embed.proj.weight"] = self.w["visual.patch_embed.proj.weight"].reshape(e, -1)
        if self.spec.kind == "qwen2_5_vl":
            # gate and up in one GEMM per block: one launch, and N = 2 x 3420 fills the H100's waves better than
            # two GEMMs of 3420 (the tower's MLPs were a fifth of the 7B's time to first token)
            align = self.mlp_align if self.mlp_align is not None else MLP_ALIGN if device.type == "cuda" else 1
            for i in range(self.spec.depth):
                b = f"visual.blocks.{i}.mlp"
                for part in ("weight", "bias"):
                    gate, up = (pad_rows(self.w.pop(f"{b}.{n}.{part}"), align) for n in ("gate_proj", "up_proj"))
                    self.w[f"{b}.gate_up.{part}"] = torch.cat([gate, up])
                down = self.w[f"{b}.down_proj.weight"]
                self.w[f"{b}.down_proj.weight"] = pad_rows(down.t(), align).t().contiguous()
        self.device, self.dtype = device, dtype
        self._layouts.clear()

    def unload(self) -> None:
        self.w = {}
        self._layouts.clear()

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        if self.spec.kind == "qwen2_5_vl":
            return rms_norm(x, self.w[f"{name}.weight"], 1e-6)
        return F.layer_norm(x, (x.shape[-1],), self.w[f"{name}.weight"], self.w[f"{name}.bias"], 1e-6)

    def _lin(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[f"{name}.weight"], self.w.get(f"{name}.bias"))

    def _layout(self, grid: tuple[int, int, int]) -> _Layout:
        """The per-image-shape tables on the device, built once per grid (kept for the last LAYOUTS grids)."""
        with self._lock:
            lay = self._layouts.get(grid)
            if lay is not None:
                self._layouts.move_to_end(grid)
                return lay
        s = self.spec
        n = grid[0] * grid[1] * grid[2]
        unit = s.merge_size ** 2
        half = s.head_dim // 2
        inv = 1.0 / (s.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
        freqs = (patch_positions(grid, s.merge_size).float()[..., None] * inv).flatten(1)  # row freqs, column freqs
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        frame = grid[1] * grid[2]  # full attention is per temporal patch (a frame group of a video)
        full = plan_segments(list(range(0, n + 1, frame)), self.device)
        order = restore = windows = None
        if s.kind == "qwen2_5_vl":  # patches in window order once, back after the merger
            units, bounds = window_index(grid, s.merge_size, s.window_size, s.patch_size)
            rows = (units.view(-1, 1) * unit + torch.arange(unit)).view(-1)
            cos, sin = cos[rows], sin[rows]
            order, restore = upload(units, self.device), upload(torch.argsort(units), self.device)
            windows = plan_segments(bounds, self.device)
        positions = torch.arange(n, device=self.device).view(1, -1)
        lay = _Layout(upload(cos, self.device), upload(sin, self.device), positions, full, windows, order, restore)
        with self._lock:
            self._layouts[grid] = lay
            while len(self._layouts) > LAYOUTS:
                self._layouts.popitem(last=False)
        return lay

    def forward(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """Features [N / merge^2, out_dim] of one image's pixel values [N, C * tp * p * p]."""
        s = self.spec
        x = F.linear(pixels.to(device=self.device, dtype=self.dtype), self.w["visual.patch_embed.proj.weight"])
        n = x.shape[0]
        unit = s.merge_size ** 2
        mark("tower: patch embed")
        lay = self._layout(grid)
        if lay.order is not None:
            x = x.view(n // unit, unit, -1).index_select(0, lay.order).view(n, -1)
        mark("tower: rotary + window tables")
        for i in range(s.depth):
            b = f"visual.blocks.{i}"
            segs = lay.full if lay.windows is None or i in s.fullatt_blocks else lay.windows
            x = x + self._attention(self._norm(x, f"{b}.norm1"), b, lay, segs)
            mark("tower: attention")
            h = self._norm(x, f"{b}.norm2")
            if s.kind == "qwen2_5_vl":
                gate, up = self._lin(h, f"{b}.mlp.gate_up").chunk(2, dim=-1)
                # SiLU (every released model): the language model's SwiGLU kernel, one pass over both halves
                a = ops.silu_mul(gate, up) if s.act == "silu" else self.act(gate) * up
                h = self._lin(a, f"{b}.mlp.down_proj")
            else:
                h = self._lin(self.act(self._lin(h, f"{b}.mlp.fc1")), f"{b}.mlp.fc2")
            x = x + h
            mark("tower: mlp")
        h = self._norm(x, "visual.merger.ln_q").reshape(-1, s.embed_dim * unit)
        h = self._lin(F.gelu(self._lin(h, "visual.merger.mlp.0")), "visual.merger.mlp.2")
        if lay.restore is not None:
            h = h.index_select(0, lay.restore)
        mark("tower: merger")
        return h

    def _attention(self, x: torch.Tensor, b: str, lay: _Layout, segments: Segments) -> torch.Tensor:
        s = self.spec
        n = x.shape[0]
        qkv = self._lin(x, f"{b}.attn.qkv").reshape(n, 3, s.num_heads, s.head_dim)
        # q and k rotated in fp32 (as transformers does) by the language model's RoPE kernel: in place inside qkv,
        # one launch and one pass, where torch ops took seven passes over fp32 copies
        q, k = ops.apply_rope(qkv[:, 0].unsqueeze(0), qkv[:, 1].unsqueeze(0), lay.cos, lay.sin, lay.positions)
        q, k = q[0], k[0]
        v = qkv[:, 2]
        o = segment_attention(q, k, v, segments, s.head_dim ** -0.5)
        return self._lin(o.reshape(n, -1), f"{b}.attn.proj")

    def postprocess(self, features: torch.Tensor, text_rows: Any) -> tuple[torch.Tensor, int, int]:
        """The embedding rows: <|vision_start|> + features + <|vision_end|> (exllamav2's layout); text_rows(ids)
        gives the language model's embeddings of token ids."""
        s = self.spec
        if s.vision_start is None or s.vision_end is None:
            return features, 0, 0
        ends = text_rows([s.vision_start, s.vision_end]).to(features)
        return torch.cat([ends[:1], features, ends[1:]]), 1, 1
