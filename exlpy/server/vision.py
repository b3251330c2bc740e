"""Images in chat requests: OpenAI `image_url` content parts turned into the served model's image embeddings.

A vision-language model's tower is loaded with the model (unless `--no-vision`). An image part's URL must be
a `data:image/...;base64,` URL; local files (`file://` URLs or paths) only with `--allow-local-images`; http(s)
URLs are refused: the server never fetches anything a request names. Each image becomes an
ExLlamaV2MMEmbedding whose alias (unique per request) stands in the message text; the rendered prompt is then
encoded with the aliases replaced by the embeddings' ids.
"""

from __future__ import annotations

import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any

from exlpy.errors import GeneratorError, ImageError, MultimodalError

MAX_IMAGES = 16  # images per request


@dataclass
class VisionServing:
    tower: Any
    allow_local_images: bool


_towers: weakref.WeakKeyDictionary[Any, VisionServing] = weakref.WeakKeyDictionary()


def attach(model: Any, vision: bool, allow_local_images: bool) -> None:
    """Load `model`'s vision tower for serving (a text-only model, or vision off: nothing)."""
    spec = model.config.spec
    if not vision or spec is None or spec.arch.vision is None:
        return
    from exlpy.vision import ExLlamaV2VisionTower

    tower = ExLlamaV2VisionTower(model.config)
    tower.load()
    _towers[model] = VisionServing(tower, allow_local_images)


def serving(model: Any) -> VisionServing | None:
    return _towers.get(model)


def detach(model: Any) -> None:
    entry = _towers.pop(model, None)
    if entry is not None:
        entry.tower.unload()


def _bad(param: str, msg: str, cls: type = ImageError) -> Exception:
    e = cls(f"{param}: {msg}")
    e.param = param  # type: ignore[attr-defined]
    return e


@dataclass
class RequestImages:
    """The images of one request: each image part's alias and embedding, in order."""

    model: Any
    tokenizer: Any
    entry: VisionServing | None
    embeddings: list[Any] = field(default_factory=list)
    nonce: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    def alias(self, part: Any, where: str) -> str:
        """The text standing for an image part (its embedding computed now)."""
        if self.entry is None:
            spec = self.model.config.spec
            why = ("its vision tower is not loaded (the server runs with --no-vision)"
                   if spec is not None and spec.arch.vision is not None else "it is a text-only model")
            raise _bad(where, f"image parts cannot be used with this model: {why}", MultimodalError)
        if len(self.embeddings) >= MAX_IMAGES:
            raise _bad(where, f"more than {MAX_IMAGES} images in one request", MultimodalError)
        url = part.image_url.get("url") if isinstance(part.image_url, dict) else part.image_url
        if not isinstance(url, str) or not url:
            raise _bad(where, "an image_url part needs image_url.url (a data: URL)")
        source: Any
        if url.startswith("data:"):
            source = url
        elif url.startswith(("http://", "https://")):
            raise _bad(where, "http(s) image URLs are not fetched by this server; send the image as a "
                       "data:image/...;base64 URL")
        elif self.entry.allow_local_images:
            source = url[len("file://"):] if url.startswith("file://") else url
        else:
            raise _bad(where, "local image files are refused (start the server with --allow-local-images to "
                       "allow them); send the image as a data:image/...;base64 URL")
        alias = f"<|exlpy-image-{self.nonce}-{len(self.embeddings)}|>"
        try:
            emb = self.entry.tower.get_image_embeddings(model=self.model, tokenizer=self.tokenizer, image=source,
                                                        text_alias=alias)
        except ImageError as e:
            raise _bad(where, str(e)) from None
        self.embeddings.append(emb)
        return alias


def encode_with_images(encode: Any, text: str, contents: list[str], images: RequestImages) -> list[int]:
    """Ids of a rendered prompt whose text holds image aliases: the text between aliases encoded by
    `encode(text, contents)` (chat contents kept as text), each alias replaced by its embedding's ids."""
    ids: list[int] = []
    pos = 0
    for emb in images.embeddings:
        i = text.find(emb.text_alias, pos)
        if i < 0:
            raise _bad("messages", "the chat template dropped an image (its placeholder is not in the rendered "
                       "prompt)", GeneratorError)
        parts = [p for c in contents for p in c.split(emb.text_alias)]
        if i > pos:
            ids += encode(text[pos:i], [p for p in parts if p and p in text[pos:i]])
        ids += emb.get_ids()
        pos = i + len(emb.text_alias)
    if pos < len(text):
        ids += encode(text[pos:], [c for c in contents if c and c in text[pos:]])
    return ids
