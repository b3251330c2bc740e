"""ExLlamaV2Sampler end to end: the chain through sample(), the draw's statistics, seeds, filters, helpers and
bad settings. Tiny vocabularies, all on CPU."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from exlpy.errors import SamplerError
from exlpy.generator.sampler import ExLlamaV2Sampler
from exlpy.generator.sampling.hooks import PostSamplingResult
from exlpy.generator.sampling.tokenizer_info import default_dry_breakers, default_xtc_ignore
from exlpy.tokenizer import ExLlamaV2Tokenizer
from tests.conftest import shared_path

Settings = ExLlamaV2Sampler.Settings
P4 = [0.4, 0.3, 0.2, 0.1]


def plain(**kw: object) -> Settings:
    """Everything off except what the test turns on."""
    args: dict[str, object] = {"temperature": 1.0, "token_repetition_penalty": 1.0, "top_k": 0, "top_p": 0.0}
    args.update(kw)
    return Settings(**args)


def logits_of(ps: list[float], batch: int = 1) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in ps]).expand(batch, 1, -1).clone()


class FakeTokenizer:
    """The slice of the tokenizer API the sampler reads."""

    def __init__(self, pieces: list[str], eos: int | None = None, specials: dict[int, str] | None = None):
        self.pieces = pieces
        self.actual_vocab_size = len(pieces)
        self.eos_token_id = eos
        self.extended_id_to_piece = specials or {}
        self.config = SimpleNamespace(vocab_size=len(pieces))

    def get_id_to_piece_list(self, include_special_tokens: bool = False) -> list[str]:
        return self.pieces

    def single_id(self, piece: str) -> int:
        return self.pieces.index(piece)


class SetFilter:
    def __init__(self, pass_tokens: set[int], end_tokens: set[int]):
        self.pt, self.et = pass_tokens, end_tokens

    def begin(self, prefix: str) -> None:
        pass

    def feed(self, token: int) -> None:
        pass

    def next(self) -> tuple[set[int], set[int]]:
        return self.pt, self.et


def test_final_draw_matches_target_distribution() -> None:
    target = [0.35, 0.25, 0.15, 0.1, 0.07, 0.05, 0.02, 0.01]
    n = 20000
    gen = torch.Generator().manual_seed(1234)
    tok, _, _, prob, _ = ExLlamaV2Sampler.sample(logits_of(target, n), plain(), None, None, generator=gen)
    counts = torch.bincount(tok.reshape(-1), minlength=8).double()
    expected = torch.tensor(target, dtype=torch.float64) * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 24.3, f"chi-square {chi2:.1f} with 7 dof (p < 0.001 threshold 24.3)"
    torch.testing.assert_close(prob.reshape(-1), torch.tensor(target)[tok.reshape(-1)], atol=1e-6, rtol=0)


def test_same_seed_same_tokens_and_different_seed_differs() -> None:
    logits = torch.randn(64, 1, 50, generator=torch.Generator().manual_seed(0))
    s = Settings(top_k=0, top_p=0.95, temperature=1.0)
    runs = []
    for seed in (7, 7, 8):
        gen = torch.Generator().manual_seed(seed)
        runs.append(torch.cat([ExLlamaV2Sampler.sample(logits, s, None, None, generator=gen)[0]
                               for _ in range(3)], dim=1))
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_random_float_picks_the_point() -> None:
    s = plain()
    for r, want in ((0.05, 0), (0.45, 1), (0.75, 2), (0.95, 3)):
        assert ExLlamaV2Sampler.sample(logits_of(P4), s, None, r)[0].item() == want


def test_top_p_through_sample_returns_final_distribution() -> None:
    tok, ktok, kprob, prob, end = ExLlamaV2Sampler.sample(logits_of(P4), plain(top_p=0.75), None, 0.99,
                                                          return_top_tokens=4)
    assert tok.shape == (1, 1) and tok.dtype == torch.long and tok.item() == 1
    assert ktok.shape == (1, 1, 4) and ktok[0, 0, :2].tolist() == [0, 1]
    torch.testing.assert_close(kprob[0, 0], torch.tensor([4 / 7, 3 / 7, 0, 0]))
    assert prob.item() == pytest.approx(3 / 7) and end.tolist() == [False]


def test_greedy_and_low_temperature() -> None:
    logits = torch.tensor([[[0.1, 2.0, 1.9, -1.0]]])
    for s in (Settings.greedy(), Settings(temperature=0.005)):
        tok, _, _, prob, _ = ExLlamaV2Sampler.sample(logits, s, torch.tensor([[1, 1, 1]]), 0.99)
        assert tok.item() == 1 and prob.item() == 1.0
    g = Settings.greedy(top_p=0.5)
    assert (g.temperature, g.token_repetition_penalty, g.top_k, g.top_p) == (1.0, 1.0, 1, 0.5)


def test_temperature_last_applies_after_truncation() -> None:
    s = plain(temperature=2.0, temperature_last=True, min_p=0.4)  # min-p at T=1 keeps 0.4, 0.3, 0.2
    kprob = ExLlamaV2Sampler.sample(logits_of(P4), s, None, 0.5, return_top_tokens=4)[2]
    w = [0.4 ** 0.5, 0.3 ** 0.5, 0.2 ** 0.5]
    torch.testing.assert_close(kprob[0, 0], torch.tensor([x / sum(w) for x in w] + [0.0]))


def test_penalties_and_bias_reach_the_draw() -> None:
    # token 0 dominates until the presence penalty removes it
    logits = torch.tensor([[[5.0, 1.0, 0.0]]])
    s = Settings.greedy(token_presence_penalty=10.0)
    assert ExLlamaV2Sampler.sample(logits, s, torch.tensor([[0]]), 0.5)[0].item() == 1
    s = Settings.greedy(token_bias=torch.tensor([0.0, 0.0, 6.0]))
    assert ExLlamaV2Sampler.sample(logits, s, None, 0.5)[0].item() == 2
    assert ExLlamaV2Sampler.sample(logits, Settings.greedy(), None, 0.5, blocked_tokens=[0])[0].item() == 1


def test_dry_through_sample() -> None:
    tok = FakeTokenizer(["a", "b", "c", "d", ".", "e"])
    seq = torch.tensor([[0, 1, 2, 3, 0, 1, 2]])
    logits = torch.tensor([[[0.0, 0.0, 0.0, 1.0, 0.0, 0.0]]])
    s = Settings.greedy(dry_multiplier=2.0, dry_base=1.0, dry_allowed_length=2)
    assert ExLlamaV2Sampler.sample(logits, s, seq, 0.5, tokenizer=tok)[0].item() != 3
    # "." is a default breaker: a repeat broken by it is too short to be penalised
    seq = torch.tensor([[0, 1, 2, 3, 4, 1, 2, 4, 2]])
    assert ExLlamaV2Sampler.sample(logits, s, seq, 0.5, tokenizer=tok)[0].item() == 3


def test_xtc_probability_one_excludes_top_choice() -> None:
    s = plain(xtc_probability=1.0, xtc_threshold=0.25)
    kprob = ExLlamaV2Sampler.sample(logits_of(P4), s, None, 0.5, return_top_tokens=3)
    assert kprob[1][0, 0].tolist() == [1, 2, 3]
    torch.testing.assert_close(kprob[2][0, 0], torch.tensor([0.5, 1 / 3, 1 / 6]))
    # a newline piece (default ignore set) is never excluded
    tok = FakeTokenizer(["\n", "x", "y", "z"])
    ktok = ExLlamaV2Sampler.sample(logits_of(P4), s, None, 0.5, tokenizer=tok, return_top_tokens=1)[1]
    assert ktok.item() == 0


def test_xtc_partial_probability_resorts_candidates() -> None:
    # top choice 0.4 -> 0.04, the rest scaled by (1 - 0.1 * 0.4) / 0.6 = 1.6: order becomes 1, 2, 3, 0
    s = plain(xtc_probability=0.9, xtc_threshold=0.25)
    tok, ktok, kprob, prob, _ = ExLlamaV2Sampler.sample(logits_of(P4), s, None, 0.99, return_top_tokens=4)
    assert ktok[0, 0].tolist() == [1, 2, 3, 0]
    torch.testing.assert_close(kprob[0, 0], torch.tensor([0.48, 0.32, 0.16, 0.04]))
    assert tok.item() == 0 and prob.item() == pytest.approx(0.04)


def test_skew_shifts_draw_to_less_likely() -> None:
    assert ExLlamaV2Sampler.sample(logits_of(P4), plain(), None, 0.25)[0].item() == 0
    assert ExLlamaV2Sampler.sample(logits_of(P4), plain(skew=math.log(4)), None, 0.25)[0].item() == 2  # r'=.707


def test_mirostat_state_in_settings() -> None:
    s = plain(mirostat=True, mirostat_tau=1.0, mirostat_eta=0.1)
    tok, _, _, prob, _ = ExLlamaV2Sampler.sample(logits_of(P4, 2), s, None, 0.1)
    assert prob[0].item() == pytest.approx(4 / 7)  # mu = 2 tau = 2 keeps p >= 0.25
    assert isinstance(s.mirostat_mu, list) and len(s.mirostat_mu) == 2
    assert float(s.mirostat_mu[0]) == pytest.approx(2.0 + 0.1 * (1.0 + math.log2(4 / 7)), abs=1e-5)
    with pytest.raises(SamplerError, match="mirostat_mu"):
        ExLlamaV2Sampler.sample(logits_of(P4, 3), s, None, 0.1)


def test_cfg_merges_two_rows() -> None:
    pos, neg = [0.1, 0.5, 0.4], [0.1, 0.8, 0.1]
    logits = torch.stack([logits_of(pos)[0], logits_of(neg)[0]])
    tok, _, kprob, _, end = ExLlamaV2Sampler.sample(logits, plain(cfg_scale=2.0), torch.tensor([[0], [1]]), 0.5,
                                                    return_top_tokens=3)
    w = [p ** 2 / q for p, q in zip(pos, neg)]
    assert tok.shape == (1, 1) and end.shape == (1,)
    torch.testing.assert_close(kprob[0, 0], torch.tensor(sorted([x / sum(w) for x in w], reverse=True)))
    with pytest.raises(SamplerError, match="cfg_scale"):
        ExLlamaV2Sampler.sample(logits_of(P4, 3), plain(cfg_scale=2.0), None, 0.5)


def test_filters_objects_callables_and_end_tokens() -> None:
    logits = logits_of([0.5, 0.2, 0.2, 0.1])
    tok, _, _, _, end = ExLlamaV2Sampler.sample(logits, Settings.greedy(), None, 0.5,
                                                filters=[SetFilter({2, 3}, {3}), SetFilter({1, 2, 3}, set())])
    assert tok.item() == 2 and end.tolist() == [False]
    tok, _, _, prob, end = ExLlamaV2Sampler.sample(logits, plain(), None, 0.9, filters=[SetFilter({3}, {3})])
    assert tok.item() == 3 and prob.item() == 1.0 and end.tolist() == [True]
    only_odd = lambda lg: torch.arange(lg.shape[-1]) % 2 == 1
    assert ExLlamaV2Sampler.sample(logits, Settings.greedy(), None, 0.5, filters=[only_odd])[0].item() == 1
    eos_tok = FakeTokenizer(["a", "b", "c", "d"], eos=1)
    tok = ExLlamaV2Sampler.sample(logits, plain(), None, 0.0, tokenizer=eos_tok, filter_prefer_eos=True,
                                  filters=[SetFilter({1, 0}, set())])[0]
    assert tok.item() == 1
    with pytest.raises(SamplerError, match="Filter excluded all tokens"):
        ExLlamaV2Sampler.sample(logits, plain(), None, 0.5, filters=[SetFilter({1}, set()), SetFilter({2}, set())])
    with pytest.raises(SamplerError, match="Filter excluded all tokens"):
        ExLlamaV2Sampler.sample(logits, plain(), None, 0.5, filters=[lambda lg: torch.zeros(4, dtype=torch.bool)])


def test_token_healing_and_vocab_limit() -> None:
    tok = FakeTokenizer(["ab", "a", "abc", "b", "ba"])
    logits = torch.tensor([[[0.0, 1.0, 0.5, 9.0, 8.0, 7.0, 7.5]]])  # 7 logits, tokenizer knows 5
    out = ExLlamaV2Sampler.sample(logits, plain(), None, 0.5, tokenizer=tok, prefix_token=torch.tensor([[1]]),
                                  return_top_tokens=3)
    assert sorted(out[1][0, 0].tolist()) == [0, 1, 2]  # pieces starting with "a"
    assert ExLlamaV2Sampler.sample(logits, Settings.greedy(), None, 0.5, tokenizer=tok)[0].item() == 3


def test_post_sampling_hook_can_override() -> None:
    seen: list[PostSamplingResult] = []

    def force_last(res: PostSamplingResult) -> None:
        seen.append(res)
        res.sampled_token = torch.full_like(res.sampled_token, 3)

    s = Settings.greedy(post_sampling_hooks=[force_last])
    assert ExLlamaV2Sampler.sample(logits_of(P4), s, None, 0.5)[0].item() == 3
    assert seen and seen[0].logits.shape == (1, 4)


def test_float16_and_2d_logits_with_cpu_context() -> None:
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(3)).half()
    tok, _, _, prob, _ = ExLlamaV2Sampler.sample(logits, Settings(), torch.randint(0, 40, (2, 30)), 0.3)
    assert tok.shape == (2, 1) and prob.shape == (2, 1) and bool((prob > 0).all())


def test_helpers_clone_disallow_allow() -> None:
    tok = FakeTokenizer([f"t{i}" for i in range(40)])
    s = Settings()
    s.disallow_tokens(tok, [3, 5])
    assert s.token_bias.shape == (64,) and torch.isinf(s.token_bias[[3, 5]]).all() and s.token_bias[4] == 0
    c = s.clone()
    c.disallow_tokens(tok, [4])
    assert s.token_bias[4] == 0 and torch.isinf(c.token_bias[4])
    a = Settings()
    a.allow_tokens(tok, [2, "t7"])
    assert torch.isfinite(a.token_bias).nonzero().reshape(-1).tolist() == [2, 7]
    with pytest.raises(SamplerError, match="token id 99"):
        a.disallow_tokens(tok, [99])
    g = Settings(token_repetition_penalty=1.3, dry_multiplier=0.7, dry_base=2.5, top_p=0.9).greedy_clone()
    assert (g.top_k, g.top_p, g.token_repetition_penalty, g.dry_multiplier, g.dry_base) == (1, 0, 1.3, 0.7, 2.5)


def test_defaults_match_spec() -> None:
    s = Settings()
    assert (s.token_repetition_penalty, s.token_repetition_range, s.temperature, s.top_k, s.top_p) == \
        (1.025, -1, 0.8, 50, 0.8)
    assert (s.dry_allowed_length, s.dry_base, s.dry_multiplier, s.dry_max_ngram) == (2, 1.75, 0.0, 20)
    assert (s.xtc_probability, s.xtc_threshold, s.mirostat_tau, s.mirostat_eta) == (0.0, 0.1, 1.5, 0.1)


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.5), ("top_p", 1.5), ("min_p", -0.1), ("min_p", 1.1), ("top_k", -1), ("top_k", 2.5),
    ("token_repetition_range", -2), ("token_repetition_decay", -1), ("dry_range", -1), ("typical", 2.0),
    ("xtc_probability", 1.5), ("token_repetition_penalty", 0.0), ("temperature", float("nan")),
    ("dry_max_ngram", 0), ("mirostat", 1),
])
def test_bad_settings_are_named(field: str, value: object) -> None:
    with pytest.raises(SamplerError, match=field):
        Settings(**{field: value})
    s = Settings()
    setattr(s, field, value)  # users mutate fields: sample() validates again
    with pytest.raises(SamplerError, match=field):
        ExLlamaV2Sampler.sample(logits_of(P4), s, None, 0.5)


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="top_kk"):
        Settings(top_kk=3)
    with pytest.raises(TypeError, match="nonsense"):
        Settings.greedy(nonsense=1)
    with pytest.raises(SamplerError, match="random"):
        ExLlamaV2Sampler.sample(logits_of(P4), plain(), None, 1.0)
    with pytest.raises(SamplerError, match="logits"):
        ExLlamaV2Sampler.sample(torch.zeros(1, 2, 4), plain(), None, 0.5)
    with pytest.raises(SamplerError, match="return_top_tokens"):
        ExLlamaV2Sampler.sample(logits_of(P4), plain(), None, 0.5, return_top_tokens=5)
    with pytest.raises(SamplerError, match="sequence_ids"):
        ExLlamaV2Sampler.sample(logits_of(P4, 2), plain(), torch.zeros(3, 4, dtype=torch.long), 0.5)


def test_real_tokenizer_breakers_ignore_and_healing() -> None:
    tok = ExLlamaV2Tokenizer(str(shared_path("models", "aidreams260K")))
    pieces = tok.get_id_to_piece_list(True)
    breakers = default_dry_breakers(tok)
    assert tok.eos_token_id in breakers and all(i in breakers for i, p in enumerate(pieces) if "." in p)
    assert not any(i in breakers for i, p in enumerate(pieces) if p.isalpha())
    assert tok.eos_token_id in default_xtc_ignore(tok)
    prefix = pieces.index(" a")
    logits = torch.randn(1, 1, len(pieces), generator=torch.Generator().manual_seed(5))
    ktok = ExLlamaV2Sampler.sample(logits, plain(), None, 0.5, tokenizer=tok, prefix_token=torch.tensor([[prefix]]),
                                   return_top_tokens=3)[1]
    assert all(pieces[i].startswith(" a") for i in ktok.reshape(-1).tolist())
