"""TextStream with real tokenizers: partial UTF-8 held back, stop strings held and cut, banned-string rewinds."""

from __future__ import annotations

import pytest

from exlpy.generator.dynamic.stops import TextStream, tokenizer_decode
from exlpy.tokenizer import ExLlamaV2Tokenizer
from tests.conftest import shared_path


def load_tok(*parts: str) -> ExLlamaV2Tokenizer:
    return ExLlamaV2Tokenizer(str(shared_path(*parts)))


def stream_for(tok: ExLlamaV2Tokenizer, stops: list[str] | None = None, banned: list[str] | None = None,
               stop_tokens: set[int] | None = None) -> TextStream:
    return TextStream(tok.get_id_to_piece_list(True), lambda t: tokenizer_decode(tok, t, False),
                      stop_tokens or set(), stops or [], banned, set(tok.extended_id_to_piece))


@pytest.mark.parametrize("where", [("tokenizers", "llama2"), ("models", "smollm2-135m-exl2-4.0"),
                                   ("models", "aidreams260K")])
def test_partial_utf8_is_held_until_complete(where: tuple[str, str]) -> None:
    tok = load_tok(*where)
    text = "Say \u2713 and h\u00e9llo \U0001f600 ok \u4e2d\u6587!"
    ids = tok.encode(text)[0].tolist()
    pieces = tok.get_id_to_piece_list(True)
    assert any("\ufffd" in pieces[i] for i in ids), "the text must need byte-level / byte-fallback tokens"
    ts = stream_for(tok)
    out = []
    for i in ids:
        rel = ts.add(i)
        assert "\ufffd" not in rel.text
        out.append(rel.text)
    out.append(ts.flush().text)
    # SentencePiece decoders strip the text's leading space; the stream keeps it like a continuation would.
    assert "".join(out).lstrip() == text.lstrip()


def test_stop_string_split_over_tokens_is_held_then_cut() -> None:
    tok = load_tok("tokenizers", "llama2")
    ids = tok.encode("The answer is here. STOP now please")[0].tolist()
    ts = stream_for(tok, stops=["STOP now"])
    emitted = ""
    last = None
    for i in ids:
        last = ts.add(i)
        emitted += last.text
        assert "ST" not in emitted
        if last.eos:
            break
    assert last is not None and last.eos and last.eos_reason == "stop_string" and last.trigger == "STOP now"
    assert emitted == " The answer is here. "


def test_stop_token_flushes_held_text() -> None:
    tok = load_tok("tokenizers", "llama2")
    ids = tok.encode("wait for it")[0].tolist()
    ts = stream_for(tok, stops=["it is"], stop_tokens={tok.eos_token_id})
    got = "".join(ts.add(i).text for i in ids)
    assert not got.endswith("it")  # "it" could still become "it is": held
    rel = ts.add(tok.eos_token_id)
    assert rel.eos and rel.eos_reason == "stop_token" and rel.tokens[-1] == tok.eos_token_id
    assert got + rel.text == " wait for it"


def test_banned_string_requests_rewind_to_where_it_began() -> None:
    tok = load_tok("tokenizers", "llama2")
    ids = tok.encode("I like pineapples a lot")[0].tolist()
    pieces = tok.get_id_to_piece_list(True)
    ts = stream_for(tok, banned=["APPLE"])
    emitted = ""
    fed = 0
    for i in ids:
        rel = ts.add(i)
        fed += 1
        emitted += rel.text
        if rel.rewind:
            break
    else:
        pytest.fail("banned string was not detected")
    # The match began inside token j: rewind to it and ban it there.
    offsets = [len("".join(pieces[t] for t in ids[:k])) for k in range(len(ids))]
    m = "".join(pieces[t] for t in ids).lower().find("apple")
    j = max(k for k, o in enumerate(offsets) if o <= m)
    assert fed - rel.rewind == j and rel.ban == ids[j]
    assert "apple" not in emitted.lower() and emitted.strip().startswith("I like")
