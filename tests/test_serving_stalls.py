"""No stalls next to a long prompt: while jobs decode, one iteration runs at most `max_prefill_per_step` prompt
tokens (fewer deep into the prompt, where each costs more attention), so a step's time stays bounded and the
decoding jobs get a token every iteration (exlpy/generator/dynamic/scheduler.py)."""

from __future__ import annotations

from types import SimpleNamespace

from exlpy import ExLlamaV2Cache
from exlpy.generator import ExLlamaV2DynamicGenerator, ExLlamaV2Sampler
from exlpy.generator.dynamic import scheduler
from tests.test_generator_helpers import aidreams_cpu as aidreams
from tests.test_generator_helpers import decode_next_to_long_prompt

GREEDY = ExLlamaV2Sampler.Settings.greedy()


def test_prefill_per_iteration_is_bounded_while_jobs_decode() -> None:
    """A budget below MIN_CHUNK_TOKENS is the user's bound: every chunk takes it, however deep."""
    model, tok = aidreams()
    gen = ExLlamaV2DynamicGenerator(model, ExLlamaV2Cache(model, max_seq_len=8 * 256), tok, max_prefill_per_step=48)
    _, chunks = decode_next_to_long_prompt(gen, 700, 60, 2)
    assert sum(chunks) == 699 and chunks[:-1] == [48] * (len(chunks) - 1)


def test_deeper_chunks_are_smaller_but_not_below_the_floor() -> None:
    """With the default budget a lone prompt starts at PROMPT_TOKENS a step; deeper in, attention over its context
    makes each token cost more, so chunks shrink, but never below MIN_CHUNK_TOKENS: a chunk is a forward pass of its
    own whose fixed cost (the weights read once, an eager pass's kernel launches) does not shrink with it. (Before
    the floor, a 16k prompt next to 32 streams went 24-57 tokens a step on an 8B: 194 steps.)"""
    model, tok = aidreams()
    assert gen_cost(model) == 193  # aidreams260K: hidden 64, 4 heads of 16, MLP 172
    gen = ExLlamaV2DynamicGenerator(model, ExLlamaV2Cache(model, max_seq_len=8 * 256), tok)
    _, chunks = decode_next_to_long_prompt(gen, 700, 60, 2)
    assert sum(chunks) == 699 and chunks[0] == scheduler.PROMPT_TOKENS
    assert chunks[1:-1] == [scheduler.MIN_CHUNK_TOKENS] * (len(chunks) - 2)  # 256 * 193 / (193 + 256) = 110: floored


def gen_cost(model: object) -> int:
    return scheduler.context_cost_tokens(model.config)  # type: ignore[attr-defined]


def test_context_cost_from_the_model_shapes() -> None:
    """C of (1 + L / C): the projections' FLOPs per token over attention's per context token, halved. Llama-3-8B's
    shapes give 13,312: a token 16k deep costs 2.2x one at the start (the former constant 4096 said 5x and cut a
    16k prompt's chunks to ~50 tokens)."""
    llama8b = SimpleNamespace(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                              intermediate_size=14336, spec=None)
    assert scheduler.context_cost_tokens(llama8b) == 13312
    moe = SimpleNamespace(**{**vars(llama8b), "spec": SimpleNamespace(moe=SimpleNamespace(expert_size=1024, top_k=2)),
                             "num_experts_per_token": 4})
    assert scheduler.context_cost_tokens(moe) == 2 * (4096 * 48 * 128 + 32 * 128 * 4096 + 3 * 4096 * 4096) // (
        4 * 32 * 128 * scheduler.ATTENTION_SLOWDOWN)  # the experts a token is routed to (here set to 4)
    assert scheduler.context_cost_tokens(SimpleNamespace()) == scheduler.CONTEXT_COST_FALLBACK  # a stand-in
    # a lone 16k prompt next to decoding jobs on those shapes: deep chunks at the floor, not ~50 tokens
    gen = SimpleNamespace(max_chunk_size=2048, context_cost_tokens=13312)
    limit = lambda pos, spent=0: scheduler.prefill_limit(gen, SimpleNamespace(prefill_pos=pos), 32, 256, spent)  # noqa: E731
    assert limit(0) == 256 and limit(4096) == 195 and limit(16000) == scheduler.MIN_CHUNK_TOKENS
    assert limit(16000, spent=200) == 56  # the budget's remainder still bounds it
    assert limit(0, spent=256) == 0


