"""`ExLlamaV2VisionTower`: the vision encoder and projector of a multimodal model directory (exllamav2's API).

`get_image_embeddings(model, tokenizer, image, text_alias)` turns an image (PIL image, path, bytes or data:
URL) into an `ExLlamaV2MMEmbedding` whose alias goes into the prompt. Embeddings are cached by the image's
content (and the preprocessing settings): the same picture sent again costs neither preprocessing nor the
tower, and gets the same token ids (so also the same cache pages in the dynamic generator).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from exlpy.arguments import refuse_unknown_arguments
from exlpy.errors import ConfigError, ModelStateError, MultimodalError, NotSupportedError
from exlpy.vision import gemma3, pixtral, qwen2
from exlpy.vision.embedding import ExLlamaV2MMEmbedding, RowCheck
from exlpy.vision.image import digest_soon, image_array, image_digest, load_image
from exlpy.vision.timing import mark
from exlpy.weights.checks import landed, module_checks

CACHE_ENTRIES = 64  # embeddings kept per tower (each a few MB at most for typical images)


def _json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return data


def vision_kind(config: Any) -> str:
    """The vision tower kind of a prepared config, or MultimodalError for a text-only model."""
    spec = config.spec
    kind = spec.arch.vision if spec is not None else None
    if kind is None:
        name = spec.architecture if spec is not None else "this model"
        raise MultimodalError(f"{name} is a text-only model: it has no vision tower and cannot take images "
                              f"({config.model_dir})")
    return kind


class ExLlamaV2VisionTower:
    """The vision encoder of `config`'s model (Qwen2-VL, Qwen2.5-VL, Gemma 3, Pixtral /
    Mistral 3.1). Load with `load()`; it runs on the first
    GPU (fp16) or on the CPU (fp32) without one, next to the language model wherever that is."""

    def __init__(self, config: Any) -> None:
        from exlpy.config.config import ExLlamaV2Config

        if not isinstance(config, ExLlamaV2Config):
            raise ConfigError(f"ExLlamaV2VisionTower takes an ExLlamaV2Config, got {type(config).__name__}")
        if not getattr(config, "prepared", False):
            config.prepare()
        self.config = config
        kind = vision_kind(config)
        where = os.path.join(config.model_dir, "config.json")
        raw = _json(where)
        pre = _json(os.path.join(config.model_dir, "preprocessor_config.json"))
        self.vspec: Any
        self.tower: Any
        if kind in ("qwen2_vl", "qwen2_5_vl"):
            self.vspec = qwen2.parse_spec(kind, raw, pre, config.hidden_size, where)
            if self.vspec.out_dim != config.hidden_size:
                raise ConfigError(f"{where}: the vision merger's output size {self.vspec.out_dim} differs from the "
                                  f"language model's hidden_size {config.hidden_size}")
            self.tower = qwen2.QwenVisionTower(self.vspec)
            self._preprocess = qwen2.preprocess
        elif kind == "gemma3":
            self.vspec = gemma3.parse_spec(raw, pre, config.hidden_size, where)
            self.tower = gemma3.SiglipTower(self.vspec)
            self._preprocess = gemma3.preprocess
        elif kind == "pixtral":
            mistral3 = config.spec.architecture == "Mistral3ForConditionalGeneration"
            self.vspec = pixtral.parse_spec(raw, pre, config.hidden_size, config.spec.norm_eps, mistral3, where)
            self.tower = pixtral.PixtralTower(self.vspec)
            self._preprocess = pixtral.preprocess
        else:  # pragma: no cover - every arch with a `vision` kind has a tower above
            raise NotSupportedError(f"vision tower {kind!r} is not supported yet")
        self.kind = kind
        self.loaded = False
        self._cache: OrderedDict[tuple[Any, ...], tuple[Any, ...]] = OrderedDict()  # key: (rows, thw, pre, post,
        # host copy in flight or None, RowCheck)
        self._lock = threading.Lock()

    # --- loading ------------------------------------------------------------------------------------------------
    @refuse_unknown_arguments
    def load(self, progress: bool = False, callback: Any = None, device: Any = None) -> None:
        dev = torch.device(device) if device is not None else \
            torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        dtype = self.config.compute_dtype(dev)
        index = self.config.index
        assert index is not None

        def read(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            return landed(index, name, index.get(name, shape=shape))

        with module_checks():
            self.tower.load(read, dev, dtype)
        self.device, self.loaded = dev, True
        if callback is not None:
            callback(1, 1)

    def load_autosplit(self, *args: Any, **kwargs: Any) -> None:
        raise NotSupportedError("ExLlamaV2VisionTower loads with load() only (as in exllamav2): it runs on one device")

    def load_tp(self, *args: Any, **kwargs: Any) -> None:
        raise NotSupportedError("ExLlamaV2VisionTower loads with load() only (as in exllamav2): no tensor parallelism")

    def unload(self) -> None:
        self.tower.unload()
        self.loaded = False
        self._cache.clear()

    # --- embeddings ---------------------------------------------------------------------------------------------
    def preprocess(self, image: Any) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """(pixel values on the CPU, patch grid (t, h, w)) of an image, as the model's Hugging Face processor makes
        them (bit-equal to its PIL processor)."""
        return self._preprocess(self.vspec, load_image(image))

    def _pixels(self, img: Any, array: Any = None) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """preprocess() on the tower's device: the uint8 image (`array`: its pixels, if taken out already)
        uploaded once, the rest computed there (on a GPU also the resize; exlpy/vision/pixels.py)."""
        if self.kind == "pixtral":
            return self._preprocess(self.vspec, img)
        return self._preprocess(self.vspec, img, self.device if self.loaded else None, array)

    @property
    def _launches_preprocessing(self) -> bool:
        """Whether preprocess() only queues GPU work (the host's part is an upload and launches): then it runs
        while the image is being hashed, before the cache lookup, at the price of that small GPU work when the
        image turns out to be cached."""
        return self.loaded and self.device.type == "cuda" and self.kind != "pixtral"

    def _digest(self, key: tuple[Any, ...], model: Any) -> bytes:
        """What determines an image's rows: the image and preprocessing settings (the cache key), this tower's
        model, settings, dtype and device kind (GPU and CPU arithmetic differ in the last bits), and the language
        model (its start / end rows)."""
        h = hashlib.sha256(repr((key[0], key[2:], self.config.model_dir, self.vspec, str(self.tower.dtype),
                                 self.device.type if self.loaded else None,
                                 model.config.model_dir)).encode())
        return h.digest()[:16]

    def image_features(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """The merger's output [tokens, hidden_size] for one image's pixel values."""
        if not self.loaded:
            raise ModelStateError("ExLlamaV2VisionTower is not loaded: call vision_tower.load() first")
        with torch.inference_mode():
            return self.tower.forward(pixels, grid)

    @refuse_unknown_arguments
    def get_video_embeddings(self, model: Any, tokenizer: Any, video: list[Any], text_alias: str | None = None,
                             embeddings_cpu: bool = True, fps: float = 2.0) -> ExLlamaV2MMEmbedding:
        """The embedding of a video (a list of frames: PIL images, paths or bytes, all of one size) for Qwen2-VL
        and Qwen2.5-VL: frames in groups of temporal_patch_size; M-RoPE's time advances one step per group
        (Qwen2-VL), or tokens_per_second x the group's duration at `fps` frames per second (Qwen2.5-VL)."""
        if self.kind not in ("qwen2_vl", "qwen2_5_vl"):
            raise NotSupportedError(f"video input is supported for Qwen2-VL / Qwen2.5-VL, not "
                                    f"{self.config.spec.architecture}")
        if not isinstance(fps, (int, float)) or not 0 < fps < 1e4:
            raise MultimodalError(f"get_video_embeddings: fps must be a positive number, got {fps!r}")
        if model.config.spec is None or model.config.hidden_size != self.config.hidden_size:
            raise MultimodalError("get_video_embeddings: the model is not the language model of this vision tower")
        if not isinstance(video, (list, tuple)):
            raise MultimodalError(f"video must be a list of frames, got {type(video).__name__}")
        frames = [load_image(f, f"video frame {i}") for i, f in enumerate(video)]
        pixels, grid = qwen2.preprocess_video(self.vspec, frames, self.device if self.loaded else None)
        features = self.image_features(pixels, grid)
        rows, pre, post = self.tower.postprocess(features, lambda ids: text_rows(model, ids))
        m = self.vspec.merge_size
        thw = (grid[0], grid[1] // m, grid[2] // m)
        interval = 1.0
        if self.kind == "qwen2_5_vl":  # transformers: tokens_per_second x seconds per temporal patch
            interval = self.vspec.tokens_per_second * self.vspec.temporal_patch_size / fps
        emb = ExLlamaV2MMEmbedding(model, rows.cpu() if embeddings_cpu else rows, text_alias, thw_grid=thw,
                                   pre_tokens=pre, post_tokens=post, time_interval=interval)
        emb.metadata.update({"original_size": (frames[0].height, frames[0].width), "frames": len(frames),
                             "patches_size": (thw[1], thw[2])})
        return emb

    @refuse_unknown_arguments
    def get_image_embeddings(self, model: Any, tokenizer: Any, image: Any, text_alias: str | None = None,
                             embeddings_cpu: bool = True) -> ExLlamaV2MMEmbedding:
        """The embedding of one image for `model`'s prompts, its alias `text_alias` (default: a unique tag)."""
        if model.config.spec is None or model.config.hidden_size != self.config.hidden_size:
            raise MultimodalError("get_image_embeddings: the model is not the language model of this vision tower")
        vision_kind(model.config)
        img = load_image(image)
        array = image_array(img)
        early = None
        if self._launches_preprocessing:  # hashed on a worker thread while the GPU preprocessing is queued
            hashing = digest_soon(img, array)
            mark("image: decode")
            early = self._pixels(img, array)
            mark("preprocess")
            digest = hashing.result()
            mark("image: hash (beside preprocessing)")
        else:
            digest = image_digest(img, array)
            mark("image: decode + hash")
        key = (digest, id(model), getattr(self.vspec, "min_pixels", 0), getattr(self.vspec, "max_pixels", 0))
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        device_rows = ready = None
        if hit is None:
            pixels, grid = early if early is not None else self._pixels(img, array)
            mark("preprocess")
            features = self.image_features(pixels, grid)
            m = self.vspec.merge_size
            thw = (grid[0], grid[1] // m, grid[2] // m)
            if self.kind == "pixtral":  # rows interleaved with [IMG_BREAK]: no grid positions to keep
                rows, pre, post = self.tower.postprocess(features, lambda ids: text_rows(model, ids), grid, tokenizer)
            else:
                rows, pre, post = self.tower.postprocess(features, lambda ids: text_rows(model, ids))
            device_rows = rows if rows.device.type != "cpu" else None
            check = RowCheck(rows)  # on a GPU: launched here, read at the rows' first use
            if embeddings_cpu and device_rows is not None:
                rows, ready = host_copy(device_rows)
            hit = (rows, thw, pre, post, ready, check)
            with self._lock:
                self._cache[key] = hit
                while len(self._cache) > CACHE_ENTRIES:
                    self._cache.popitem(last=False)
        rows, thw, pre, post, ready, check = hit
        emb = ExLlamaV2MMEmbedding(model, rows, text_alias, thw_grid=None if self.kind == "pixtral" else thw,
                                   pre_tokens=pre, post_tokens=post, digest=self._digest(key, model),
                                   device_rows=device_rows, ready=ready, row_check=check)
        side = getattr(self.vspec, "image_size", None)
        step = getattr(self.vspec, "factor", self.vspec.merge_size * self.vspec.patch_size)
        prep = (side, side) if side else (thw[1] * step, thw[2] * step)
        emb.metadata.update({"original_size": (img.height, img.width), "preprocessed_size": prep,
                             "patches_size": (thw[1], thw[2])})
        mark("embedding: rows + MMEmbedding")
        return emb


_copier: ThreadPoolExecutor | None = None
_copier_lock = threading.Lock()


class HostCopy:
    """The host copy of device rows, made by a worker thread once the rows are computed: it runs beside the
    prompt's first layers instead of before them (9.8 MB for a 1024x1024 image on a 7B), and the main thread never
    waits for it. The worker copies through a pinned staging buffer (an asynchronous copy on a side stream, then a
    host memcpy into `host`, ordinary memory): the tower's cache keeps these copies, and a page-locked buffer per
    image would cost an allocation of pinned memory each time and tie up locked memory for the cache's lifetime;
    the staging buffer comes from torch's pinned-memory cache and is reused image after image."""

    def __init__(self, rows: torch.Tensor, host: torch.Tensor) -> None:
        global _copier
        self.computed = torch.cuda.Event()
        self.computed.record(torch.cuda.current_stream(rows.device))
        with _copier_lock:
            if _copier is None:  # one worker: copies run one after another
                _copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="exlpy-rows-to-host")
        # the closure holds `rows` until the copy has read them, so the allocator cannot hand their memory out
        self._done = _copier.submit(self._copy, rows, host)

    def _copy(self, rows: torch.Tensor, host: torch.Tensor) -> None:
        with torch.inference_mode(), torch.cuda.device(rows.device):
            staging = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            side = torch.cuda.Stream(rows.device)
            side.wait_event(self.computed)
            with torch.cuda.stream(side):
                staging.copy_(rows, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(side)
            copied.synchronize()  # this thread only (the GIL is released while it waits, and in the memcpy)
            host.copy_(staging)

    def synchronize(self) -> None:
        self._done.result()


def host_copy(rows: torch.Tensor) -> tuple[torch.Tensor, HostCopy]:
    """A host tensor that will hold device `rows`, and the HostCopy writing it (synchronize() waits for it)."""
    host = torch.empty(rows.shape, dtype=rows.dtype)
    return host, HostCopy(rows, host)


def text_rows(model: Any, ids: list[int]) -> torch.Tensor:
    """The language model's input embeddings of token ids (scaled as its embedding layer scales them)."""
    emb = model.modules[0]
    if getattr(emb, "weight", None) is None:
        raise ModelStateError("the language model is not loaded: load it before computing image embeddings")
    # rows picked by host integers (views), not by an index tensor: uploading one from pageable memory would wait
    # for the GPU, i.e. for the whole vision tower, before the prompt's host-side setup could start
    rows = torch.stack([emb.weight[i] for i in ids])
    if emb.scale != 1.0:
        rows = rows * float(torch.tensor(emb.scale, dtype=rows.dtype))
    return rows
