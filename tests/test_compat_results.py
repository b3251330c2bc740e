"""exllamav2 parity of what the generators hand back: the keys of every result dict against the spec (§8.1,
§8.2), per-prompt filter lists with None, filter_prefer_eos, failed async jobs, LoRA scaling, capability flags."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from exlpy import ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Lora
from exlpy.errors import GeneratorError
from exlpy.generator import (
    ExLlamaV2DynamicGenerator,
    ExLlamaV2DynamicJob,
    ExLlamaV2Sampler,
    ExLlamaV2StreamingGenerator,
)
from exlpy.generator.dynamic.async_ import ExLlamaV2DynamicGeneratorAsync, ExLlamaV2DynamicJobAsync
from tests.test_generator_helpers import aidreams, argmax_tokens

GREEDY = ExLlamaV2Sampler.Settings.greedy()

# Spec §8.1: keys of the dynamic generator's results, per stage.
ALWAYS = {"job", "stage", "serial", "eos"}
STAGE_KEYS = {"started": set(), "prefill": {"curr_progress", "max_progress"}, "streaming": {"text", "token_ids"}}
OPTIONAL = {"token_probs", "top_k_tokens", "top_k_probs", "logits", "suppressed_text", "suppressed_tokens"}
FINAL = {"eos_reason", "full_completion", "new_tokens", "prompt_tokens", "time_enqueued", "time_prefill",
         "time_generate", "cached_pages", "cached_tokens", "held"}
TRIGGER = {"stop_token": {"eos_triggering_token_id"}, "stop_string": {"eos_triggering_string"}}
DRAFT = {"accepted_draft_tokens", "rejected_draft_tokens"}
# Spec §8.2: stream_ex() results (`suppressed`: the text a banned string took back).
STREAM = {"chunk", "eos", "chunk_token_ids"}
STREAM_OPTIONAL = {"probs", "top_tokens", "top_probs", "logits", "suppressed"}


def check_dynamic(r: dict[str, Any], drafting: bool, identifier: bool, extras: set[str]) -> None:
    """`extras`: the optional keys this job asked for (return_probs, ...); they must come, nothing else may."""
    stage = r["stage"]
    want = ALWAYS | STAGE_KEYS[stage] | ({"identifier"} if identifier else set())
    allowed = set(want)
    if stage == "streaming":
        allowed |= OPTIONAL
        if r["eos"]:
            want |= FINAL | TRIGGER.get(r["eos_reason"], set()) | (DRAFT if drafting else set())
            allowed |= want
        if r["token_ids"].shape[-1]:
            want |= extras
    keys = set(r)
    assert want <= keys, (stage, want - keys)
    assert keys <= allowed, (stage, keys - allowed)


def aidreams_gen(**kw: Any) -> ExLlamaV2DynamicGenerator:
    m, tok = aidreams()
    return ExLlamaV2DynamicGenerator(m, ExLlamaV2Cache(m, max_seq_len=1024), tok, **kw)


class Letters:
    """A filter allowing tokens whose piece is made of lowercase letters (and EOS): the filter protocol."""

    def __init__(self, tok: Any) -> None:
        pieces = tok.get_id_to_piece_list()
        self.ok = {i for i, p in enumerate(pieces) if p.strip().isalpha() and p.strip().islower()}
        self.ok.add(tok.eos_token_id)

    def begin(self, prefix: str) -> None:
        pass

    def feed(self, token: int) -> None:
        pass

    def next(self) -> tuple[set[int], set[int]]:
        return self.ok, set()


CASES = {
    "plain": ({}, {}),
    "ngram": ({"use_ngram_draft": True, "num_draft_tokens": 3}, {}),
    "stop_string": ({}, {"stop_conditions": [" the"]}),
    "banned": ({}, {"banned_strings": ["a"]}),
    "banned_ngram": ({"use_ngram_draft": True}, {"banned_strings": ["e"]}),
    "filter": ({}, {"filters": "letters"}),
    "extras": ({}, {"return_probs": True, "return_top_tokens": 3, "return_logits": True, "identifier": 7}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_dynamic_result_keys_match_the_spec(case: str) -> None:
    gen_kw, job_kw = CASES[case]
    m, tok = aidreams()
    g = aidreams_gen(**gen_kw)
    if gen_kw.get("use_ngram_draft"):
        g.ngram_preload("Once upon a time there was a little girl. Once upon a time there was a dog. " * 4)
    job_kw = dict(job_kw)
    if job_kw.get("filters") == "letters":
        job_kw["filters"] = [Letters(tok)]
    job_kw.setdefault("stop_conditions", [tok.eos_token_id])
    extras = {k for k, v in (("token_probs", job_kw.get("return_probs")), ("logits", job_kw.get("return_logits")),
                             ("top_k_tokens", job_kw.get("return_top_tokens")),
                             ("top_k_probs", job_kw.get("return_top_tokens"))) if v}
    j = ExLlamaV2DynamicJob(tok.encode("Once upon a time", add_bos=True), 24, gen_settings=GREEDY, **job_kw)
    g.enqueue(j)
    stages, finals = [], []
    while g.num_remaining_jobs():
        for r in g.iterate():
            check_dynamic(r, drafting=bool(gen_kw), identifier="identifier" in job_kw, extras=extras)
            stages.append(r["stage"])
            if r["eos"]:
                finals.append(r)
    assert stages[:2] == ["started", "prefill"] and len(finals) == 1
    if case == "stop_string":
        f = finals[0]
        if f["eos_reason"] == "stop_string":
            assert f["held"]["text"].startswith(" the") and f["held"]["token_ids"].shape[-1] >= 1


def test_async_results_have_the_dynamic_keys() -> None:
    m, tok = aidreams()

    async def go(**gen_kw: Any) -> list[dict[str, Any]]:
        g = ExLlamaV2DynamicGeneratorAsync(m, ExLlamaV2Cache(m, max_seq_len=1024), tok, **gen_kw)
        out = [r async for r in ExLlamaV2DynamicJobAsync(g, input_ids=tok.encode("Once", add_bos=True),
                                                         max_new_tokens=8, gen_settings=GREEDY, identifier="a")]
        await g.close()
        return out

    for gen_kw in ({}, {"use_ngram_draft": True}):
        results = asyncio.run(go(**gen_kw))
        assert results[-1]["eos"]
        for r in results:
            check_dynamic(r, drafting=bool(gen_kw), identifier=True, extras=set())


@pytest.mark.parametrize("kind", ["plain", "ngram", "banned", "filter", "extras"])
def test_streaming_result_keys_match_the_spec(kind: str) -> None:
    m, tok = aidreams()
    g = ExLlamaV2StreamingGenerator(m, ExLlamaV2Cache(m, max_seq_len=512), tok)
    kw: dict[str, Any] = {}
    if kind == "ngram":
        g.speculative_ngram = True
    if kind == "banned":
        kw["banned_strings"] = ["a"]
    if kind == "filter":
        kw["filters"] = [Letters(tok)]
    if kind == "extras":
        kw.update(return_probabilities=True, return_top_tokens=2, return_logits=True)
    g.begin_stream_ex(tok.encode("Once upon a time", add_bos=True), GREEDY, **kw)
    want = STREAM | ({"probs", "top_tokens", "top_probs", "logits"} if kind == "extras" else set())
    for _ in range(16):
        r = g.stream_ex()
        keys = set(r)
        assert want <= keys and keys <= STREAM | STREAM_OPTIONAL, keys
        if r["eos"]:
            break


def test_per_prompt_filter_list_with_none_leaves_that_prompt_unfiltered() -> None:
    """exllamav2's examples/inference_lmfe.py passes one entry per prompt, None for an unfiltered one."""
    m, tok = aidreams()
    prompts = ["Once upon a time", "The little dog"]
    outs = aidreams_gen().generate(prompts, 12, gen_settings=GREEDY, filters=[None, [Letters(tok)]],
                                   completion_only=True, add_bos=True, stop_conditions=[])
    ids = tok.encode(prompts[0], add_bos=True)
    assert outs[0] == tok.decode(torch.tensor(argmax_tokens(m, ids, 12)))
    assert all(w.isalpha() and w.islower() for w in outs[1].split())
    with pytest.raises(GeneratorError, match="one list of filters"):
        aidreams_gen().generate(prompts, 4, gen_settings=GREEDY, filters=[None])
    # A job's filter list may hold None too (no filter), in both generators.
    j = ExLlamaV2DynamicJob(ids, 3, gen_settings=GREEDY, filters=[None], stop_conditions=[])
    assert j.filters == []
    s = ExLlamaV2StreamingGenerator(m, ExLlamaV2Cache(m, max_seq_len=256), tok)
    s.begin_stream_ex(ids, GREEDY, filters=[None])
    assert s.stream_ex()["chunk_token_ids"][0, 0].item() == argmax_tokens(m, ids, 1)[0]


