"""No stalls next to a long prompt: while jobs decode, one iteration runs at most `max_prefill_per_step` prompt
tokens (fewer deep into the prompt, where each costs more attention), so a step's time stays bounded and the
decoding jobs get a token every iteration (exlpy/generator/dynamic/scheduler.py)."""

from __future__ import annotations

from exlpy import ExLlamaV2Cache
from exlpy.generator import ExLlamaV2DynamicGenerator, ExLlamaV2Sampler
from exlpy.generator.dynamic import scheduler
from tests.test_generator_helpers import aidreams_cpu as aidreams
from tests.test_generator_helpers import decode_next_to_long_prompt

GREEDY = ExLlamaV2Sampler.Settings.greedy()


def test_prefill_per_iteration_is_bounded_while_jobs_decode() -> None:
    model, tok = aidreams()
    gen = ExLlamaV2DynamicGenerator(model, ExLlamaV2Cache(model, max_seq_len=8 * 256), tok, max_prefill_per_step=48)
    _, chunks = decode_next_to_long_prompt(gen, 700, 60, 2)
    assert max(chunks) <= 48 and sum(chunks) == 699
    assert chunks[-2] < chunks[0]  # deeper chunks are smaller: attention over a longer context costs more


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
