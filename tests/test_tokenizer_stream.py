"""StreamDecoder: token-by-token text that concatenates to decode(all ids), holding back incomplete UTF-8."""

from __future__ import annotations

import random

import pytest

from exlpy.tokenizer import ExLlamaV2Tokenizer, StreamDecoder
from tests.conftest import shared_path

TEXTS = [
    "Hello 😀 world! 中文字符 and emoji 🦙🔥 mixed; ünïcödé.\n\n  indented\tline",
    " leading space, then 👩‍👩‍👧 (a ZWJ family) and 한국어 텍스트",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math letters, 🇯🇵 flag, end with emoji 😀",
]


@pytest.fixture(scope="module", params=["llama2-spm", "llama2-json", "llama3", "aidreams"])
def tok(request: pytest.FixtureRequest) -> ExLlamaV2Tokenizer:
    if request.param == "llama2-spm":
        return ExLlamaV2Tokenizer(str(shared_path("tokenizers", "llama2")), force_spm=True)
    if request.param == "llama2-json":
        return ExLlamaV2Tokenizer(str(shared_path("tokenizers", "llama2")))
    if request.param == "llama3":
        return ExLlamaV2Tokenizer(str(shared_path("tokenizers", "llama3")))
    return ExLlamaV2Tokenizer(str(shared_path("models", "aidreams260K")))


def stream(tok: ExLlamaV2Tokenizer, ids: list[int], special: bool = False) -> list[str]:
    dec = tok.stream_decoder(decode_special_tokens=special)
    assert isinstance(dec, StreamDecoder)
    return [dec.add(i) for i in ids] + [dec.flush()]


def test_stream_equals_decode_on_text(tok: ExLlamaV2Tokenizer) -> None:
    for text in TEXTS:
        ids = tok.encode(text)[0].tolist()
        chunks = stream(tok, ids)
        assert "".join(chunks) == tok.decode(ids) == text
        if ids[-1] not in tok.backend.regroup_ids:
            assert chunks[-1] == ""  # the text is complete, so nothing was left for flush()
        assert not any("\ufffd" in c for c in chunks)  # partial characters were held, never emitted


def test_multibyte_characters_are_held(tok: ExLlamaV2Tokenizer) -> None:
    ids = tok.encode("a😀")[0].tolist()
    chunks = stream(tok, ids)
    # Byte-fallback (SPM) or byte-level (BPE) vocabularies spell the emoji with several ids or one merged id;
    # either way the emoji appears whole in exactly one chunk.
    assert sum("😀" in c for c in chunks) == 1 and "".join(chunks) == "a😀"
    if len(ids) > 2:  # split into byte tokens: all but the last byte produced nothing
        assert chunks[1:-2] == [""] * (len(ids) - 2)


def test_stream_specials(tok: ExLlamaV2Tokenizer) -> None:
    body = tok.encode(" Hi there 中")[0].tolist()
    ids = [tok.bos_token_id, *body, tok.eos_token_id, *body]
    for special in (False, True):
        assert "".join(stream(tok, ids, special)) == tok.decode(ids, decode_special_tokens=special)
    assert tok.eos_token in "".join(stream(tok, ids, True))


def test_stream_random_ids(tok: ExLlamaV2Tokenizer) -> None:
    """Random id sequences (unpaired byte tokens, lone spaces, specials) still concatenate to decode()."""
    rng = random.Random(1234)
    pieces = tok.id_to_piece
    byteish = [i for i, p in enumerate(pieces) if p.startswith("<0x") or len(p) == 1]
    for trial in range(30):
        pool = byteish if trial % 2 else range(tok.actual_vocab_size)
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 40))]
        special = trial % 3 == 0
        assert "".join(stream(tok, ids, special)) == tok.decode(ids, decode_special_tokens=special), ids


def test_feed_tensor(tok: ExLlamaV2Tokenizer) -> None:
    ids = tok.encode(TEXTS[0])
    dec = tok.stream_decoder()
    assert dec.feed(ids) + dec.flush() == TEXTS[0]
