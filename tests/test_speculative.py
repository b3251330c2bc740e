"""Speculative decoding: greedy output identical to decoding without it (draft model: another tiny model, the
same model, an EXL2 one; n-gram drafts), sampled output distributed as the target's (chi-square over many
seeded verifications on a tiny vocabulary), stops and cache ends inside drafts, typed errors."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import pytest
import torch

from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config
from exlpy.errors import DraftModelError
from exlpy.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler
from exlpy.generator.sampling.batched import RowSample
from exlpy.generator.speculative.ngram import NgramIndex
from exlpy.generator.speculative.verify import verify_rows
from tests.conftest import shared_path
from tests.test_dynamic_overlap import PENALTY, TOP_P, sampled_oracle
from tests.test_generator_helpers import PROMPTS, aidreams, argmax_tokens, drain

GREEDY = ExLlamaV2Sampler.Settings.greedy()
CHI2_P001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


@lru_cache(maxsize=2)
def tiny(name: str) -> Any:
    cfg = ExLlamaV2Config(str(shared_path("models", name)))
    cfg.max_seq_len = 2048
    m = ExLlamaV2(cfg)
    m.load()
    return m


def spec_gen(draft: Any = None, pages: int = 8, **kw: Any) -> ExLlamaV2DynamicGenerator:
    model, tok = aidreams()
    if draft is not None:
        kw.update(draft_model=draft, draft_cache=ExLlamaV2Cache(draft, max_seq_len=pages * 256))
    return ExLlamaV2DynamicGenerator(model, ExLlamaV2Cache(model, max_seq_len=pages * 256), tok, **kw)


def job(ids: torch.Tensor, n: int, **kw: Any) -> ExLlamaV2DynamicJob:
    kw.setdefault("gen_settings", GREEDY)
    kw.setdefault("stop_conditions", [])
    return ExLlamaV2DynamicJob(ids, n, **kw)


@pytest.mark.parametrize("drafter", ["tiny-llama-fp16", "same", "tiny-llama-exl2-4.0", "ngram"])
def test_greedy_with_speculation_equals_plain_greedy(drafter: str) -> None:
    model, tok = aidreams()
    torch.manual_seed(7)
    ids = [tok.encode(p, add_bos=True) for p in PROMPTS[:3]]
    ids.append(torch.cat([torch.tensor([[1]]), torch.randint(3, 500, (1, 300))], dim=1))  # mixed lengths
    if drafter == "ngram":
        g = spec_gen(use_ngram_draft=True, num_draft_tokens=3)
    else:
        g = spec_gen(model if drafter == "same" else tiny(drafter), num_draft_tokens=3)
    # Jobs the host samples (a repetition penalty; CFG) ride along in the verification steps.
    cfg = ExLlamaV2Sampler.Settings.greedy(cfg_scale=2.0)
    jobs = [job(i, 16) for i in ids] + [job(ids[0], 10, gen_settings=PENALTY, seed=3),
                                        job([ids[1], ids[2]], 6, gen_settings=cfg)]
    g.enqueue(jobs)
    res = drain(g)
    for i, j in zip(ids, jobs):
        assert res[j]["tokens"] == argmax_tokens(model, i, 16)
    assert res[jobs[4]]["tokens"] == sampled_oracle(ids[0], 10, PENALTY, 3)
    plain = spec_gen()
    again = job([ids[1], ids[2]], 6, gen_settings=cfg)
    plain.enqueue(again)
    assert res[jobs[5]]["tokens"] == drain(plain)[again]["tokens"]
    eff, acc, total, drafted, accepted = g.get_sd_stats()
    assert drafted > 0 and total == 4 * 16 + 10 + 6
    if drafter == "same":
        assert acc == 1.0 and accepted == drafted  # a model agrees with itself
    assert g.page_table.num_unreferenced() == g.num_pages
    final = res[jobs[0]]["final"]
    assert final["accepted_draft_tokens"] + final["rejected_draft_tokens"] >= 0
    g.reset_sd_stats()
    assert g.get_sd_stats() == (0.0, 0.0, 0, 0, 0)


def test_stops_and_cache_end_inside_a_draft() -> None:
    model, tok = aidreams()
    ids = tok.encode("Echoes of", add_bos=True)
    greedy = argmax_tokens(model, ids, 14)
    text = tok.decode(torch.cat([ids[0], torch.tensor(greedy)]))[len(tok.decode(ids[0])):]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    g = spec_gen(model, num_draft_tokens=5, max_seq_len=ids.shape[1] + 7)  # the context ends mid-draft
    a = job(ids, 14, stop_conditions=[stop])
    b = job(ids, 14, stop_conditions=[greedy[4]])
    c = job(ids, 14)
    g.enqueue([a, b, c])
    res = drain(g)
    assert res[a]["text"] == text[:text.index(stop)] and res[a]["final"]["eos_reason"] == "stop_string"
    assert res[b]["tokens"] == greedy[:greedy.index(greedy[4]) + 1]
    assert res[c]["tokens"] == greedy[:7] and res[c]["final"]["eos_reason"] == "max_new_tokens"
    assert g.page_table.num_unreferenced() == g.num_pages


def test_sampled_speculation_is_seeded_and_runs_with_ngram_preload() -> None:
    model, tok = aidreams()
    ids = tok.encode("Echoes of", add_bos=True)
    outs = []
    for _ in range(2):
        g = spec_gen(use_ngram_draft=True)
        g.ngram_preload("Echoes of vectors unfold, a gentle hum of precision")
        j = job(ids, 24, gen_settings=TOP_P, seed=9)
        g.enqueue(j)
        outs.append(drain(g)[j]["tokens"])
    assert outs[0] == outs[1] and len(outs[0]) == 24


def test_verification_keeps_the_target_distribution() -> None:
    """Many rows verified at once: the first emitted token must follow the target's distribution at position 0
    (drafts accepted or not), the token added after an accepted draft the one at position 1."""
    n, vocab = 40000, 8
    g = torch.Generator().manual_seed(5)
    base = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0], [0.0, 1.0, 2.0, -1.0, 0.5, -2.0, 1.5, 0.2]])
    logits = base.unsqueeze(0).expand(n, 2, vocab).contiguous()
    settings = ExLlamaV2Sampler.Settings(temperature=1.0, top_k=0, top_p=0.9, token_repetition_penalty=1.0)
    drafts = torch.randint(0, vocab, (n, 1), generator=g)  # often a token the target rarely picks
    u, r = torch.rand(n, 1, generator=g), torch.rand(n, 2, generator=g)
    m, tok = verify_rows(logits, drafts, [RowSample(settings)] * n, u, r, None)
    first = torch.where(m == 1, drafts[:, 0], tok)
    for pos, picks in ((0, first), (1, tok[m == 1])):
        p = ExLlamaV2Sampler.sample(base[pos:pos + 1], settings, None, None, return_top_tokens=vocab)
        target = torch.zeros(vocab, dtype=torch.float64).scatter_(0, p[1].view(-1), p[2].view(-1).double())
        counts = torch.bincount(picks, minlength=vocab).double()
        keep = target > 0
        assert counts[~keep].sum() == 0  # never a token top-p removed
        expected = target[keep] * picks.numel()
        chi2 = ((counts[keep] - expected) ** 2 / expected).sum().item()
        dof = int(keep.sum()) - 1
        assert dof >= 2 and chi2 < CHI2_P001[dof], (pos, chi2, dof)  # p < 0.001 thresholds


def test_ngram_index_predicts_the_most_frequent_continuation() -> None:
    base = NgramIndex(3)
    base.extend([5, 6, 7, 8])
    idx = NgramIndex(3, base=base)
    idx.extend([1, 2, 3, 1, 2, 4, 1, 2, 4, 1, 2])
    assert idx.propose(3) == [4, 1, 2]
    idx.extend([9, 5])
    assert idx.propose(2) == [6, 7]  # only the preloaded text knows what follows 5
    idx.truncate(3)
    assert idx.tokens == [1, 2, 3] and idx.propose(1) == []


def test_bad_speculative_arguments_are_typed_errors(tmp_path: Any) -> None:
    model, tok = aidreams()
    draft = tiny("tiny-llama-fp16")
    cache = ExLlamaV2Cache(model, max_seq_len=512)
    with pytest.raises(DraftModelError, match="num_draft_tokens"):
        ExLlamaV2DynamicGenerator(model, cache, tok, use_ngram_draft=True, num_draft_tokens=0)
    with pytest.raises(DraftModelError, match="must match the main cache"):
        ExLlamaV2DynamicGenerator(model, cache, tok, draft_model=draft,
                                  draft_cache=ExLlamaV2Cache(draft, max_seq_len=256))
    with pytest.raises(DraftModelError, match="not built for draft_model"):
        ExLlamaV2DynamicGenerator(model, cache, tok, draft_model=draft,
                                  draft_cache=ExLlamaV2Cache(model, max_seq_len=512))
    with pytest.raises(DraftModelError, match="needs a draft_cache"):
        ExLlamaV2DynamicGenerator(model, cache, tok, draft_model=draft)
    unloaded = ExLlamaV2(ExLlamaV2Config(str(shared_path("models", "tiny-llama-fp16"))))
    with pytest.raises(DraftModelError, match="not loaded"):
        ExLlamaV2DynamicGenerator(model, cache, tok, draft_model=unloaded,
                                  draft_cache=ExLlamaV2Cache(unloaded, max_seq_len=512, lazy=True))
    other = ExLlamaV2(ExLlamaV2Config(write_tiny(tmp_path, vocab=256)))  # a draft with another vocabulary
    other.load()
    with pytest.raises(DraftModelError, match="vocabulary"):
        ExLlamaV2DynamicGenerator(model, cache, tok, draft_model=other,
                                  draft_cache=ExLlamaV2Cache(other, max_seq_len=512))


def write_tiny(path: Any, vocab: int) -> str:
    """A one-layer random Llama with `vocab` tokens (config.json + model.safetensors)."""
    import json

    from safetensors.torch import save_file

    h, inter, heads, kv, d = 32, 64, 2, 1, 16
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h, "intermediate_size": inter,
           "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": d,
           "vocab_size": vocab, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
           "tie_word_embeddings": True, "hidden_act": "silu"}
    g = torch.Generator().manual_seed(0)
    w = lambda *shape: torch.randn(*shape, generator=g) * 0.02  # noqa: E731
    p = "model.layers.0."
    t = {"model.embed_tokens.weight": w(vocab, h), "model.norm.weight": torch.ones(h),
         p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
         p + "self_attn.q_proj.weight": w(heads * d, h), p + "self_attn.k_proj.weight": w(kv * d, h),
         p + "self_attn.v_proj.weight": w(kv * d, h), p + "self_attn.o_proj.weight": w(h, heads * d),
         p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
         p + "mlp.down_proj.weight": w(h, inter)}
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(t, str(path / "model.safetensors"))
    return str(path)


@pytest.mark.parametrize("drafter", ["tiny-llama-exl2-4.0", "same", "ngram"])
def test_streaming_generator_speculation_equals_plain_greedy(drafter: str) -> None:
    from exlpy.generator import ExLlamaV2StreamingGenerator
    from tests.test_generator_streaming import stream_all

    model, tok = aidreams()
    cache = ExLlamaV2Cache(model, max_seq_len=256)
    if drafter == "ngram":
        sg = ExLlamaV2StreamingGenerator(model, cache, tok)
        sg.speculative_ngram = True
        sg.ngram_preload("Echoes of vectors unfold, a gentle hum of precision")
    else:
        d = model if drafter == "same" else tiny(drafter)
        sg = ExLlamaV2StreamingGenerator(model, cache, tok, d, ExLlamaV2Cache(d, max_seq_len=256))
    ids = tok.encode("Echoes of", add_bos=True)
    greedy = argmax_tokens(model, ids, 24)
    sg.set_stop_conditions([])
    sg.begin_stream_ex(ids, GREEDY)
    _, toks, _ = stream_all(sg, 24)
    assert toks[:24] == greedy
    eff, acc, total, drafted, accepted = sg.get_sd_stats()
    assert drafted > 0 and (drafter != "same" or acc == 1.0)
    # A stop token that lands inside an accepted draft ends the stream there; the caches go back to it.
    sg.set_stop_conditions([greedy[9]])
    sg.begin_stream_ex(ids, GREEDY)
    _, toks, last = stream_all(sg, 24)
    k = greedy.index(greedy[9])
    assert toks == greedy[:k + 1] and last["eos_reason"] == "stop_token"
    assert sg.cache.current_seq_len == sg.sequence_ids.shape[1] - 1
    # A cache that ends inside a draft.
    small = ExLlamaV2Cache(model, max_seq_len=ids.shape[1] + 6)
    sg2 = ExLlamaV2StreamingGenerator(model, small, tok) if drafter == "ngram" else \
        ExLlamaV2StreamingGenerator(model, small, tok, model, ExLlamaV2Cache(model, max_seq_len=256), 5)
    sg2.speculative_ngram = drafter == "ngram"
    sg2.set_stop_conditions([])
    sg2.begin_stream_ex(ids, GREEDY)
    _, toks, last = stream_all(sg2, 24)
    assert toks == greedy[:6] and last["eos_reason"] == "max_seq_len"


def test_draft_length_adapts_to_acceptance_and_honours_a_fixed_value() -> None:
    from exlpy.generator.speculative.length import DraftLength

    d = DraftLength(None, 7, 0.15)
    for _ in range(40):
        d.update(accepted=9, rejections=1)  # ~90% of drafts accepted
    high = d.choose()
    for _ in range(40):
        d.update(accepted=1, rejections=1)  # ~50%
    assert high > d.choose() >= 1
    assert DraftLength(3, 7, 0.15).choose() == 3


def geometric_round(rng: Any, rate: float, k: int, rows: int = 1) -> tuple[int, int]:
    """(accepted drafts, rejections) of one round of k drafts per row, each accepted with `rate` while the ones
    before it were."""
    accepted = rejections = 0
    for _ in range(rows):
        m = 0
        while m < k and rng.random() < rate:
            m += 1
        accepted += m
        rejections += m < k
    return accepted, rejections


def test_draft_length_estimates_the_per_token_rate_without_bias() -> None:
    """At a = 0.8 and 4 drafts a round, one row: the old average of per-round ratios read ~0.65 (and then chose
    2 drafts instead of 4); the moving sums of counts read a."""
    import random
    import statistics

    from exlpy.generator.speculative.length import DraftLength

    for rate, k in ((0.8, 4), (0.5, 2), (0.9, 6)):
        d, rng, seen = DraftLength(None, 7, 0.2), random.Random(0), []
        for _ in range(2000):
            d.update(*geometric_round(rng, rate, k))
            seen.append(d.rate)
        assert abs(statistics.mean(seen[50:]) - rate) < 0.03, (rate, k, statistics.mean(seen[50:]))


def test_draft_length_maximises_tokens_per_unit_of_measured_time() -> None:
    from exlpy.generator.speculative.length import ROUND_OVERHEAD, DraftLength, best_length, expected_tokens

    # best_length is the argmax of expected tokens per unit of time, a round of k drafts costing 1 + (c + v) k
    # times a round's overhead over a plain step; 0 (off) where even the best does not beat plain decoding.
    for rate in (0.3, 0.5, 0.7, 0.8, 0.9, 0.97):
        for cost in (0.01, 0.1, 0.2, 0.5):
            values = [expected_tokens(rate, k) / (1 + (cost + 0.02) * k) for k in range(1, 8)]
            want = 1 + values.index(max(values)) if max(values) > 1.0 + ROUND_OVERHEAD else 0
            assert best_length(rate, cost, 7) == want
    assert best_length(0.8, 0.2, 7) == 4 and best_length(1.0, 0.5, 7) == 7
    assert best_length(0.2, 0.2, 7) == 0 and best_length(0.3, 0.5, 7) == 0  # drafting off
    assert best_length(0.2, 0.0, 7) == 2  # n-grams cost nothing: a fifth accepted still pays
    d = DraftLength(None, 7, 1.0)  # a static guess that drafting costs as much as the target
    d.accepted, d.rejected = 8.0, 2.0  # a = 0.8
    assert d.choose() == 0  # 1.8 tokens for 2 steps and a round's overhead: plain decoding is faster
    for _ in range(5):  # measured: 4 draft steps take 0.6 s of a 1.0 s round (c ~ 0.4)
        d.observe(4, 0.6, 1.0)
    d.observe(4, 0.6, 30.0)  # a round that captured a CUDA graph: the median ignores it
    assert abs(d.step_cost - 0.15 * 1.08 / 0.4) < 1e-9
    assert d.choose() == best_length(0.8, d.step_cost, 7) == 2


def test_draft_length_recovers_from_an_early_low_estimate() -> None:
    """After a bad start (nothing accepted) drafting is off; the probe rounds of one draft (one per PROBE_EVERY
    plannings) still measure the rate, and once drafts are accepted the length grows back."""
    import random

    from exlpy.generator.speculative.length import PROBE_EVERY, DraftLength

    d, rng = DraftLength(None, 7, 0.2), random.Random(1)
    for _ in range(30):
        d.update(0, 1)
    d.tick()
    assert d.choose() == 0
    ks = []
    for _ in range(12 * PROBE_EVERY):  # the generator: a planning per step, a round when k > 0
        d.tick()
        ks.append(d.choose())
        if ks[-1]:
            d.update(*geometric_round(rng, 0.9, ks[-1]))
    probes = [i for i, k in enumerate(ks[:PROBE_EVERY * 2]) if k]
    assert probes and probes[0] == PROBE_EVERY - 2 and all(k in (0, 1) for k in ks[:PROBE_EVERY * 2]), ks
    assert min(ks[-PROBE_EVERY:]) >= 4, ks


def test_draft_length_stays_off_at_low_acceptance() -> None:
    """At a = 0.1 with a model draft (c = 0.2), only the probes draft: one round per PROBE_EVERY plannings."""
    import random

    from exlpy.generator.speculative.length import PROBE_EVERY, DraftLength

    d, rng, rounds = DraftLength(None, 7, 0.2), random.Random(2), 0
    n = 40 * PROBE_EVERY
    for _ in range(n):
        d.tick()
        k = d.choose()
        if k:
            rounds += 1
            d.update(*geometric_round(rng, 0.1, k))
    assert rounds <= n // PROBE_EVERY + 8  # the first few, from the starting estimate of 0.7, then the probes


class RefReplay:
    """A draft that runs the tiny draft model (its cost) but proposes the target's greedy continuation `ref`
    with probability `rate` and another token otherwise: a draft of known per-token acceptance."""

    def __init__(self, inner: Any, refs: dict[int, list[int]], rate: float, vocab: int) -> None:
        import random

        self.inner, self.refs, self.rate, self.vocab = inner, refs, rate, vocab
        self.rng, self.cache = random.Random(0), inner.cache

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def propose(self, seqs: list[Any], k: int, target_device: torch.device) -> torch.Tensor:
        self.inner.propose(seqs, k, target_device)
        rows = []
        for q in seqs:  # a round launched ahead passes views of the sequences (their base: the job's own)
            ref, L = self.refs[id(getattr(q, "base", q))], q.ids.numel()
            assert q.ids.tolist() == ref[:L]  # the sequence follows plain greedy decoding
            want = ref[L:L + k]
            rows.append([w if self.rng.random() < self.rate else (w + self.rng.randrange(1, self.vocab)) % self.vocab
                         for w in want])
        return torch.tensor(rows, dtype=torch.long, device=target_device)


def draft_pair(tmp_path: Any) -> tuple[Any, Any, Any]:
    """(aidreams, its tokenizer, a one-layer random draft of the same vocabulary: a draft step costs a fraction
    of a target step, so the draft length can grow)."""
    model, tok = aidreams()
    draft = ExLlamaV2(ExLlamaV2Config(write_tiny(tmp_path, vocab=model.config.vocab_size)))
    draft.config.max_seq_len = 2048
    draft.load()
    return model, tok, draft


def test_replay_draft_of_known_acceptance(tmp_path: Any) -> None:
    """Measured per-token acceptance ~ the draft's rate, output identical to plain greedy decoding, and the
    draft length the generator adapts to: the longest at a = 1, several drafts at a = 0.8, fewer at a = 0.5."""
    model, tok, draft = draft_pair(tmp_path)
    n = 40
    ids = [tok.encode(p, add_bos=True) for p in PROMPTS[:4]]
    refs = [i[0].tolist() + argmax_tokens(model, i, n + 8) for i in ids]
    g = spec_gen(draft)
    assert g.spec is not None
    length = g.spec.length
    max_k = length.max_k
    timed: list[tuple[int, float, float]] = []
    # The rounds are timed (checked below), but the length is chosen at a fixed draft cost: CPU timings vary.
    length.observe = lambda k, d, r: timed.append((k, d, r))  # type: ignore[method-assign]
    length.cost = 0.1
    replay = RefReplay(g.spec.drafter, {}, 1.0, model.config.vocab_size)
    g.spec.drafter = replay
    seen = {}
    for rate in (1.0, 0.8, 0.5):
        replay.rate = rate
        for _ in range(2):  # the second run starts from the estimate the first one settled on
            jobs = [job(i, n) for i in ids]
            g.enqueue(jobs)
            replay.refs = {id(j.seqs[0]): r for j, r in zip(jobs, refs)}
            g.reset_sd_stats()
            res = drain(g)
        assert [res[j]["tokens"] for j in jobs] == [r[len(i[0]):len(i[0]) + n] for i, r in zip(ids, refs)]
        s = g.spec
        eff, acc, total, drafted, accepted = g.get_sd_stats()
        assert total == 4 * n and drafted == s.drafted and accepted == s.accepted
        assert (s.rejections == 0) == (rate == 1.0)
        seen[rate] = (s.acceptance_per_token(), s.mean_draft_length(), acc)
    # At cost 0.1 the best length is 7 at a = 1, 5 at a = 0.8 and 2 at a = 0.5.
    assert seen[1.0][0] == 1.0 and seen[1.0][2] == 1.0 and seen[1.0][1] >= max_k - 0.5, seen
    assert abs(seen[0.8][0] - 0.8) < 0.08 and seen[0.8][1] >= 3.5, seen
    assert abs(seen[0.5][0] - 0.5) < 0.1 and 1.5 <= seen[0.5][1] < seen[0.8][1], seen
    assert timed and all(1 <= k <= max_k and 0 < d < r for k, d, r in timed)
    assert seen[0.8][2] < seen[0.8][0]  # accepted / drafted counts the drafts after a rejection too
    health = g.status()["speculative"]
    assert health["acceptance_per_token"] == round(seen[0.5][0], 4) and health["draft_step_cost"] > 0


def test_benchmark_replay_draft_holds_its_rate_when_verification_rounds_differently(tmp_path: Any,
                                                                                      monkeypatch: Any) -> None:
    """benchmarks/speculative.py's replay draft on a target whose verification steps round differently from
    its decode steps (as fp16 does on a GPU: random weights leave near-ties that flip): the speculative text
    leaves the plain one, and the acceptance must still be the configured rate. The first replay draft took
    the target's tokens from a plain run and lost them at the first flip (on an H100: 0.32 at a = 0.8, draft
    length 1)."""
    from benchmarks.speculative import ReplayDrafter, drive

    model, tok, draft = draft_pair(tmp_path)
    forward_batch = model.forward_batch
    noise = torch.Generator().manual_seed(3)

    def rounding(ids: torch.Tensor, batch: Any, **kw: Any) -> torch.Tensor:
        out = forward_batch(ids, batch, **kw)
        if batch.q_len > 1 and not kw.get("preprocess_only"):
            out = out + 0.5 * torch.randn(out.shape, generator=noise).to(out.device)  # verification: flips
        return out

    n = 48
    ids = [tok.encode(p, add_bos=True) for p in PROMPTS[:3]]
    plain = spec_gen()
    jobs = [job(i, n) for i in ids]
    plain.enqueue(jobs)
    _, plain_out = drive(plain, jobs)
    monkeypatch.setattr(model, "forward_batch", rounding)
    g = spec_gen(draft)
    assert g.spec is not None
    replay = ReplayDrafter(g.spec.drafter, 1.0, len(g.pieces))
    g.spec.drafter = replay
    with replay.patched():
        for rate in (1.0, 0.8):
            replay.rate = rate
            jobs = [job(i, n) for i in ids]
            g.enqueue(jobs)
            g.reset_sd_stats()
            _, out = drive(g, jobs)
            assert [out[j] for j in jobs] != list(plain_out.values())  # the scenario: the texts part
            acc, k_mean = g.spec.acceptance_per_token(), g.spec.mean_draft_length()
            assert abs(acc - rate) < 0.08 and k_mean >= (5 if rate == 1.0 else 2), (rate, acc, k_mean)
    from exlpy.generator.speculative import dynamic

    assert dynamic.verify_rows is verify_rows  # patched() put the library's verification back
