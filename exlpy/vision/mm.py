"""What a forward pass needs to read a prompt that holds embeddings: the rows behind the reserved ids, and for
M-RoPE models (Qwen2-VL, Qwen2.5-VL) the rotary angles of each token.

M-RoPE splits the rotary frequencies into three sections rotated by a temporal, a height and a width position.
Text tokens have all three equal, so for them M-RoPE is ordinary RoPE at a shifted position; an image's tokens
sit on their (t, h, w) grid starting at the position where the image begins, and the text after the image
continues from that start plus the grid's larger side (as transformers' `get_rope_index` counts). So a
sequence's positions are a function of its ids alone: `mrope_positions` computes them for any prefix, a prefill
chunk gets per-token cos/sin rows (`MMInputs.rope`), and decoding continues at `cache position + delta`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from exlpy.config.rope import inv_freq
from exlpy.errors import MultimodalError
from exlpy.vision.attention import ImageSpans
from exlpy.vision.embedding import EMBEDDING_INDEX, ExLlamaV2MMEmbedding
from exlpy.vision.timing import mark
from exlpy.vision.transfer import upload


def check_mm_ids(ids: torch.Tensor, vocab_size: int, embeddings: list[ExLlamaV2MMEmbedding], what: str) -> None:
    """Every id inside the vocabulary or inside the range of one of `embeddings` (host ids only)."""
    if ids.device.type != "cpu":
        return
    flat = ids.reshape(-1)
    special = flat >= EMBEDDING_INDEX
    text = flat[~special]
    if text.numel():
        lo, hi = (int(v) for v in torch.aminmax(text))
        if lo < 0 or hi >= vocab_size:
            raise MultimodalError(f"{what} holds token id {lo if lo < 0 else hi}, outside the model's vocabulary "
                                  f"[0, {vocab_size}) (vocab_size)")
    rest = flat[special]
    for e in embeddings:
        rest = rest[(rest < e.first_index) | (rest >= e.first_index + e.length)]
    if rest.numel():
        raise MultimodalError(f"{what} holds embedding id {int(rest[0])}, which belongs to none of the "
                              f"{len(embeddings)} embeddings passed with it (pass embeddings=[...] with every "
                              "prompt whose text holds their aliases)")


def embed_rows(ids: torch.Tensor, h: torch.Tensor, embeddings: list[ExLlamaV2MMEmbedding]) -> torch.Tensor:
    """h [B, T, H] with the rows of embedding ids replaced by their embeddings (in h's dtype and device), without
    reading anything back to the host: each embedding's rows are gathered for every position and selected where
    the ids are its own."""
    chunk = ids.shape[-1] > 1  # phase marks for prefill chunks only, not for decode steps
    if chunk:
        mark("prefill: batch + text embedding")
    for e in embeddings:
        rel = ids - e.first_index
        m = ((rel >= 0) & (rel < e.length)).unsqueeze(-1)
        h = torch.where(m, F.embedding(rel.clamp(0, e.length - 1), e.rows_on(h.device, h.dtype)), h)
    for e in embeddings:
        # Rows a tower made on a GPU are checked for inf / NaN here, on their first use, not when the embedding is
        # made: by now the host has queued the prompt's setup behind the tower, and the wait ends with the tower
        # (MultimodalError before any layer reads the rows).
        e.verify()
    if chunk:
        mark("prefill: image rows inserted")
    return h


def _segments(ids: torch.Tensor, embeddings: list[ExLlamaV2MMEmbedding]
              ) -> list[tuple[int, int, ExLlamaV2MMEmbedding]]:
    """(start, end, embedding) of each image run in 1-D `ids` (the grid part of an embedding's ids), sorted."""
    segs = []
    for e in embeddings:
        if e.thw_grid is None:
            continue
        lo, hi = e.get_vision_token_range()
        inside = ((ids >= lo) & (ids < hi)).nonzero().flatten().tolist()
        i = 0
        while i < len(inside):
            s = inside[i]
            n = hi - lo
            expect = torch.arange(lo, hi, dtype=ids.dtype)
            if int(ids[s]) != lo or s + n > ids.numel() or not torch.equal(ids[s:s + n], expect):
                raise MultimodalError(f"the image tokens of {e.text_alias!r} appear incomplete or out of order in "
                                      "the sequence; insert an embedding only through its text alias")
            segs.append((s, s + n, e))
            i += n
    segs.sort(key=lambda t: t[0])
    return segs


def mrope_positions(ids: torch.Tensor, embeddings: list[ExLlamaV2MMEmbedding]) -> tuple[torch.Tensor, int]:
    """(positions [3, n] int64 of 1-D `ids`, delta): the token at cache index i >= n has position i + delta."""
    n = ids.numel()
    out = torch.empty(3, n, dtype=torch.long)
    pos, at = 0, 0
    for s, end, e in _segments(ids, embeddings):
        out[:, at:s] = torch.arange(pos, pos + s - at)
        pos += s - at
        assert e.thw_grid is not None
        t, h, w = e.thw_grid
        tpos = (torch.arange(t) * e.time_interval).long()  # transformers: time steps scaled, then truncated
        grid = torch.stack(torch.meshgrid(tpos, torch.arange(h), torch.arange(w), indexing="ij"))
        out[:, s:end] = grid.reshape(3, -1) + pos
        pos += max(h, w)
        at = end
    out[:, at:] = torch.arange(pos, pos + n - at)
    pos += n - at
    return out, pos - n


def mrope_cos_sin(config: object, positions: torch.Tensor, sections: tuple[int, ...]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos / sin rows [n, head_dim] (NEOX layout) for M-RoPE positions [3, n]: frequency j of section k
    rotates by position stream k (transformers' `apply_multimodal_rotary_pos_emb`)."""
    spec = config.spec  # type: ignore[attr-defined]
    f, attn_factor = inv_freq(spec.head_dim, spec.rope_theta, spec.rope_scaling,
                              config.scale_alpha_value, config.max_seq_len)  # type: ignore[attr-defined]
    which = torch.repeat_interleave(torch.arange(len(sections)), torch.tensor(sections))
    pos = positions.float() / config.scale_pos_emb  # type: ignore[attr-defined]
    freqs = pos[which].t() * f  # [n, D/2]: frequency j at its section's position
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attn_factor, emb.sin() * attn_factor


@dataclass
class MMInputs:
    """The multimodal part of one forward pass (ForwardBatch.mm): the embeddings whose ids the tokens may hold,
    and for an M-RoPE chunk the cos / sin row of each token (rows b*T + t; batch.rope_positions indexes them)."""

    embeddings: list[ExLlamaV2MMEmbedding]
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    # Gemma 3: per token of the chunk [B, T] (host), the image occurrence it belongs to (-1: not an image token);
    # tokens of one occurrence attend to each other both ways (exlpy/vision/attention.py).
    blocks: torch.Tensor | None = None
    _tables: dict[tuple[str, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict,
                                                                                     repr=False)
    # What the chunk's queries see when it holds image tokens (None otherwise): decided here, once per forward
    # pass, from host data; every layer's attention reads it (model/attention.py).
    spans: ImageSpans | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.blocks is not None and bool((self.blocks >= 0).any()):
            self.spans = ImageSpans(self.blocks)

    def table(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.rope is not None
        key = (str(device), dtype)
        if key not in self._tables:
            self._tables[key] = (upload(self.rope[0], device, dtype), upload(self.rope[1], device, dtype))
        return self._tables[key]


def image_blocks(ids: torch.Tensor, embeddings: list[ExLlamaV2MMEmbedding]) -> torch.Tensor:
    """Per token of 1-D `ids`, the index of the image run it is in (runs of one embedding's image ids), or -1."""
    owner = torch.full_like(ids, -1)
    for k, e in enumerate(embeddings):
        lo, hi = e.get_vision_token_range()
        owner[(ids >= lo) & (ids < hi)] = k
    is_img = owner >= 0
    prev = torch.cat([torch.tensor([-1]), owner[:-1]])
    prev_id = torch.cat([torch.tensor([-1]), ids[:-1]])
    start = is_img & ((prev != owner) | (ids != prev_id + 1))  # a new run: another image, or its ids restart
    runs = torch.cumsum(start.long(), 0) - 1
    return torch.where(is_img, runs, torch.full_like(runs, -1))


def extend_to_image_end(config: object, seq_ids: torch.Tensor, end: int, limit: int,
                        embeddings: list[ExLlamaV2MMEmbedding]) -> int:
    """A chunk end moved past the image it would cut (models whose image tokens attend both ways), <= limit."""
    if not embeddings or not config.spec.arch.image_bidirectional or end >= limit:  # type: ignore[attr-defined]
        return end
    blocks = image_blocks(seq_ids[:limit], embeddings)
    b = int(blocks[end - 1]) if end > 0 else -1
    while b >= 0 and end < limit and int(blocks[end]) == b:
        end += 1
    return end


def chunk_inputs(config: object, seq_ids: torch.Tensor, start: int, end: int,
                 embeddings: list[ExLlamaV2MMEmbedding]) -> MMInputs:
    """MMInputs for tokens [start, end) of the 1-D sequence `seq_ids` (whole: a chunk may end inside an image)."""
    mark("prefill: generator setup")
    sections = getattr(config.spec, "mrope_section", ())  # type: ignore[attr-defined]
    if config.spec.arch.image_bidirectional:  # type: ignore[attr-defined]
        out = MMInputs(embeddings, blocks=image_blocks(seq_ids, embeddings)[start:end].unsqueeze(0))
    elif not sections:
        out = MMInputs(embeddings)
    else:
        pos, _ = mrope_positions(seq_ids, embeddings)
        out = MMInputs(embeddings, mrope_cos_sin(config, pos[:, start:end], sections))
    mark("prefill: M-RoPE / image blocks")
    return out


def rope_delta(config: object, seq_ids: torch.Tensor, embeddings: list[ExLlamaV2MMEmbedding]) -> int:
    """The M-RoPE position shift of tokens after `seq_ids` (0 for models without M-RoPE or without images)."""
    if not embeddings or not getattr(config.spec, "mrope_section", ()):  # type: ignore[attr-defined]
        return 0
    return mrope_positions(seq_ids, embeddings)[1]


class RowsMM:
    """M-RoPE and embeddings for the rows of a model.forward call (ids [B, T], continuing at cache position
    `past`): each chunk's batch gets its rows' cos / sin (rows b * n + t) and matching rope_positions."""

    def __init__(self, config: object, ids: torch.Tensor, embeddings: list[ExLlamaV2MMEmbedding], past: int) -> None:
        self.config, self.embeddings, self.past = config, embeddings, past
        self.sections = tuple(getattr(config.spec, "mrope_section", ()))  # type: ignore[attr-defined]
        self.ids = ids
        self.blocks = None
        if config.spec.arch.image_bidirectional:  # type: ignore[attr-defined]
            self.blocks = torch.stack([image_blocks(r.cpu(), embeddings) for r in ids])
        self.pos = None
        if self.sections:
            self.pos = torch.stack([mrope_positions(r.cpu(), embeddings)[0] + past for r in ids])  # [B, 3, T]

    def chunk_end(self, start: int, end: int) -> int:
        """`end` moved past an image it would cut (bidirectional image attention), for every row."""
        if self.blocks is None:
            return end
        for row in self.ids:
            end = max(end, extend_to_image_end(self.config, row.cpu(), end, row.numel(), self.embeddings))
        return end

    def attach(self, batch: object, start: int, end: int, device: torch.device) -> None:
        if self.pos is None:
            blocks = self.blocks[:, start:end] if self.blocks is not None else None
            batch.mm = MMInputs(self.embeddings, blocks=blocks)  # type: ignore[attr-defined]
            return
        p = self.pos[:, :, start:end]
        B, n = p.shape[0], p.shape[2]
        cos, sin = mrope_cos_sin(self.config, p.permute(1, 0, 2).reshape(3, B * n), self.sections)
        batch.mm = MMInputs(self.embeddings, (cos, sin))  # type: ignore[attr-defined]
        batch.rope_positions = torch.arange(B * n, device=device).view(B, n)  # type: ignore[attr-defined]
