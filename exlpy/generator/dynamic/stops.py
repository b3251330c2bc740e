"""Turning sampled tokens into released text: stop tokens/strings, banned strings, held text, partial UTF-8.

Both generators feed every sampled token to a `TextStream` and emit only what it releases. Text is held back
while it could still turn into a stop string (the stop string itself is never emitted), while it could still
turn into a banned string (a full match asks the caller to rewind to the token where the match began and ban
that token there), and while it ends in an incomplete UTF-8 sequence (byte-fallback tokens decode to U+FFFD
alone; decoded together they form the real character).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

REPLACEMENT = "\ufffd"
MAX_PARTIAL_TOKENS = 8  # a longer run of undecodable bytes is invalid UTF-8, not a partial character


@dataclass
class Released:
    """What one step (or a flush) lets out."""

    text: str = ""
    tokens: list[int] = field(default_factory=list)
    payloads: list[Any] = field(default_factory=list)
    eos: bool = False
    eos_reason: str | None = None
    trigger: int | str | None = None
    rewind: int = 0  # tokens the caller must drop from the end of its sequence
    ban: int | None = None  # token the caller must ban at the position it rewound to
    suppressed_text: str = ""  # on a rewind: the text (and tokens) of the banned match that was dropped
    suppressed_tokens: list[int] = field(default_factory=list)
    held_text: str = ""  # at a stop string: the text held back when it matched (the stop string and after)
    held_tokens: list[int] = field(default_factory=list)  # ... and the tokens that text came from


def tokenizer_decode(tokenizer: Any, ids: list[int], decode_special_tokens: bool) -> str:
    """Decode a short id list with the exllamav2-style tokenizer API (1-D tensor in, str out)."""
    out = tokenizer.decode(torch.tensor(ids, dtype=torch.long), decode_special_tokens=decode_special_tokens)
    return out[0] if isinstance(out, list) else out


def heal_split(ids: torch.Tensor, pieces: list[str], token_healing: bool) -> tuple[torch.Tensor, int | None, int]:
    """Token healing: the prompt (1-D) without its last token, that token (the first sampled token must start
    with its piece) and the length of its piece (text the TextStream strips from the front). Unchanged prompt,
    None and 0 without healing or for a one-token prompt."""
    if not token_healing or ids.numel() < 2:
        return ids, None, 0
    prefix = int(ids[-1])
    return ids[:-1], prefix, len(pieces[prefix])


def token_payload(prob: torch.Tensor, top_tokens: torch.Tensor, top_probs: torch.Tensor, logits: torch.Tensor,
                  with_prob: bool, top_k: int, with_logits: bool) -> dict[str, Any]:
    """The per-token extras a result may carry, from one sampler call (`logits`: the row sampled from, [V])."""
    payload: dict[str, Any] = {}
    if with_prob:
        payload["prob"] = float(prob.view(-1)[0])
    if top_k:
        payload["top_tokens"] = top_tokens.view(1, -1)[0].clone()
        payload["top_probs"] = top_probs.view(1, -1)[0].clone()
    if with_logits:
        payload["logits"] = logits.reshape(-1).clone()
    return payload


def split_stop_conditions(conditions: Iterable[int | str] | None) -> tuple[set[int], list[str]]:
    tokens: set[int] = set()
    strings: list[str] = []
    for c in conditions or []:
        if isinstance(c, str):
            if c:
                strings.append(c)
        elif isinstance(c, int):
            tokens.add(int(c))
        else:
            from exlpy.errors import GeneratorError

            raise GeneratorError(f"stop condition {c!r} is neither a token id (int) nor a string")
    return tokens, strings


def _partial_suffix(text: str, targets: list[str]) -> bool:
    """Whether `text` ends with a proper prefix of one of `targets` (so more text could complete it)."""
    for s in targets:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                return True
    return False


def _first_match(text: str, targets: list[str]) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for s in targets:
        i = text.find(s)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


class TextStream:
    """Per-sequence held state. `pieces` is the tokenizer's id->piece list (special tokens included)."""

    def __init__(self, pieces: list[str], decode: Callable[[list[int]], str], stop_tokens: set[int],
                 stop_strings: list[str], banned_strings: list[str] | None = None,
                 special_ids: set[int] | None = None, decode_special_tokens: bool = False,
                 strip_first: int = 0) -> None:
        self.pieces = pieces
        self.decode = decode
        self.stop_tokens = stop_tokens
        self.stop_strings = list(stop_strings)
        self.banned = [b.lower() for b in banned_strings or [] if b]
        self.hidden = set() if decode_special_tokens else set(special_ids or ())
        self.strip_first = strip_first  # token healing: the first token repeats the removed prompt piece
        self.held: list[tuple[int, str, Any]] = []
        self.first = True

    def _piece(self, token: int) -> str:
        if token in self.hidden or token >= len(self.pieces) or token < 0:
            return ""
        text = self.pieces[token]
        if self.first:
            self.first = False
            text = text[self.strip_first:]
        return text

    def held_text(self) -> tuple[str, list[int], bool]:
        """(held text, char offset of each held token, whether it ends in an incomplete character)."""
        texts = [t for _, t, _ in self.held]
        j = next((i for i, t in enumerate(texts) if REPLACEMENT in t), None)
        partial = False
        if j is not None:
            # Byte-fallback pieces are U+FFFD alone; the run from the first one decodes as a whole.
            tail = self.decode([tok for tok, _, _ in self.held[j:] if tok not in self.hidden])
            texts = texts[:j] + [tail] + [""] * (len(texts) - j - 1)
            partial = REPLACEMENT in tail[-4:] and len(self.held) - j < MAX_PARTIAL_TOKENS
        offsets, pos = [], 0
        for t in texts:
            offsets.append(pos)
            pos += len(t)
        return "".join(texts), offsets, partial

    def add(self, token: int, payload: Any = None) -> Released:
        if token in self.stop_tokens:
            out = self.flush()
            out.tokens.append(token)
            out.payloads.append(payload)
            out.eos, out.eos_reason, out.trigger = True, "stop_token", token
            return out
        self.held.append((token, self._piece(token), payload))
        text, offsets, partial = self.held_text()

        stop = _first_match(text, self.stop_strings)
        if stop is not None:
            j = max(i for i, o in enumerate(offsets) if o <= stop[0])
            held_tokens = [tok for tok, _, _ in self.held[j:]]
            out = self._take_all()
            out.text = text[:stop[0]]
            out.held_text, out.held_tokens = text[stop[0]:], held_tokens
            out.eos, out.eos_reason, out.trigger = True, "stop_string", stop[1]
            return out

        if self.banned:
            low = text.lower()
            hit = _first_match(low, self.banned)
            if hit is not None:
                j = max(i for i, o in enumerate(offsets) if o <= hit[0])
                dropped = [tok for tok, _, _ in self.held[j:]]
                del self.held[j:]
                return Released(rewind=len(dropped), ban=dropped[0], suppressed_text=text[offsets[j]:],
                                suppressed_tokens=dropped)
            if _partial_suffix(low, self.banned):
                return Released()

        if partial or _partial_suffix(text, self.stop_strings):
            return Released()
        out = self._take_all()
        out.text = text
        return out

    def _take_all(self) -> Released:
        out = Released(tokens=[t for t, _, _ in self.held], payloads=[p for _, _, p in self.held])
        self.held = []
        return out

    def flush(self) -> Released:
        """Release everything held (end of generation for a reason other than a stop string)."""
        text, _, _ = self.held_text()
        out = self._take_all()
        out.text = text
        return out

    def end(self, rel: Released, reason: str) -> Released:
        """`rel` (this step's release) followed by everything still held, marked as the end of generation."""
        rest = self.flush()
        rel.text += rest.text
        rel.tokens += rest.tokens
        rel.payloads += rest.payloads
        rel.eos, rel.eos_reason = True, reason
        return rel
