"""Each sampler step alone, against distributions computed by hand (plain Python) on tiny vocabularies."""

from __future__ import annotations

import math

import pytest
import torch

from exlpy.generator.sampling import truncation
from exlpy.generator.sampling.cfg import cfg_merge
from exlpy.generator.sampling.chain import candidates
from exlpy.generator.sampling.draw import draw
from exlpy.generator.sampling.dry import dry_penalty
from exlpy.generator.sampling.logit_masks import add_token_bias, block_tokens, limit_vocab
from exlpy.generator.sampling.mirostat import mirostat_truncate, mirostat_update, mu_tensor
from exlpy.generator.sampling.penalties import apply_penalties
from exlpy.generator.sampling.skew import skew_random
from exlpy.generator.sampling.temperature import (
    apply_temperature,
    dynamic_temperature,
    softmax_with_temperature,
)
from exlpy.generator.sampling.xtc import xtc

P4 = [0.4, 0.3, 0.2, 0.1]


def t(rows: list[float] | list[list[float]]) -> torch.Tensor:
    x = torch.tensor(rows, dtype=torch.float32)
    return x if x.dim() == 2 else x.unsqueeze(0)


def norm(ps: list[float]) -> list[float]:
    s = sum(ps)
    return [p / s for p in ps]


def close(a: torch.Tensor, expected: list[float], atol: float = 1e-6) -> None:
    torch.testing.assert_close(a.reshape(-1), torch.tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


def softmax_py(xs: list[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [v / sum(e) for v in e]


LOGITS = [1.3, -0.2, 2.1, 0.7, -1.5, 0.1, 1.9, -0.6]


def test_temperature_softmax() -> None:
    close(softmax_with_temperature(t(LOGITS), 0.7, 0.0), softmax_py([x / 0.7 for x in LOGITS]))


def test_smoothing_factor_is_quadratic_around_max() -> None:
    s, temp = 0.4, 1.25
    expected = softmax_py([-(x - 2.1) ** 2 * s / temp for x in LOGITS])
    close(softmax_with_temperature(t(LOGITS), temp, s), expected)


def test_top_k_candidates_sorted_and_renormalised() -> None:
    probs, ids = candidates(t(LOGITS), 1.0, 0.0, 3)
    assert ids.tolist() == [[2, 6, 0]]
    p = softmax_py(LOGITS)
    close(probs, norm([p[2], p[6], p[0]]))
    full, ids_all = candidates(t(LOGITS), 1.0, 0.0, 0)
    assert ids_all.shape == (1, 8) and ids_all[0, :3].tolist() == [2, 6, 0]
    close(full, sorted(p, reverse=True))


def test_top_p_excludes_the_crossing_token() -> None:
    # cumulative 0.4, 0.7, 0.9: with p = 0.75 the third token would cross p, so only two survive (HF keeps 3)
    close(truncation.top_p(t(P4), 0.75), [4 / 7, 3 / 7, 0, 0])
    close(truncation.top_p(t(P4), 0.7), [4 / 7, 3 / 7, 0, 0])  # reaching p exactly is still <= p
    close(truncation.top_p(t(P4), 0.35), [1, 0, 0, 0])  # at least one token survives
    close(truncation.top_p(t([0.6, 0.3999995, 5e-7]), 0.99999999), norm([0.6, 0.3999995, 0]))  # < 1e-6 dropped


def test_top_a_and_min_p() -> None:
    p = [0.5, 0.3, 0.15, 0.05]
    close(truncation.top_a(t(p), 0.5), norm([0.5, 0.3, 0.15, 0]))  # threshold 0.5 * 0.5^2 = 0.125
    close(truncation.min_p(t(p), 0.5), norm([0.5, 0.3, 0, 0]))  # threshold 0.25


def test_tail_free() -> None:
    p = [0.4, 0.3, 0.2, 0.06, 0.04]
    # |2nd differences| = 0.0, 0.04, 0.12 -> normalised 0, 0.25, 0.75 -> cumulative 0, 0.25, 1.0
    close(truncation.tail_free(t(p), 0.5), norm([0.4, 0.3, 0.2, 0, 0]))  # k = 2 -> keep 3
    close(truncation.tail_free(t(p), 0.2), norm([0.4, 0.3, 0, 0, 0]))  # k = 1 -> keep 2
    close(truncation.tail_free(t([0.7, 0.3]), 0.1), [0.7, 0.3])  # < 3 candidates: unchanged


def typical_py(ps: list[float], mass: float) -> list[float]:
    h = -sum(p * math.log(p) for p in ps)
    order = sorted(range(len(ps)), key=lambda i: abs(-math.log(ps[i]) - h))
    keep, cum = set(), 0.0
    for i in order:
        keep.add(i)
        cum += ps[i]
        if cum >= mass:
            break
    return norm([p if i in keep else 0.0 for i, p in enumerate(ps)])


@pytest.mark.parametrize("mass", [0.3, 0.6, 0.9])
def test_typical(mass: float) -> None:
    p = [0.5, 0.2, 0.15, 0.1, 0.05]
    close(truncation.typical(t(p), mass), typical_py(p, mass))


def test_typical_can_drop_the_most_likely_token() -> None:
    # H = 1.089; |surprise - H| is 0.173 for p = 0.4 but 0.115 for p = 0.3: a 0.3 token is the most typical,
    # and alone reaches mass 0.25
    close(truncation.typical(t([0.4, 0.3, 0.3]), 0.25), [0.0, 1.0, 0.0])


def test_post_and_dynamic_temperature() -> None:
    p = [0.5, 0.3, 0.2]
    close(apply_temperature(t(p), 2.0), norm([x ** 0.5 for x in p]))
    h = -sum(x * math.log(x) for x in p)
    temp = 0.5 + (1.5 - 0.5) * (h / math.log(3)) ** 2.0
    close(dynamic_temperature(t(p), 0.5, 1.5, 2.0), norm([x ** (1 / temp) for x in p]))
    close(dynamic_temperature(t([1.0, 0.0, 0.0]), 0.5, 1.5, 1.0), [1.0, 0.0, 0.0])


def test_mirostat_truncate_and_update() -> None:
    mu = mu_tensor(None, 1, 1.0, torch.device("cpu"))
    assert mu.item() == 2.0  # starts at 2 tau -> keep p >= 2^-2 = 0.25
    close(mirostat_truncate(t(P4), mu), [4 / 7, 3 / 7, 0, 0])
    new = mirostat_update(mu, torch.tensor([[0.5]]), tau=1.0, eta=0.1)
    assert new.item() == pytest.approx(2.0 + 0.1 * (1.0 - 1.0))
    new = mirostat_update(mu, torch.tensor([[0.125]]), tau=1.0, eta=0.1)
    assert new.item() == pytest.approx(2.0 + 0.1 * (1.0 - 3.0))


def test_penalties_whole_context() -> None:
    logits = t([1.0, -1.0, 2.0, 0.5, 0.0, 3.0])
    seq = torch.tensor([[0, 1, 0, 3, 2]])
    out = apply_penalties(logits, seq, 2.0, -1, 0, frequency=0.1, presence=0.2)
    # token 0 seen twice: 1/2 - 0.2 - 2*0.1; token 1: -1*2 - 0.2 - 0.1; tokens 4, 5 unseen
    close(out, [0.1, -2.3, 0.7, -0.05, 0.0, 3.0], atol=1e-6)


def test_penalties_range_and_decay() -> None:
    logits = t([1.0, -1.0, 2.0, 0.5, 0.0, 3.0])
    seq = torch.tensor([[0, 1, 0, 3, 2]])
    # distance from the end: token2 0, token3 1 (range 2, full); token0 2 (first decay token, weight 1);
    # token1 3 (weight 1 - 1/2); the oldest token0 4 (weight 0)
    out = apply_penalties(logits, seq, 2.0, 2, 2, frequency=0.1, presence=0.2)
    close(out, [0.2, -1.0 * 1.5 - 0.1 - 0.05, 0.7, -0.05, 0.0, 3.0], atol=1e-6)
    untouched = apply_penalties(logits, seq, 2.0, 0, 0, frequency=0.1, presence=0.2)
    close(untouched, [1.0, -1.0, 2.0, 0.5, 0.0, 3.0])


def test_dry_longest_suffix() -> None:
    breakers = torch.zeros(10, dtype=torch.bool)
    breakers[9] = True
    seq = torch.tensor([[1, 2, 3, 4, 5, 1, 2, 3]])  # suffix "1 2 3" seen before, followed by 4
    pen = dry_penalty(seq, 10, breakers, 1.0, 2.0, 2, 20)
    close(pen, [0, 0, 0, 0, -2.0, 0, 0, 0, 0, 0])  # -1 * 2^(3 - 2)
    # a breaker right before "2 3" stops the match at length 2 -> -1 * 2^0
    seq = torch.tensor([[1, 2, 3, 4, 5, 1, 9, 2, 3]])
    close(dry_penalty(seq, 10, breakers, 1.0, 2.0, 2, 20), [0, 0, 0, 0, -1.0, 0, 0, 0, 0, 0])
    # longest suffix below allowed_length -> nothing
    close(dry_penalty(seq, 10, breakers, 1.0, 2.0, 3, 20), [0.0] * 10)


def test_dry_counts_and_ngram_cap() -> None:
    breakers = torch.zeros(10, dtype=torch.bool)
    breakers[9] = True
    seq = torch.tensor([[9, 1, 2, 7, 9, 1, 2, 7, 9, 1, 2]])  # "1 2" followed by 7 twice
    close(dry_penalty(seq, 10, breakers, 0.5, 2.0, 2, 20), [0, 0, 0, 0, 0, 0, 0, -1.0, 0, 0])
    seq = torch.tensor([[1, 2, 3, 4, 5, 1, 2, 3]])
    # max_ngram 3: suffixes of at most 2 tokens ("2 3") -> -1 * 2^0
    close(dry_penalty(seq, 10, breakers, 1.0, 2.0, 2, 3), [0, 0, 0, 0, -1.0, 0, 0, 0, 0, 0])


def test_xtc() -> None:
    # 0.4 and 0.3 are >= 0.25: the top choice 0.4 goes, the least likely of them (0.3) stays
    close(xtc(t(P4), torch.tensor([[0, 1, 2, 3]]), 1.0, 0.25, None), [0, 0.5, 1 / 3, 1 / 6])
    # probability 0.5: expected result of the coin flip
    close(xtc(t(P4), torch.tensor([[0, 1, 2, 3]]), 0.5, 0.25, None), [0.2, 0.4, 0.8 / 3, 0.4 / 3])
    ignore = torch.zeros(4, dtype=torch.bool)
    ignore[0] = True  # token 0 ignored -> only one eligible token -> unchanged
    close(xtc(t(P4), torch.tensor([[0, 1, 2, 3]]), 1.0, 0.25, ignore), P4)
    close(xtc(t(P4), torch.tensor([[0, 1, 2, 3]]), 1.0, 0.35, None), P4)  # only one above threshold


def test_skew_bends_random_point() -> None:
    assert skew_random(torch.tensor([[0.25]]), math.log(2)).item() == pytest.approx(0.5)
    assert skew_random(torch.tensor([[0.25]]), 0.0).item() == pytest.approx(0.25)


def test_draw_inverse_cdf_quantiles_exact() -> None:
    n = 1000
    probs = t(P4).expand(n, -1)
    r = ((torch.arange(n, dtype=torch.float32) + 0.5) / n).unsqueeze(1)
    idx, prob = draw(probs, r)
    counts = torch.bincount(idx.reshape(-1), minlength=4)
    assert counts.tolist() == [400, 300, 200, 100]
    torch.testing.assert_close(prob.reshape(-1), torch.tensor(P4)[idx.reshape(-1)])


def test_draw_never_picks_zero_prob_even_at_r_near_one() -> None:
    probs = t([[0.7, 0.3, 0.0, 0.0], [0.3, 0.0, 0.7, 0.0]]) * 0.999  # sums slightly below 1
    idx, prob = draw(probs, torch.tensor([[0.99999994], [0.99999994]]))
    assert idx.tolist() == [[1], [2]]
    close(prob, [0.3, 0.7])


def test_token_bias_block_vocab_limit_cfg() -> None:
    logits = t([[0.5, 1.0, -1.0, 2.0]])
    close(add_token_bias(logits, torch.tensor([1.0, 0.0, 0.5, -3.0, 9.0])), [1.5, 1.0, -0.5, -1.0])
    close(block_tokens(logits, [1, 3]), [0.5, -1e30, -1.0, -1e30])
    out = limit_vocab(logits, 2)
    assert out[0, :2].tolist() == [0.5, 1.0] and torch.isinf(out[0, 2:]).all()
    pos, neg = [0.5, 1.0, -1.0, 2.0], [1.0, 0.0, 0.3, 0.2]

    def lsm(xs: list[float]) -> list[float]:
        return [math.log(p) for p in softmax_py(xs)]

    expected = [1.5 * a - 0.5 * b for a, b in zip(lsm(pos), lsm(neg))]
    close(cfg_merge(t([pos, neg]), 1.5), expected, atol=1e-5)