class _Tok:
    eos_token_id = 1

    def get_vocab_size(self) -> int:
        return 4


class MaskFilter:
    """A logit-mask filter (can_mask_logits) that, like formatron's, leaves EOS (id 1) untouched."""

    def __init__(self, allowed: list[int], end: set[int] | None = None) -> None:
        self.allowed, self.end = allowed, end

    def can_mask_logits(self) -> bool:
        return True

    def get_next(self, mask: bool = False) -> None:
        return None

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[self.allowed] = True
        keep[1] = True
        return logits.masked_fill(~keep, float("-inf"))

    def mask_end_tokens(self) -> set[int]:
        return set() if self.end is None else self.end


class SetFilter:
    def __init__(self, pass_tokens: set[int]) -> None:
        self.pass_tokens = pass_tokens

    def next(self) -> tuple[set[int], set[int]]:
        return self.pass_tokens, set()


def test_filter_prefer_eos_as_exllamav2_treats_it() -> None:
    logits = torch.tensor([[[0.1, 0.0, 3.0, 0.2]]])  # EOS (1) allowed but unlikely; token 2 is the argmax

    def pick(filters: list[Any]) -> int:
        return int(ExLlamaV2Sampler.sample(logits, GREEDY, None, 0.5, tokenizer=_Tok(), filters=filters,
                                           filter_prefer_eos=True)[0])

    # A mask that merely leaves EOS finite does not say "EOS allowed": the model's choice stands.
    assert pick([MaskFilter([2, 3])]) == 2
    # A mask filter that declares EOS an end token for this step: EOS is preferred.
    assert pick([MaskFilter([2, 3], end={1})]) == 1
    # The token-set protocol: EOS among the allowed tokens is taken; not among them, it is not forced.
    assert pick([SetFilter({1, 2})]) == 1
    assert pick([SetFilter({2, 3})]) == 2


