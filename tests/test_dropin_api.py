"""exllamav2 API additions: config runtime attributes, model methods (list of caches, forward_chunk, ...),
tokenizer additions, generator additions, unknown keywords rejected by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Tokenizer
from exlpy.errors import (
    CacheError,
    ConfigError,
    DraftModelError,
    GeneratorError,
    LoraConfigError,
    ModelStateError,
    MultimodalError,
    NotSupportedError,
    UnknownArgumentError,
)
from exlpy.generator import (
    ExLlamaV2BaseGenerator,
    ExLlamaV2DynamicGenerator,
    ExLlamaV2DynamicJob,
    ExLlamaV2Sampler,
    ExLlamaV2StreamingGenerator,
)
from tests.conftest import rel_err, shared_path
from tests.test_generator_helpers import aidreams, argmax_tokens

GREEDY = ExLlamaV2Sampler.Settings.greedy()


def tiny() -> tuple[ExLlamaV2, ExLlamaV2Tokenizer]:
    config = ExLlamaV2Config(str(shared_path("models", "tiny-llama-fp16")))
    config.max_seq_len = 256
    model = ExLlamaV2(config)
    model.load()
    return model, ExLlamaV2Tokenizer(config)


# --- config -----------------------------------------------------------------------------------------------------
def test_rope_attributes_read_config_json_and_validate(tmp_path: Path) -> None:
    from tests.hf_models import make_hf_model

    make_hf_model(tmp_path, "llama", rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 64})
    c = ExLlamaV2Config(str(tmp_path))
    assert (c.alt_rope_method, c.yarn_rope_factor, c.yarn_rope_original_max_position_embeddings) == ("yarn", 4.0, 64)
    assert c.l3_rope_factor is None and c.rotary_embedding_base == 10000.0
    c.alt_rope_method = None  # back to plain RoPE
    assert c.spec.rope_scaling.kind == "default"
    c.rotary_embedding_base = 5e5
    assert c.spec.rope_theta == 5e5
    with pytest.raises(ConfigError, match="must be one of"):
        c.alt_rope_method = "ntk"
    with pytest.raises(NotSupportedError, match="LongRoPE"):
        c.alt_rope_method = "su"
    with pytest.raises(NotSupportedError, match="LongRoPE"):
        c.scale_long_factor = [1.0]
    with pytest.raises(ConfigError, match="positive number"):
        c.yarn_rope_factor = -2
    c.alt_rope_method = "llama3"  # scripts set the method first, then its values: not an error yet...
    model = ExLlamaV2(c)
    model.load(device="cpu")
    with pytest.raises(ConfigError, match="config.l3_rope_factor, .* is not set"):
        model.forward(torch.zeros(1, 3, dtype=torch.long))  # ...until the RoPE tables are built from it
    c.prepare()  # idempotent: does not reset settings


def test_architecture_values_are_read_only_and_unsupported_knobs_raise() -> None:
    c = ExLlamaV2Config(str(shared_path("models", "tiny-llama-fp16")))
    with pytest.raises(ConfigError, match="config.num_hidden_layers comes from the model's config.json"):
        c.num_hidden_layers = 4
    with pytest.raises(NotSupportedError, match="load_in_q4"):
        c.load_in_q4 = True
    c.load_in_q4 = False
    with pytest.raises(ConfigError, match="no experts"):
        c.num_experts_per_token = 2
    c.scale_alpha_value = None  # exllamav2 scripts pass None for "no scaling"
    assert c.scale_alpha_value == 1.0 and c.num_experts is None and c.vision_model_type is None


def test_rope_settings_frozen_while_loaded() -> None:
    config = ExLlamaV2Config(str(shared_path("models", "tiny-llama-fp16")))
    config.max_seq_len = 128
    model = ExLlamaV2(config)
    model.load()
    ids = torch.randint(0, 512, (1, 100), generator=torch.Generator().manual_seed(0))
    before = model.forward(ids)
    with pytest.raises(ModelStateError, match=r"config.scale_alpha_value cannot change while a model"):
        config.scale_alpha_value = 2.0
    model.unload()
    config.scale_alpha_value = 2.0  # allowed between loads, and used by the next load
    model.load()
    assert rel_err(model.forward(ids), before) > 1e-3


# --- model ------------------------------------------------------------------------------------------------------
def test_forward_with_a_list_of_caches() -> None:
    model, _ = tiny()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (1, n), generator=g) for n in (5, 9, 3)]
    caches = [ExLlamaV2Cache(model, max_seq_len=64) for _ in prompts]
    refs = [ExLlamaV2Cache(model, max_seq_len=64) for _ in prompts]
    for p, c, r in zip(prompts, caches, refs):
        assert model.forward(p, [c], preprocess_only=True) is None
        model.forward(p, r, preprocess_only=True)
    step = torch.randint(0, 512, (3, 2), generator=g)
    logits, state = model.forward(step, caches, return_last_state=True)
    expect = torch.cat([model.forward(step[i:i + 1], refs[i]) for i in range(3)])
    assert logits.shape == (3, 2, 512) and state.shape == (3, 2, model.config.hidden_size)
    assert rel_err(logits, expect) <= 1e-5
    assert [c.current_seq_len for c in caches] == [7, 11, 5]
    one = torch.randint(0, 512, (3, 1), generator=g)  # decode steps (CUDA-graph replays on a GPU)
    for _ in range(2):
        got = model.forward(one, caches)
        want = torch.cat([model.forward(one[i:i + 1], refs[i]) for i in range(3)])
        assert rel_err(got, want) <= 1e-3
    assert [c.current_seq_len for c in caches] == [9, 13, 7]
    with pytest.raises(CacheError, match="2 caches for 3 input rows"):
        model.forward(step, caches[:2])
    with pytest.raises(CacheError, match="appears twice"):
        model.forward(step, [caches[0], caches[0], caches[1]])
    with pytest.raises(CacheError, match="item 1 is a str"):
        model.forward(step[:2], [caches[0], "cache"])


def test_forward_rejects_unknown_keywords_by_name() -> None:
    model, _ = tiny()
    ids = torch.randint(0, 512, (1, 4))
    with pytest.raises(UnknownArgumentError, match="unexpected keyword argument 'last_ids_only'"):
        model.forward(ids, last_ids_only=True)
    with pytest.raises(MultimodalError, match="ExLlamaV2MMEmbedding"):
        model.forward(ids, indexed_embeddings=torch.zeros(1))
    with pytest.raises(UnknownArgumentError, match="multiple values for argument 'input_mask'"):
        model.forward(ids, None, None, input_mask=None, foo=1)
    with pytest.raises(LoraConfigError, match="ExLlamaV2Lora objects"):
        model.forward(ids, loras=["adapter"])


def test_model_methods() -> None:
    model, _ = tiny()
    assert model.get_modules() == model.modules and model.get_modules() is not model.modules
    assert not model.is_quant()
    quant = ExLlamaV2(ExLlamaV2Config(str(shared_path("models", "tiny-llama-exl2-4.0"))))
    assert quant.is_quant()  # from the files, before loading
    assert model.get_cache_devices() == [model.modules[1].device]  # one device: where load() put the layers
    model.cache_map.clear()
    model.set_cache_map()
    assert sorted(model.cache_map) == list(range(model.config.num_hidden_layers))
    ids = torch.randint(0, 512, (1, 6))
    cache = ExLlamaV2Cache(model, max_seq_len=32)
    r = model.forward_chunk(ids, cache, return_last_state=True)
    assert set(r) == {"logits", "last_state"} and rel_err(r["logits"], model.forward(ids)) <= 1e-5
    assert cache.current_seq_len == 6 and model.forward_chunk(ids, cache, preprocess_only=True) == {}
    assert model.update_loras() is None  # adapters are applied per call: nothing to refresh
    for call in (model.drop_device_context, model.free_device_context, lambda: model.get_device_context(0),
                 lambda: model.forward_chunk(ids, attn_params=object())):
        with pytest.raises(NotSupportedError):
            call()


# --- tokenizer --------------------------------------------------------------------------------------------------
def test_tokenizer_backend_object_and_tables() -> None:
    from exlpy.tokenizer import ExLlamaV2TokenizerBase, ExLlamaV2TokenizerHF

    tok = ExLlamaV2Tokenizer(str(shared_path("models", "smollm2-135m-exl2-4.0")))
    m = tok.tokenizer
    assert tok.tokenizer_model is m and isinstance(m, ExLlamaV2TokenizerHF) and isinstance(m, ExLlamaV2TokenizerBase)
    assert m.vocab_size() == tok.get_vocab_size() == 49152 and m.hf_tokenizer.get_vocab_size() == 49152
    assert m.space_char() == "Ġ" and m.newline_char() == "Ċ" and m.bos_id() is None and tok.unk_token_id is None
    hello = tok.encode("Hello")[0].tolist()
    assert m.id_to_piece(hello[0]) == "Hello" and m.piece_to_id("Hello") == hello[0]
    assert m.piece_to_id("no such piece \u2603") is None
    assert m.encode("<|im_start|>Hi") == tok.encode_special("<|im_start|>Hi") == [1, tok.single_id("Hi")]
    assert tok.encode_unspecial("<|im_start|>")[0] != 1 and m.decode([1] + hello) == "Hello"
    vocab = dict(m.enumerate_tokens())
    assert vocab[hello[0]] == "Hello" and vocab[1] == "" and len(vocab) == 49152
    assert tok.single_id("not one single token at all") is None and tok.single_id("<|im_end|>") == 2
    ords = tok.get_id_to_ord_list()
    assert ords[tok.single_id("a")] == ord("a") and ords[tok.single_id(" ")] == 32 and ords[hello[0]] == -1
    trie = tok.get_char_trie()
    node = trie
    for ch in "Hello":
        node = node.children[ch]
    assert hello[0] in node.leaf and isinstance(trie, ExLlamaV2Tokenizer.Trie)
    small = ExLlamaV2Tokenizer(str(shared_path("models", "aidreams260K")))
    ci, pieces = small.get_char_trie_ci(), small.get_id_to_piece_list()
    some = next(i for i, p in enumerate(pieces) if p.lower() != p)  # a piece with a capital letter
    node = ci
    for ch in pieces[some].lower():
        node = node.children[ch]
    assert some in node.leaf
    prefix = tok.get_prefix_to_ids_dict()
    assert hello[0] in prefix["Hel"] and all(tok.get_id_to_piece_list()[i].startswith("Hel") for i in prefix["Hel"])
    assert tok.get_prefix_id_to_ids_dict()[hello[0]] == prefix["Hello"]


def test_standalone_hf_wrapper_and_spm_flavour() -> None:
    from exlpy.tokenizer import ExLlamaV2TokenizerHF, ExLlamaV2TokenizerSPM

    d = shared_path("tokenizers", "llama2")
    hf = ExLlamaV2TokenizerHF(str(d / "tokenizer.json"))
    spm = ExLlamaV2Tokenizer(str(d), force_spm=True).tokenizer
    assert isinstance(spm, ExLlamaV2TokenizerSPM)
    for m in (hf, spm):
        ids = m.encode("Hello world\n")
        assert [m.id_to_piece(i) for i in ids] == ["▁Hello", "▁world", "<0x0A>"]
        assert m.unk_id() == 0 and m.unk_token() == "<unk>" and m.space_char() == "▁" and m.newline_char() == "\n"
        assert m.id_to_ord(13) == 10 and m.piece_to_ord("▁") == 32


# --- generators -------------------------------------------------------------------------------------------------
def test_streaming_generator_is_a_base_generator() -> None:
    model, tok = aidreams()
    cache = ExLlamaV2Cache(model, max_seq_len=128)
    gen = ExLlamaV2StreamingGenerator(model, cache, tok)
    assert isinstance(gen, ExLlamaV2BaseGenerator) and not gen.full()
    ids = tok.encode("Echoes of", add_bos=True)
    gen.warmup()
    gen.set_stop_conditions([])
    gen.begin_stream_ex(ids, GREEDY)
    first = gen.stream_ex()["chunk_token_ids"][0].tolist()
    assert first == argmax_tokens(model, ids, 1)
    text = gen.generate_simple("Echoes of", GREEDY, 5, add_bos=True, completion_only=True, stop_token=None)
    assert gen.sequence_ids is not None and gen.sequence_ids.shape == (1, ids.shape[1] + 5)
    assert gen.sequence_ids[0, ids.shape[1]:].tolist() == argmax_tokens(model, ids, 5) and text
    with pytest.raises(GeneratorError, match="without an active stream"):
        gen.stream_ex()  # generate_simple() took the cache: the stream ended
    gen.begin_stream_ex(ids, GREEDY)
    banned = argmax_tokens(model, ids, 1)[0]
    res = gen.stream_ex(ban_tokens=[banned])  # banned for this step only
    logits = model.forward(ids)[0, -1].clone()
    logits[banned] = float("-inf")
    assert res["chunk_token_ids"][0, 0].item() == int(logits.argmax())


def test_streaming_sd_stats_and_ngram_preload() -> None:
    model, tok = aidreams()
    gen = ExLlamaV2StreamingGenerator(model, ExLlamaV2Cache(model, max_seq_len=128), tok)
    gen.set_stop_conditions([])
    gen.begin_stream_ex(tok.encode("Once", add_bos=True), GREEDY)
    for _ in range(3):
        gen.stream_ex()
    assert gen.get_sd_stats() == (0.0, 0.0, 3, 0, 0)
    gen.reset_sd_stats()
    assert gen.get_sd_stats() == (0.0, 0.0, 0, 0, 0)
    gen.ngram_preload(tok.encode("Echoes of vectors"))
    assert gen.ngram_preloaded == tok.encode("Echoes of vectors")[0].tolist()
    # Speculative decoding works now (tests/test_speculative.py); a draft model without its cache is an error.
    gen.speculative_ngram = True
    gen.begin_stream_ex(tok.encode("Once"), GREEDY)
    with pytest.raises(DraftModelError, match="draft_cache"):
        ExLlamaV2StreamingGenerator(model, gen.cache, tok, draft_model=model)
    with pytest.raises(TypeError, match="unexpected keyword argument 'seeed'"):
        gen.begin_stream(tok.encode("Once"), GREEDY, seeed=1)


def test_dynamic_job_sequences_and_rejected_keywords() -> None:
    model, tok = aidreams()
    ids = tok.encode("Echoes of", add_bos=True)
    job = ExLlamaV2DynamicJob(ids, 4, gen_settings=GREEDY, stop_conditions=[])
    seq = job.sequences[0]  # before enqueue: the prompt
    assert torch.equal(seq.input_ids.torch(), ids) and torch.equal(seq.sequence_ids.torch(), ids)
    assert seq.kv_position == 0 and not seq.prefill_complete and seq.live
    gen = ExLlamaV2DynamicGenerator(model, ExLlamaV2Cache(model, max_seq_len=512), tok)
    gen.enqueue(job)
    while gen.num_remaining_jobs():
        gen.iterate()
    seq = job.sequences[0]
    assert seq.sequence_ids.torch()[0].tolist() == ids[0].tolist() + argmax_tokens(model, ids, 4)
    assert not seq.live and seq.prefill_complete
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_tokens'"):
        ExLlamaV2DynamicJob(ids, 4, max_tokens=5)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_new_token'"):
        gen.generate("Once", 4, max_new_token=2)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="unexpected keyword argument 'pagd'"):
        ExLlamaV2DynamicGenerator(model, gen.cache, tok, pagd=False)  # type: ignore[call-arg]
    assert ExLlamaV2DynamicGenerator(model, gen.cache, tok, use_ngram_draft=True).spec is not None
    with pytest.raises(LoraConfigError, match="ExLlamaV2Lora objects"):
        gen.set_loras(["adapter"])
    gen.set_loras(None)
    assert gen.current_loras == []


def test_post_sampling_hook_names(monkeypatch: Any) -> None:
    from exlpy.generator import ExLlamaV2PostSamplingResult

    seen: list[ExLlamaV2PostSamplingResult] = []
    settings = ExLlamaV2Sampler.Settings.greedy()
    settings.post_sampling_hooks = [seen.append]
    logits = torch.randn(1, 1, 32, generator=torch.Generator().manual_seed(3))
    tok, *_ = ExLlamaV2Sampler.sample(logits, settings, torch.zeros(1, 1, dtype=torch.long), 0.5, None)
    assert len(seen) == 1 and isinstance(seen[0], ExLlamaV2PostSamplingResult)
    assert int(seen[0].sampled_token) == int(tok) == int(logits.argmax())
    assert ExLlamaV2PostSamplingResult().sampled_token is None  # constructible empty, as in exllamav2
