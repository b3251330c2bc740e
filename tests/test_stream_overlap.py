"""The streaming generator's overlapped steps (token sampled on the device, next step launched before it is
read): same tokens as the host sampler on full-forward logits, stops found one step late, cache rolled back."""

from __future__ import annotations

import torch

from exlpy import ExLlamaV2Cache
from exlpy.generator import ExLlamaV2Sampler, ExLlamaV2StreamingGenerator
from tests.test_dynamic_overlap import GREEDY, PENALTY, TOP_P, sampled_oracle
from tests.test_generator_helpers import aidreams_cpu as aidreams  # exact seeded oracles: fp32 CPU
from tests.test_generator_helpers import argmax_tokens
from tests.test_generator_streaming import stream_all


def streamer(max_seq_len: int = 256) -> ExLlamaV2StreamingGenerator:
    model, tok = aidreams()
    sg = ExLlamaV2StreamingGenerator(model, ExLlamaV2Cache(model, max_seq_len=max_seq_len), tok)
    sg.set_stop_conditions([])
    return sg


def test_overlapped_stream_matches_greedy_and_seeded_oracles() -> None:
    model, tok = aidreams()
    ids = tok.encode("Echoes of", add_bos=True)
    sg = streamer()
    sg.begin_stream_ex(ids, GREEDY)
    assert stream_all(sg, 12)[1] == argmax_tokens(model, ids, 12)
    assert sg.pending is not None and sg.cache.current_seq_len == sg.sequence_ids.shape[1]  # one step ahead
    for settings in (TOP_P, PENALTY):  # device-sampled, then host-sampled (penalty over the context)
        sg.begin_stream_ex(ids, settings)
        sg.set_seed(21)
        assert stream_all(sg, 12)[1] == sampled_oracle(ids, 12, settings, 21)
    # The global RNG (exllamav2's torch.manual_seed style): a discarded step gives its random number back.
    torch.manual_seed(5)
    sg.begin_stream_ex(ids, TOP_P)
    first = stream_all(sg, 6)[1]
    sg.begin_stream_ex(ids, TOP_P)  # discards the step in flight
    second = stream_all(sg, 6)[1]
    torch.manual_seed(5)
    assert [global_rng_oracle(ids, 6), global_rng_oracle(ids, 6)] == [first, second]


def global_rng_oracle(ids: torch.Tensor, n: int) -> list[int]:
    model, tok = aidreams()
    seq, out = ids.clone(), []
    for _ in range(n):
        t = int(ExLlamaV2Sampler.sample(model.forward(seq)[:, -1:], TOP_P, seq, None, tok)[0].view(-1)[0])
        out.append(t)
        seq = torch.cat([seq, torch.tensor([[t]])], dim=1)
    return out


def test_stop_one_step_late_rolls_the_cache_back() -> None:
    model, tok = aidreams()
    ids = tok.encode("The gentle hum of", add_bos=True)
    greedy = argmax_tokens(model, ids, 10)
    sg = streamer()
    sg.set_stop_conditions([greedy[4]])
    sg.begin_stream_ex(ids, GREEDY)
    _, toks, last = stream_all(sg, 10)
    k = greedy.index(greedy[4])
    assert toks == greedy[:k + 1] and last["eos"] and last["eos_reason"] == "stop_token"
    assert sg.pending is None and sg.cache.current_seq_len == sg.sequence_ids.shape[1] - 1
    # A follow-up prompt that extends this sequence reuses its cache: the rolled-back K/V was never counted.
    follow = torch.cat([sg.sequence_ids, tok.encode(" and", add_bos=False)], dim=1)
    before = sg.prefill_tokens
    sg.set_stop_conditions([])
    sg.begin_stream_ex(follow, GREEDY)
    assert sg.prefill_tokens - before == follow.shape[1] - 1 - (ids.shape[1] + k)
    assert stream_all(sg, 6)[1] == argmax_tokens(model, follow, 6)


def test_stream_reaching_the_cache_end_stops_cleanly() -> None:
    model, tok = aidreams()
    ids = tok.encode("Once", add_bos=True)
    sg = streamer(max_seq_len=ids.shape[1] + 5)
    sg.begin_stream_ex(ids, ExLlamaV2Sampler.Settings.greedy())
    _, toks, last = stream_all(sg, 20)
    assert toks == argmax_tokens(model, ids, 5) and last["eos_reason"] == "max_seq_len"
    assert sg.cache.current_seq_len <= sg.cache.max_seq_len