def test_failed_async_job_raises_its_error() -> None:
    m, tok = aidreams()

    class Broken:
        def begin(self, prefix: str) -> None:
            pass

        def feed(self, token: int) -> None:
            raise RuntimeError("filter exploded")

        def next(self) -> tuple[set[int], set[int]]:
            return set(range(100)), set()

    async def go() -> tuple[list[str], str]:
        g = ExLlamaV2DynamicGeneratorAsync(m, ExLlamaV2Cache(m, max_seq_len=1024), tok)
        good = ExLlamaV2DynamicJobAsync(g, input_ids=tok.encode("Once", add_bos=True), max_new_tokens=6,
                                        gen_settings=GREEDY, stop_conditions=[])
        bad = ExLlamaV2DynamicJobAsync(g, input_ids=tok.encode("A dog", add_bos=True), max_new_tokens=6,
                                       gen_settings=GREEDY, filters=[Broken()])
        with pytest.raises(RuntimeError, match="filter exploded") as e:
            async for _ in bad:
                pass
        texts = [r.get("text", "") async for r in good]  # the other job runs to its end
        await g.close()
        return texts, str(e.value)

    texts, err = asyncio.run(go())
    assert "filter exploded" in err and len("".join(texts)) > 0


def test_lora_scaling_is_stored_as_exllamav2_does(tmp_path: Path) -> None:
    from tests.lora_util import write_adapter

    m, _ = aidreams()
    model_dir = Path(m.config.model_dir)
    d = write_adapter(tmp_path / "a", model_dir, r=4, alpha=16.0, targets=["q_proj"])
    lora = ExLlamaV2Lora.from_directory(m, str(d), lora_scaling=0.5)
    try:
        assert lora.lora_scaling == pytest.approx(0.5 * 16.0 / 4)
    finally:
        lora.unload()
    cfg = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**cfg, "use_rslora": True}))
    lora = ExLlamaV2Lora.from_directory(m, str(d), lora_scaling=2.0)
    try:
        assert lora.lora_scaling == pytest.approx(2.0 * 16.0 / 2)
    finally:
        lora.unload()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the flags follow the CUDA device")
def test_attention_backend_flags_are_off_without_cuda() -> None:
    m, _ = aidreams()
    c = ExLlamaV2Config(m.config.model_dir)
    assert c.no_flash_attn and c.no_xformers and c.no_sdpa


def test_set_device_map_plans_by_budgets_without_loading() -> None:
    from exlpy import ExLlamaV2
    from exlpy.errors import InsufficientVRAMError
    from tests.conftest import shared_path

    cfg = ExLlamaV2Config(str(shared_path("models", "smollm2-135m-exl2-4.0")))
    cfg.max_seq_len = 2048
    m = ExLlamaV2(cfg)
    unused = m.set_device_map([0.3, 1.0])
    assert len(unused) == 2 and 0 <= unused[0] < 0.3 and 0 < unused[1] < 1.0
    devices = m.device_map_plan.devices
    assert list(devices) == sorted(devices) and set(devices) == {0, 1}  # in order, spilling onto the second
    assert not m.loaded
    with pytest.raises(InsufficientVRAMError, match="Insufficient VRAM"):
        m.set_device_map([0.01, 0.01])