def test_budget_grows_when_many_more_jobs_wait_than_decode() -> None:
    model, tok = aidreams()
    gen = ExLlamaV2DynamicGenerator(model, ExLlamaV2Cache(model, max_seq_len=8 * 256), tok, max_chunk_size=512,
                                    max_prefill_per_step=64)
    assert scheduler.prefill_budget(gen, decoding=0, prefilling=3) == 3 * 512  # nothing to stall: whole chunks
    assert scheduler.prefill_budget(gen, decoding=0, prefilling=64) == 4 * 512  # a burst: in waves
    for d in (1, 2, 3, 8, 32):  # a lone long prompt: the base budget, however many decode
        assert scheduler.prefill_budget(gen, decoding=d, prefilling=1) == 64
    assert scheduler.prefill_budget(gen, decoding=32, prefilling=7) == 64
    assert scheduler.prefill_budget(gen, decoding=32, prefilling=32) == 64 * 4
    assert scheduler.prefill_budget(gen, decoding=4, prefilling=60) == 4 * 512  # capped


def test_a_lone_prompt_runs_in_small_pieces_a_crowd_gets_the_whole_budget() -> None:
    """With the default budget (2048) next to decoding jobs: one waiting prompt gets PROMPT_TOKENS (256) a step,
    each further one adds as much, up to the budget; a crowd larger than the decoders grows past it."""
    model, tok = aidreams()
    gen = ExLlamaV2DynamicGenerator(model, ExLlamaV2Cache(model, max_seq_len=8 * 256), tok, max_chunk_size=2048)
    assert gen.max_prefill_per_step == 2048
    for d in (1, 8, 32):
        assert scheduler.prefill_budget(gen, decoding=d, prefilling=1) == scheduler.PROMPT_TOKENS == 256
    assert scheduler.prefill_budget(gen, decoding=32, prefilling=4) == 1024
    assert scheduler.prefill_budget(gen, decoding=32, prefilling=8) == 2048
    assert scheduler.prefill_budget(gen, decoding=8, prefilling=56) == 4 * 2048  # 56 x 4 // 8 = 28: capped


def test_host_work_per_iteration_does_not_grow_with_the_prompt_depth() -> None:
    """The generator thread's Python work in an iteration that runs a prompt chunk next to decoding jobs is the same
    at position 512 as at 1,536 of the prompt: counted as calls into exlpy (its functions and the C functions they
    call), not timed. Nothing per step may walk the whole prompt (re-hashing its pages, rebuilding its ids or
    tables), since that turns into a stall deep into long prompts."""
    import sys
    from collections import Counter

    import torch

    import exlpy
    from exlpy.generator import ExLlamaV2DynamicJob

    model, tok = aidreams()
    gen = ExLlamaV2DynamicGenerator(model, ExLlamaV2Cache(model, max_seq_len=16 * 256), tok)
    decoders = [ExLlamaV2DynamicJob(torch.tensor([[1, 7 + k, 9]]), 200, gen_settings=GREEDY, stop_conditions=[])
                for k in range(3)]
    gen.enqueue(decoders)
    while not all(j.new_tokens for j in decoders):
        gen.iterate()
    long = ExLlamaV2DynamicJob(torch.randint(3, 500, (1, 2000), generator=torch.Generator().manual_seed(3)), 2,
                               gen_settings=GREEDY, stop_conditions=[])
    gen.enqueue(long)
    root = exlpy.__path__[0]
    calls: dict[int, Counter[str]] = {}
    while not long.is_prefilled():
        pos = long.seqs[0].prefill_pos if long.seqs else -1
        seen: Counter[str] = Counter()

        def count(frame: object, event: str, arg: object, seen: Counter[str] = seen) -> None:
            if event in ("call", "c_call") and frame.f_code.co_filename.startswith(root):  # type: ignore[attr-defined]
                seen[event] += 1

        sys.setprofile(count)
        try:
            gen.iterate()
        finally:
            sys.setprofile(None)
        calls[pos] = seen
    # both positions start a page (the copy-from-a-freed-page check runs there) with a chunk of 128 tokens
    assert calls[512]["call"] > 500 and calls[512] == calls[1536]
