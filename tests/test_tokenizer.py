"""ExLlamaV2Tokenizer on real tokenizers: llama.cpp's test vectors, special tokens, padding, pieces."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exlpy.errors import TokenizerError
from exlpy.tokenizer import ExLlamaV2Tokenizer
from tests.conftest import shared_path

SEPARATOR = "\n__ggml_vocab_test__\n"


def load_vectors(name: str) -> list[tuple[str, list[int]]]:
    """(text, ids) pairs of a llama.cpp vocab test. Every string, the last one included, ends with the
    separator, so the split leaves one empty tail that is not a test case; empty strings inside are real."""
    base = shared_path("tokenizers", "testvectors-llamacpp")
    texts = (base / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8")
    lines = (base / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")
    assert texts.endswith(SEPARATOR) and lines[-1] == ""
    texts_list = texts[: -len(SEPARATOR)].split(SEPARATOR)
    lines = lines[:-1]
    assert len(texts_list) == len(lines) > 40
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts_list, lines)]


@pytest.fixture(scope="module")
def llama3() -> ExLlamaV2Tokenizer:
    return ExLlamaV2Tokenizer(str(shared_path("tokenizers", "llama3")))


@pytest.fixture(scope="module")
def qwen3() -> ExLlamaV2Tokenizer:
    return ExLlamaV2Tokenizer(str(shared_path("tokenizers", "qwen3")))


@pytest.fixture(scope="module")
def llama2_json() -> ExLlamaV2Tokenizer:
    return ExLlamaV2Tokenizer(str(shared_path("tokenizers", "llama2")))


@pytest.fixture(scope="module")
def llama2_spm() -> ExLlamaV2Tokenizer:
    return ExLlamaV2Tokenizer(str(shared_path("tokenizers", "llama2")), force_spm=True)


@pytest.mark.parametrize(("vectors", "fixture"), [
    ("llama-bpe", "llama3"), ("qwen2", "qwen3"), ("llama-spm", "llama2_json"), ("llama-spm", "llama2_spm"),
])
def test_llamacpp_vectors(vectors: str, fixture: str, request: pytest.FixtureRequest) -> None:
    tok: ExLlamaV2Tokenizer = request.getfixturevalue(fixture)
    cases = load_vectors(vectors)
    assert ("", []) in cases  # the empty string encodes to nothing, not to a lone space/BOS
    for text, expected in cases:
        ids = tok.encode(text)
        assert ids.dtype == torch.long and ids.shape == (1, len(expected)), repr(text)
        assert ids[0].tolist() == expected, repr(text)
        assert tok.num_tokens(text) == len(expected)


def test_backends(llama2_json: ExLlamaV2Tokenizer, llama2_spm: ExLlamaV2Tokenizer) -> None:
    assert llama2_json.backend.kind == "json" and llama2_spm.backend.kind == "spm"
    # The same model through both libraries: identical ids, specials, text and per-id pieces.
    text = "Hi <s> there</s>\n\n  spaced  🦙 über 中文 <unk>"
    for special in (False, True):
        a = llama2_json.encode(text, encode_special_tokens=special)
        b = llama2_spm.encode(text, encode_special_tokens=special)
        assert a.tolist() == b.tolist()
        for dec_special in (False, True):
            assert llama2_json.decode(a[0], dec_special) == llama2_spm.decode(b[0], dec_special)
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "newline_token_id", "space_token_id",
                 "actual_vocab_size", "bos_token", "eos_token"):
        assert getattr(llama2_json, attr) == getattr(llama2_spm, attr), attr
    assert llama2_spm.get_id_to_piece_list() == llama2_json.get_id_to_piece_list()
    assert llama2_spm.id_to_piece == llama2_json.id_to_piece


def test_special_tokens_llama3(llama3: ExLlamaV2Tokenizer) -> None:
    bot = "<|begin_of_text|>"
    assert llama3.bos_token_id == 128000 and llama3.bos_token == bot
    assert llama3.eos_token_id == 128001 and llama3.eos_token == "<|end_of_text|>"
    assert llama3.extended_piece_to_id[bot] == 128000 and llama3.extended_id_to_piece[128009] == "<|eot_id|>"
    plain = llama3.encode(bot + "Hi")[0].tolist()
    special = llama3.encode(bot + "Hi", encode_special_tokens=True)[0].tolist()
    assert special == [128000, 13347]
    assert len(plain) > 3 and 128000 not in plain
    assert llama3.decode(plain) == bot + "Hi"  # as text it round-trips
    assert llama3.decode(special) == "Hi"  # specials are hidden unless asked for
    assert llama3.decode(special, decode_special_tokens=True) == bot + "Hi"
    assert llama3.single_id("<|eot_id|>") == 128009
    assert llama3.single_id("\n") == llama3.newline_token_id == 198
    assert llama3.space_token_id == 220 and llama3.actual_vocab_size == 128256
    assert llama3.single_id("hello world, this is several tokens") is None  # exllamav2: None, not an error
    ids = llama3.encode("Hello", add_bos=True, add_eos=True)[0].tolist()
    assert ids[0] == 128000 and ids[-1] == 128001 and llama3.decode(ids) == "Hello"
    assert llama3.single_token(42).tolist() == [[42]]


def test_unspecial_added_tokens_qwen3(qwen3: ExLlamaV2Tokenizer) -> None:
    # <think> is an added token without the special flag: always one id, always decoded as text.
    think = qwen3.unspecial_piece_to_id["<think>"]
    assert qwen3.encode("<think>x")[0].tolist()[0] == think
    assert qwen3.decode([think, 87]) == "<think>x"
    im_end = qwen3.extended_piece_to_id["<|im_end|>"]
    assert qwen3.eos_token_id == im_end and im_end in qwen3.stop_token_ids
    assert im_end not in qwen3.encode("<|im_end|>")[0].tolist()
    assert qwen3.encode("<|im_end|>", encode_special_tokens=True)[0].tolist() == [im_end]
    assert qwen3.pad_token_id == qwen3.extended_piece_to_id["<|endoftext|>"]


def test_batch_padding_and_offsets(llama3: ExLlamaV2Tokenizer) -> None:
    texts = ["a", "The quick brown fox", "jumps over"]
    ids, offsets = llama3.encode(texts, add_bos=True, return_offsets=True)
    lens = [llama3.encode(t, add_bos=True).shape[1] for t in texts]
    assert ids.shape == (3, max(lens)) and ids.dtype == torch.long
    assert offsets.tolist() == [n - max(lens) for n in lens] and offsets.dtype == torch.int32
    for row, n, t in zip(ids, lens, texts):
        assert (row[: max(lens) - n] == llama3.pad_token_id).all()
        assert row[max(lens) - n:].tolist() == llama3.encode(t, add_bos=True)[0].tolist()
    assert llama3.decode(ids) == texts
    mask = llama3.padding_mask(ids)
    assert mask.dtype == torch.float16 and mask.shape == ids.shape
    assert torch.isneginf(mask).eq(ids == llama3.pad_token_id).all() and (mask[:, -1] == 0).all()
    one, off = llama3.encode("x", return_offsets=True)
    assert one.shape == (1, 1) and off.tolist() == [0]


def test_pieces_and_prefixes(llama3: ExLlamaV2Tokenizer, llama2_spm: ExLlamaV2Tokenizer) -> None:
    for tok in (llama3, llama2_spm):
        pieces = tok.get_id_to_piece_list()
        assert len(pieces) == tok.actual_vocab_size
        assert pieces[tok.space_token_id] == " " and pieces[tok.newline_token_id] == "\n"
        assert pieces[tok.bos_token_id] == ""
        assert tok.get_id_to_piece_list(True)[tok.bos_token_id] == tok.bos_token
        the = tok.encode("the cat sat")[0].tolist()[2]  # " sat": a mid-text piece keeps its leading space
        assert pieces[the] == " sat"
        assert tok.get_piece_to_id_dict()[" sat"] == the
        with_prefix = tok.get_tokens_with_prefix_string(" sa")
        assert the in with_prefix and all(pieces[i].startswith(" sa") for i in with_prefix)
        assert len(with_prefix) == sum(p.startswith(" sa") for p in pieces)
        healed = tok.get_tokens_with_prefix_id(the)
        assert the in healed and all(pieces[i].startswith(" sat") for i in healed)
    assert llama3.id_to_piece[220] == "Ġ" and llama3.piece_to_id["Ġthe"] == 279
    assert llama2_spm.id_to_piece[13] == "<0x0A>" and llama2_spm.piece_to_id["▁the"] == 278
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        llama3.get_tokens_with_prefix_id(10**7)


def test_decode_filters(llama3: ExLlamaV2Tokenizer) -> None:
    ids = llama3.encode("Hello world")[0].tolist()
    eot = llama3.single_id("<|eot_id|>")
    seq = [llama3.pad_token_id, *ids, eot, llama3.eos_token_id, 999_999, -5]
    assert llama3.decode(seq) == "Hello world"
    # Shown specials: the leading pad (left padding) is stripped, the EOS after <|eot_id|> is shown although
    # this pad id is EOS.
    assert llama3.decode(torch.tensor(seq), True) == "Hello world<|eot_id|><|end_of_text|>"
    assert llama3.decode([[*ids], [ids[0]]]) == ["Hello world", "Hello"]
    assert llama3.decode([torch.tensor(ids), torch.tensor(ids[:1])]) == ["Hello world", "Hello"]
    assert llama3.decode([]) == ""


def test_cached_encode(llama3: ExLlamaV2Tokenizer) -> None:
    a = llama3.cached_encode_str("stop here")
    assert a is llama3.cached_encode_str("stop here") and a.tolist() == llama3.encode("stop here").tolist()
    for i in range(150):
        llama3.cached_encode_str(f"s{i}")
    assert len(llama3.tokenized_str_cache) == llama3.max_cached_strings == 100
    assert "stop here" not in llama3.tokenized_str_cache


def test_bad_input(llama3: ExLlamaV2Tokenizer) -> None:
    with pytest.raises(TokenizerError, match="str or a list of str"):
        llama3.encode(123)  # type: ignore[arg-type]
    with pytest.raises(TokenizerError, match="str or a list of str"):
        llama3.encode(["ok", None])  # type: ignore[list-item]
    with pytest.raises(TokenizerError, match="empty list"):
        llama3.encode([])
    with pytest.raises(TokenizerError, match="shape"):
        llama3.decode(torch.zeros(1, 2, 3, dtype=torch.long))
    with pytest.raises(TokenizerError, match="integer ids"):
        llama3.decode(torch.ones(3))
    with pytest.raises(TokenizerError, match="integer ids"):
        llama3.decode(["a", "b"])  # type: ignore[list-item]


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="does not exist"):
        ExLlamaV2Tokenizer(str(tmp_path / "nope"))
    with pytest.raises(TokenizerError, match="tokenizer.json or tokenizer.model"):
        ExLlamaV2Tokenizer(str(tmp_path))
    with pytest.raises(TokenizerError, match="tokenizer.model"):
        ExLlamaV2Tokenizer(str(tmp_path), force_spm=True)
    with pytest.raises(TokenizerError, match="both"):
        ExLlamaV2Tokenizer(str(tmp_path), force_json=True, force_spm=True)
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        ExLlamaV2Tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nonsense"}}')
    with pytest.raises(TokenizerError, match="not a valid tokenizers file.*tokenizer.json"):
        ExLlamaV2Tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.model").write_bytes(b"not a protobuf at all")
    with pytest.raises(TokenizerError, match="tokenizer.model"):
        ExLlamaV2Tokenizer(str(tmp_path), force_spm=True)


def test_tiny_models_round_trip() -> None:
    from exlpy.config import ExLlamaV2Config

    text = "Echoes of vectors unfold, a gentle hum of precision.\n  def f(x):\n\treturn x * 2  # ünïcode ✓"
    for name in ("aidreams260K", "smollm2-135m-exl2-4.0"):
        config = ExLlamaV2Config(str(shared_path("models", name)))
        tok = ExLlamaV2Tokenizer(config, lazy_init=False)
        assert (tok.bos_token_id, tok.eos_token_id) == (config.bos_token_id, config.eos_token_id) == (1, 2)
        ids = tok.encode(text, add_bos=True)
        assert ids[0, 0].item() == 1 and tok.decode(ids[0]) == text and tok.decode(ids) == [text]
        assert int(ids.max()) < tok.actual_vocab_size <= config.vocab_size
        assert tok.stop_token_ids >= {2}
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id == 2  # smollm2: config.json says pad 2


def test_ids_from_tokenizer_config(tmp_path: Path) -> None:
    """Without config.json, BOS/EOS/PAD come from tokenizer_config.json, as a string or a {content} dict."""
    src = shared_path("models", "smollm2-135m-exl2-4.0")
    (tmp_path / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(
        '{"bos_token": {"content": "<|endoftext|>"}, "eos_token": "<reponame>"}')
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 5]}')
    tok = ExLlamaV2Tokenizer(str(tmp_path))
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 4)
    assert tok.pad_token_id == 4  # no <pad> in the vocabulary and EOS != BOS
    assert tok.stop_token_ids == {2, 4, 5}
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "config.json").write_text('{"bos_token_id": 5, "eos_token_id": [7, 8]}')
    tok = ExLlamaV2Tokenizer(str(tmp_path))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (5, 7, 7)
    assert tok.stop_token_ids == {7, 8, 2, 5}
    (tmp_path / "config.json").write_text("{}")
    tok = ExLlamaV2Tokenizer(str(tmp_path))
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)  # the exllamav2 defaults
    (tmp_path / "config.json").write_text('{"bos_token_id": 5, "eos_token_id": 5}')
    tok = ExLlamaV2Tokenizer(str(tmp_path))
    assert tok.pad_token_id == -1  # EOS == BOS and no <pad>: no padding id at all
    assert tok.encode(["same", "same"]).shape == (2, 1)
    with pytest.raises(TokenizerError, match="no pad token"):
        tok.encode(["a", "several more tokens"])


def test_mistral_spm_matches_json(tmp_path: Path) -> None:
    """Mistral ships tokenizer.model as tokenizer.model.v1; under the usual name it agrees with tokenizer.json."""
    src = shared_path("tokenizers", "mistral")
    for name, link in (("tokenizer.json", "tokenizer.json"), ("tokenizer_config.json", "tokenizer_config.json"),
                       ("tokenizer.model.v1", "tokenizer.model")):
        (tmp_path / link).symlink_to(src / name)
    js, sp = ExLlamaV2Tokenizer(str(tmp_path)), ExLlamaV2Tokenizer(str(tmp_path), force_spm=True)
    texts = [t for t, _ in load_vectors("llama-spm")] + ["[INST] hi <s> there </s>[/INST]"]
    for text in texts:
        for special in (False, True):
            ids = js.encode(text, encode_special_tokens=special)[0].tolist()
            assert ids == sp.encode(text, encode_special_tokens=special)[0].tolist(), repr(text)
            assert js.decode(ids, special) == sp.decode(ids, special)
    assert (js.bos_token_id, js.eos_token_id, js.pad_token_id) == (sp.bos_token_id, sp.eos_token_id,
                                                                    sp.pad_token_id) == (1, 2, 2)
