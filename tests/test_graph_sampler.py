"""The captured sampler (exlpy/generator/sampling/graphed.py) and its fused kernel (kernels/sample_top.py).

Oracles: the host sampler (`ExLlamaV2Sampler.sample`, the reference chain) for exact tokens at given random
points and for deterministic settings; chi-square tests of sampled-token histograms (in-kernel Philox draws)
against the host chain's exact distribution; the generators' old device path and full-forward oracles.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from exlpy import ExLlamaV2Cache
from exlpy.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler
from exlpy.generator.sampler import final_distribution
from exlpy.generator.sampling import chain
from exlpy.generator.sampling.graphed import K_MAX, GraphRow, GraphSampler, graph_capable
from exlpy.kernels import reference
from tests.conftest import requires_cuda

Settings = ExLlamaV2Sampler.Settings

COMBOS = {
    "default": Settings(),
    "topk_topp_minp_rep": Settings(temperature=0.9, top_k=40, top_p=0.9, min_p=0.05, token_repetition_penalty=1.2),
    "freq_presence_topa": Settings(temperature=1.1, top_k=64, top_p=1.0, top_a=0.2, token_repetition_penalty=1.0,
                                   token_frequency_penalty=0.3, token_presence_penalty=0.4),
    "plain_temperature": Settings(temperature=1.3, top_k=100, top_p=1.0, token_repetition_penalty=1.0),
    "server_top_p": Settings(temperature=1.0, top_k=0, top_p=0.9, token_repetition_penalty=1.0),  # whole vocab
    "min_p_only": Settings(temperature=1.2, top_k=0, top_p=1.0, min_p=0.01, token_repetition_penalty=1.05),
    "penalty_window": Settings(temperature=1.0, top_k=50, top_p=0.95, token_repetition_penalty=1.4,
                               token_repetition_range=12, token_repetition_decay=8, token_frequency_penalty=0.3,
                               token_presence_penalty=0.2),
    "penalty_range_only": Settings(temperature=0.8, top_k=0, top_p=0.9, token_repetition_penalty=1.3,
                                   token_repetition_range=20),
}
DETERMINISTIC = {
    "greedy": Settings.greedy(),
    "top_k_1": Settings(top_k=1, temperature=0.7),
    "temperature_0": Settings(temperature=0.0, top_k=0, top_p=0.9),
    "greedy_penalised": Settings.greedy(token_repetition_penalty=1.5, token_presence_penalty=0.5),
}
SKEWED = Settings(temperature=1.5, top_k=30, top_p=0.95, skew=0.7, token_repetition_penalty=1.0)
EXTENDED = {  # candidate steps in torch after the kernel (top-k within the candidates), and smoothing
    "typical": Settings(temperature=1.0, top_k=80, top_p=1.0, typical=0.7),
    "tfs": Settings(top_k=100, top_p=1.0, tfs=0.9),
    "temperature_last": Settings(temperature=1.7, temperature_last=True, top_k=60, top_p=0.95, min_p=0.05),
    "dynamic_temperature": Settings(min_temp=0.5, max_temp=1.5, temp_exponent=1.2, top_k=50),
    "xtc": Settings(xtc_probability=0.5, xtc_threshold=0.05, top_k=50, temperature=0.7),
    "smoothing": Settings(smoothing_factor=0.3, top_k=0, top_p=0.9),
}


def _case(vocab: int = 300, rows: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 2.5, torch.randint(0, vocab, (rows, 48), generator=g)


@pytest.mark.parametrize("name", [*COMBOS, *DETERMINISTIC, "skew", *EXTENDED])
def test_same_token_as_host_sampler_at_the_same_point(name: str) -> None:
    """Three rows over four steps: penalty counts follow the sampled tokens in the sampler itself."""
    settings = {**COMBOS, **DETERMINISTIC, "skew": SKEWED, **EXTENDED}[name]
    assert graph_capable(settings, 300)
    logits, context = _case()
    gs = GraphSampler(300, logits.device, slots=3)
    seqs = [context[i].clone() for i in range(3)]
    for i in range(3):
        gs.bind_counts(i, seqs[i])
    for step, base in enumerate((0.05, 0.41, 0.77, 0.93)):
        points = [(base + 0.29 * i) % 1.0 for i in range(3)]
        tokens, probs, ok = gs.sample(logits, [GraphRow(settings, slot=i, point=points[i]) for i in range(3)])
        assert bool(ok.all())
        for i in range(3):
            tok, _, _, prob, _ = ExLlamaV2Sampler.sample(logits[i:i + 1], settings, seqs[i].unsqueeze(0), points[i])
            assert int(tokens[i]) == int(tok), (name, step, i)
            assert float(probs[i]) == pytest.approx(float(prob), rel=1e-4, abs=1e-6)
            seqs[i] = torch.cat([seqs[i], tok.view(1)])


def test_mixed_rows_in_one_step_match_host() -> None:
    """Rows with the candidate steps, whole-vocabulary top-p, greedy and penalties share one step."""
    kinds = [EXTENDED["typical"], COMBOS["server_top_p"], Settings.greedy(), COMBOS["topk_topp_minp_rep"],
             COMBOS["penalty_window"]]
    logits, context = _case(rows=5, seed=5)
    gs = GraphSampler(300, logits.device, slots=5)
    for i in range(5):
        gs.bind_counts(i, context[i])
    points = [0.13, 0.52, 0.7, 0.91, 0.33]
    tokens, _, ok = gs.sample(logits, [GraphRow(k, slot=i, point=p) for i, (k, p) in enumerate(zip(kinds, points))])
    assert bool(ok.all())
    for i, (k, p) in enumerate(zip(kinds, points)):
        assert int(tokens[i]) == int(ExLlamaV2Sampler.sample(logits[i:i + 1], k, context[i:i + 1], p)[0])


def test_blocked_tokens_bias_mask_and_vocab_limit_match_host() -> None:
    logits, context = _case(rows=2, seed=3)
    bias = torch.zeros(320)
    bias[[5, 17, 250]] = torch.tensor([4.0, -3.0, 6.0])
    s = Settings(temperature=0.8, top_k=50, top_p=0.9, token_bias=bias)
    mask = torch.full((1, 10), -1, dtype=torch.int32)
    mask[0, 0] = 0x0000FFFF  # tokens 16-31 excluded
    mask[0, 7] = 0  # tokens 224-255 excluded
    gs = GraphSampler(300, logits.device, slots=2, limit=290)
    for i in range(2):
        gs.bind_counts(i, context[i])
    blocked = [250, 3]

    def allowed(x: torch.Tensor) -> torch.Tensor:
        return reference.apply_token_bitmask(torch.zeros(1, 300), mask).isfinite().expand(x.shape[0], -1)

    class Tok:  # the vocab-limit step of the host chain reads the tokenizer's size
        actual_vocab_size = 290

    for point in (0.1, 0.5, 0.9):
        for i in range(2):
            gs.bind_counts(i, context[i])  # the same context at every point
        rows = [GraphRow(s, slot=0, point=point, blocked=blocked, mask=mask), GraphRow(s, slot=1, point=point)]
        tokens, _, _ = gs.sample(logits, rows)
        want0 = ExLlamaV2Sampler.sample(logits[:1], s, context[:1], point, Tok(), blocked_tokens=blocked,
                                        filters=[allowed])[0]
        want1 = ExLlamaV2Sampler.sample(logits[1:], s, context[1:], point, Tok())[0]
        assert [int(tokens[0]), int(tokens[1])] == [int(want0), int(want1)]


def test_a_slot_reused_without_bias_has_none() -> None:
    logits, _ = _case(rows=2, seed=9)
    gs = GraphSampler(300, logits.device, slots=2)
    bias = torch.zeros(300)
    bias[7] = 50.0
    biased = Settings.greedy(token_bias=bias)
    assert gs.sample(logits, [GraphRow(biased, slot=0), GraphRow(biased, slot=1)])[0].tolist() == [7, 7]
    del biased, bias  # the job ends; slot 0 goes to a job without bias while slot 1 keeps one
    bias = torch.zeros(300)
    bias[9] = 50.0
    t = gs.sample(logits, [GraphRow(Settings.greedy(), slot=0), GraphRow(Settings.greedy(token_bias=bias), slot=1)])
    assert t[0].tolist() == [int(logits[0].argmax()), 9]


def _chi2_limit(df: int) -> float:
    """The 0.999 quantile of chi-square with df degrees of freedom (Wilson-Hilferty)."""
    z = 3.0902
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("name", list(COMBOS))
def test_philox_draws_follow_the_host_distribution(name: str) -> None:
    """Histogram of 6400 in-kernel draws (64 rows, own seeds, 100 steps) against the host chain's distribution."""
    settings = COMBOS[name]
    logits, context = _case(vocab=200, rows=1, seed=7)
    rows = 64
    gs = GraphSampler(200, logits.device, slots=rows)
    x = logits.expand(rows, -1)
    counts = torch.zeros(200)
    for step in range(100):
        for i in range(rows):
            gs.bind_counts(i, context[0])  # the same context every step: one fixed distribution
        tok, _, ok = gs.sample(x, [GraphRow(settings, slot=i, seed=1000 + i, counter=step) for i in range(rows)])
        assert bool(ok.all())
        counts += torch.bincount(tok, minlength=200).float()
    ctx = chain.LogitContext(context[:1])
    probs, ids, _, _ = final_distribution(logits.clone(), settings, ctx, None)
    expected = torch.zeros(200).scatter_(0, ids[0], probs[0] / probs[0].sum()) * counts.sum()
    assert counts[expected == 0].sum() == 0, "drew a token the host chain excludes"
    big = expected >= 5
    rest_e, rest_o = expected[~big & (expected > 0)].sum(), counts[~big & (expected > 0)].sum()
    obs = torch.cat([counts[big], rest_o.view(1)]) if rest_e > 0 else counts[big]
    exp = torch.cat([expected[big], rest_e.view(1)]) if rest_e > 0 else expected[big]
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    df = max(1, obs.numel() - 1)
    assert chi2 < _chi2_limit(df), f"{name}: chi2 {chi2:.1f} over {df} dof"


def test_philox_is_counter_based() -> None:
    seed = torch.tensor([1, 1, 2, 2**40 + 3])
    counter = torch.tensor([0, 1, 0, 2**33])
    u = reference.philox_uniform(seed, counter)
    assert ((u >= 0) & (u < 1)).all() and len(set(u.tolist())) == 4
    assert torch.equal(u, reference.philox_uniform(seed, counter))  # a pure function of (seed, counter)
    many = reference.philox_uniform(torch.full((20000,), 9), torch.arange(20000))
    assert abs(float(many.mean()) - 0.5) < 0.01 and abs(float(many.var()) - 1 / 12) < 0.003


def test_settings_outside_the_graph_are_refused() -> None:
    assert graph_capable(Settings(top_k=0, top_p=0.9), 1000)  # whole-vocabulary top-p: the third kernel
    assert not graph_capable(Settings(top_k=K_MAX + 1), 1000)  # top-k past the candidates: host chain
    assert graph_capable(Settings(top_k=K_MAX + 1), K_MAX)  # unless the vocabulary fits the candidates
    assert graph_capable(Settings(typical=0.5), 1000)  # top-k 50: the candidate steps run in the graph
    assert not graph_capable(Settings(typical=0.5, top_k=0), 1000)  # they need every survivor among the candidates
    assert not graph_capable(Settings(mirostat=True), 1000)
    assert not graph_capable(Settings(dry_multiplier=0.8), 1000)
    assert graph_capable(Settings(token_repetition_range=64, token_repetition_decay=64), 1000)  # the window
    assert not graph_capable(Settings(token_repetition_range=4000, token_repetition_decay=200), 1000)
    assert graph_capable(Settings(token_repetition_decay=64), 1000)  # no range: the whole context, decay unused
    assert graph_capable(Settings(token_repetition_range=64, token_repetition_penalty=1.0), 1000)


# --- the fused kernel under Triton's interpreter -------------------------------------------------------------------

def _kernel_case(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows 0-2 with top-k (the candidates decide), rows 3-6 without: flat enough that the survivors pass 32
    candidates (the whole-vocabulary kernel), with ties everywhere (row 3) and at a top-p boundary (row 6)."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(7, vocab, generator=g) * 3
    x[3:] /= 3
    x[1, 7] = float("-inf")
    x[3, :] = x[3, 0]  # the lower id first
    x[6, 100:140] = 2.5
    v = float(vocab)
    params = torch.tensor([[0.8, 30, 0.8, 0, 0, 1, -1], [1, 1, 2, 0, 0, 1, -1], [1.3, 20, 2, 0.2, 0.1, 0.5, 0.37],
                           [0.7, v, 0.9, 0, 0.0, 1, -1], [1.3, v, 0.97, 0.05, 0.0, 1, 0.37],
                           [1.0, v, 2, 0, 0.02, 1, -1], [1.0, v, 0.8, 0, 0, 1, 0.55]])
    rng = torch.tensor([[s, s * 7 + 3] for s in range(7)], dtype=torch.int64)
    return x, params, rng


def _id_order(x: torch.Tensor, params: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's final distribution [B, V] (by token id) and the token an inverse-CDF draw in vocabulary
    order takes at each point r [B] (kernels/sample_whole.py's draw for rows past the candidates)."""
    _, _, q, ids = reference.sorted_draw(x, params, r)
    final = torch.zeros_like(q).scatter_(1, ids, q / q.sum(-1, keepdim=True))
    cum = final.double().cumsum(-1)
    tok = (cum <= r.double().view(-1, 1) * cum[:, -1:]).sum(-1)
    last = torch.where(final > 0, torch.arange(x.shape[1]), 0).amax(-1)
    return final, torch.minimum(tok, last)


def _rank_groups(final: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [V] of one final distribution in `groups` groups of about equal mass by descending probability (a
    cut that keeps too many or too few tail tokens moves mass between the first and the last groups), and each
    group's mass."""
    p, order = final.double().sort(descending=True, stable=True)
    at = torch.bucketize((p.cumsum(0) - p / 2).clamp(0, 1), torch.arange(1, groups, dtype=torch.float64) / groups)
    group = torch.empty_like(at).scatter_(0, order, at)
    return group, torch.zeros(groups, dtype=torch.float64).index_add_(0, group, final.double())


def _chi2_groups(toks: torch.Tensor, final: torch.Tensor, groups: int) -> float:
    group, mass = _rank_groups(final, groups)
    exp = mass * toks.numel()
    obs = torch.bincount(group[toks], minlength=groups).double()
    assert bool((exp > 0).all()), "a token holds more than a group's mass: fewer groups"
    return float(((obs - exp) ** 2 / exp).sum())


@pytest.mark.interpreter
def test_kernel_matches_reference(monkeypatch: Any) -> None:
    """Rows 0-2 (top-k: the candidates decide) draw the reference's token; rows 4-6 (no top-k, survivors past the
    candidates) its distribution in vocabulary order (exact token at the point, exact probability); row 3 (700
    tied logits: a last top-p interval past CAP) goes to the bisection kernel, which draws the reference's token."""
    pytest.importorskip("triton")
    from exlpy.kernels import sample_top as kernel
    from exlpy.kernels import sample_whole

    monkeypatch.setattr(kernel, "MAX_CHUNK", 256)  # 700 tokens in 4 chunks: the merge of chunk candidates
    monkeypatch.setattr(sample_whole, "CHUNK", 128)  # 6 chunks per row for the whole-vocabulary kernels
    monkeypatch.setattr(sample_whole, "CAP", 64)  # the interpreter sorts 64 keys fast, 1024 slowly
    x, params, rng = _kernel_case(700)
    tok, prob, q, ids, r = kernel.sample_top_candidates(x, params, rng, 32)
    ref_tok, ref_prob, ref_q, ref_ids, ref_r = reference.sample_top_candidates(x, params, rng, 32)
    assert torch.equal(tok[:4], ref_tok[:4])
    torch.testing.assert_close(prob[:4], ref_prob[:4], rtol=1e-5, atol=1e-7)
    final, id_tok = _id_order(x, params, ref_r)
    assert tok[4:].tolist() == id_tok[4:].tolist()
    torch.testing.assert_close(prob[4:], final[4:].gather(1, tok[4:].view(-1, 1)).view(-1), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(r, ref_r)  # Philox in the kernel = the reference's, bit for bit
    assert torch.equal(ids[:3], ref_ids[:3])  # the candidates of the top-k rows (the others pass 32)
    torch.testing.assert_close(q[:3], ref_q[:3], rtol=1e-5, atol=1e-7)


@pytest.mark.interpreter
def test_kernel_flat_rows(monkeypatch: Any) -> None:
    """Rows whose survivors far outnumber the candidates, at points near a row's ends and near its top-p cut:
    the interval kernels draw the reference distribution's token in vocabulary order; with CAP 0 the top-p rows
    go to the bisection kernel, which draws the reference's own token (descending order)."""
    pytest.importorskip("triton")
    from exlpy.kernels import sample_top as kernel
    from exlpy.kernels import sample_whole

    monkeypatch.setattr(sample_whole, "CHUNK", 64)
    monkeypatch.setattr(sample_whole, "CAP", 64)
    V, rows = 300, 8
    x = (torch.randn(V, generator=torch.Generator().manual_seed(4)) * 0.5).expand(rows, V).contiguous()
    points = [0.0, 0.02, 0.31, 0.5, 0.77, 0.93, 0.999, 0.9999]
    params = torch.tensor([[1.0, float(V), 0.9 if i % 2 else 2.0, 0.1 if i % 4 == 1 else 0.0,
                            0.05 if i % 2 == 0 else 0.0, 1, p] for i, p in enumerate(points)])
    rng = torch.zeros(rows, 2, dtype=torch.int64)
    ref_tok, ref_prob, q, _, r = reference.sample_top_candidates(x, params, rng, V)
    assert bool(((q > 0).sum(-1) > 4 * 32).all())  # the whole-vocabulary kernels decide every row
    final, id_tok = _id_order(x, params, r)
    tok, prob = kernel.sample_top(x, params, rng, 32)
    assert tok.tolist() == id_tok.tolist()
    torch.testing.assert_close(prob, final.gather(1, tok.view(-1, 1)).view(-1), rtol=1e-5, atol=1e-7)
    monkeypatch.setattr(sample_whole, "CAP", 0)
    tok, prob = kernel.sample_top(x, params, rng, 32)
    top_p = [i for i in range(rows) if i % 2]
    assert tok[top_p].tolist() == ref_tok[top_p].tolist()
    torch.testing.assert_close(prob[top_p], ref_prob[top_p], rtol=1e-5, atol=1e-7)
    assert tok[0::2].tolist() == id_tok[0::2].tolist()  # min-p alone: no top-p interval, never the bisection


@pytest.mark.slow
@pytest.mark.interpreter
def test_kernel_whole_vocabulary_draws_follow_the_reference_distribution(monkeypatch: Any) -> None:
    """Chi-square: 320 seeded points drawn by the whole-vocabulary draw kernel for one flat top-p row (its cut
    found once by the interval kernels, then shared by every point) against the reference's final distribution,
    in 8 groups of equal expected mass by descending probability."""
    pytest.importorskip("triton")
    from exlpy.kernels import sample_whole

    monkeypatch.setattr(sample_whole, "CHUNK", 64)
    monkeypatch.setattr(sample_whole, "CAP", 64)
    V, n = 300, 320
    x = torch.randn(1, V, generator=torch.Generator().manual_seed(11)) * 0.7
    params = torch.tensor([[1.1, float(V), 0.85, 0.0, 0.0, 1.0, -1.0]])
    xs = x / 1.1
    m = xs.amax(-1)
    info = torch.tensor([[float(m), float(torch.exp(xs - m).sum()), 0.5, 1.0]])
    tok, prob = torch.zeros(1, dtype=torch.int64), torch.zeros(1)
    cut, thr, cm = sample_whole.finish(x, params, info, tok, prob, 7)
    # the row's finished state shared by n programs, each with its own point
    points = torch.rand(n, generator=torch.Generator().manual_seed(12))
    infos = info.expand(n, -1).clone()
    infos[:, 2] = points
    toks, probs = torch.zeros(n, dtype=torch.int64), torch.zeros(n)
    ch, nch = sample_whole.plan(V)
    shared = [t.expand(n, *t.shape[1:]).contiguous() for t in (params, cut, thr, cm)]
    sample_whole._draw_kernel[(n,)](x.expand(n, V), 0, shared[0], infos, *shared[1:], toks, probs, V, NC=nch,
                                    CH=ch, SB=ch, NP=7)
    final, _ = _id_order(x, params, torch.zeros(1))
    assert bool((final[0, toks] > 0).all()), "drew a token the reference excludes"
    torch.testing.assert_close(probs, final[0, toks], rtol=1e-5, atol=1e-7)
    chi2 = _chi2_groups(toks, final[0], 8)
    assert chi2 < _chi2_limit(7), f"chi2 {chi2:.1f} over 7 dof"


@pytest.mark.slow
@pytest.mark.interpreter
def test_kernel_rows_with_thousands_of_survivors_draw_in_vocabulary_order(monkeypatch: Any) -> None:
    """Thousands of near-flat tokens under min-p (one row), at a point where the descending-order token is another
    one and no boundary lies within 2e-6: the vocabulary-order token of the reference distribution. 2500 tokens
    in chunks of 512 have the layout of 20000 tokens in the default chunks of 4096 (5 full chunks of 8 in both
    kernels' grids, the last partial): this test ran 20000 tokens, 15 s of the interpreter."""
    pytest.importorskip("triton")
    from exlpy.kernels import sample_top as kernel
    from exlpy.kernels import sample_whole

    monkeypatch.setattr(sample_whole, "CAP", 64)
    monkeypatch.setattr(sample_whole, "CHUNK", 512)
    monkeypatch.setattr(kernel, "MAX_CHUNK", 512)
    V = 2500
    assert sample_whole.plan(V) == (512, 8) and kernel.plan(V, 32)[:2] == (512, 8)
    x = (torch.randn(2, V, generator=torch.Generator().manual_seed(V)) * 0.5)[1:]
    params = torch.tensor([[1.2, float(V), 2.0, 0, 0.05, 1, 0.71]])
    rng = torch.zeros(1, 2, dtype=torch.int64)
    tok, prob = kernel.sample_top(x, params, rng, 32)
    ref_tok, _, _, _, r = reference.sample_top_candidates(x, params, rng, V)
    final, id_tok = _id_order(x, params, r)
    assert _id_window(x, params, r, 2e-6)[0] == {int(id_tok[0])}
    assert int(id_tok[0]) != int(ref_tok[0])
    assert tok.tolist() == id_tok.tolist()
    torch.testing.assert_close(prob, final[0, tok], rtol=1e-4, atol=1e-7)


def _reference_window(x: torch.Tensor, params: torch.Tensor, r: torch.Tensor, tol: float
                      ) -> tuple[list[set[int]], torch.Tensor]:
    """Per row, the tokens the reference draws at points within tol of r and top-p within tol of the row's (what
    fp32 sums in another order may legitimately draw: on a 128k vocabulary a flat row's tokens hold ~1e-5 of
    the mass each, so a point can lie ~1e-6 from a boundary), and each token's final probability [B, V]."""
    _, _, q, ids = reference.sorted_draw(x, params, r)
    final = torch.zeros_like(q).scatter_(1, ids, q / q.sum(-1, keepdim=True))
    pos = torch.empty_like(ids).scatter_(1, ids, torch.arange(ids.shape[1]).expand_as(ids).contiguous())
    lo = torch.full((x.shape[0],), ids.shape[1], dtype=torch.int64)
    hi = torch.zeros(x.shape[0], dtype=torch.int64)
    for shifted, point in _shifts(params, r, tol):
        tok = reference.sorted_draw(x, shifted, point)[0]
        at = pos.gather(1, tok.view(-1, 1)).view(-1)
        lo, hi = torch.minimum(lo, at), torch.maximum(hi, at)
    return [set(ids[i, lo[i]:hi[i] + 1].tolist()) for i in range(x.shape[0])], final


def _id_window(x: torch.Tensor, params: torch.Tensor, r: torch.Tensor, tol: float) -> list[set[int]]:
    """`_reference_window` for the vocabulary-order draw: the ids between the extreme tokens it takes."""
    lo = torch.full((x.shape[0],), x.shape[1], dtype=torch.int64)
    hi = torch.zeros(x.shape[0], dtype=torch.int64)
    for shifted, point in _shifts(params, r, tol):
        tok = _id_order(x, shifted, point)[1]
        lo, hi = torch.minimum(lo, tok), torch.maximum(hi, tok)
    return [set(range(int(lo[i]), int(hi[i]) + 1)) for i in range(x.shape[0])]


def _shifts(params: torch.Tensor, r: torch.Tensor, tol: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    top_p = params[:, 2:3]
    out = []
    for dp in (-tol, 0.0, tol):
        shifted = params.clone()
        shifted[:, 2:3] = torch.where((top_p > 0) & (top_p < 1), top_p + dp, top_p)
        for dr in (-tol, 0.0, tol):
            out.append((shifted, (r + dr).clamp(0.0, 1.0 - 1e-7)))
    return out


@requires_cuda
def test_kernel_matches_reference_on_cuda() -> None:
    """A Llama-3 vocabulary: rows 3-6 have 34k-115k survivors. Row 3 (128k tied logits) goes to the bisection
    kernel (the reference's token), rows 4-6 to the interval kernels (the reference distribution's token in
    vocabulary order). Exact tokens wherever fp32 sums cannot cross a boundary (each window holds one token at
    this seed: `test_kernel_case_windows_are_single_tokens`)."""
    from exlpy.kernels.sample_top import sample_top

    x, params, rng = _kernel_case(128256)
    params[3:, 1] = 128256.0
    tok, prob = sample_top(x.cuda(), params.cuda(), rng.cuda(), K_MAX)
    tok = tok.cpu()
    ref_tok, ref_prob, _, _, r = reference.sample_top_candidates(x, params, rng, K_MAX)
    assert torch.equal(tok[:3], ref_tok[:3])
    window, final = _reference_window(x, params, r, 2e-6)
    assert int(tok[3]) in window[3], (int(tok[3]), window[3])
    id_window = _id_window(x, params, r, 2e-6)
    for i in range(4, 7):
        assert int(tok[i]) in id_window[i], (i, int(tok[i]), id_window[i])
    torch.testing.assert_close(prob.cpu(), final.gather(1, tok.view(-1, 1)).view(-1), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(prob[:3].cpu(), ref_prob[:3], rtol=1e-4, atol=1e-6)


@requires_cuda
def test_whole_vocabulary_philox_draws_follow_the_reference_on_cuda() -> None:
    """Chi-square on a GPU: 64 rows x 100 Philox steps of one flat 128k-token row under top-p 0.9 (and one under
    min-p), 16 groups of equal expected mass by descending probability, against the torch reference's
    distribution."""
    from exlpy.kernels.sample_top import sample_top

    V = 128256
    x = torch.randn(1, V, generator=torch.Generator().manual_seed(3))
    for top_p, min_p in ((0.9, 0.0), (2.0, 0.02)):
        params = torch.tensor([[1.0, float(V), top_p, 0.0, min_p, 1.0, -1.0]])
        final, _ = _id_order(x, params, torch.zeros(1))
        rows = 64
        xs, ps = x.expand(rows, V).contiguous().cuda(), params.expand(rows, -1).contiguous().cuda()
        toks = []
        for step in range(100):
            rng = torch.stack([torch.arange(rows) + 77, torch.full((rows,), step)], 1).cuda()
            toks.append(sample_top(xs, ps, rng, K_MAX)[0].cpu())
        t = torch.cat(toks)
        assert bool((final[0, t] > 0).all())
        chi2 = _chi2_groups(t, final[0], 16)
        assert chi2 < _chi2_limit(15), (top_p, chi2)


@pytest.mark.slow
def test_kernel_case_windows_are_single_tokens() -> None:
    """The CUDA test's rows are far enough from every boundary that exact equality is what it checks: each row's
    window (points and top-p within 2e-6) holds one token, in descending order (rows 0-3) and in vocabulary
    order (rows 4-6)."""
    x, params, rng = _kernel_case(128256)
    params[3:, 1] = 128256.0
    ref_tok, _, _, _, r = reference.sample_top_candidates(x, params, rng, K_MAX)
    window, _ = _reference_window(x, params, r, 2e-6)
    assert window[:4] == [{int(t)} for t in ref_tok[:4]]
    assert [len(w) for w in _id_window(x, params, r, 2e-6)[4:]] == [1, 1, 1]


@requires_cuda
def test_captured_replays_equal_eager_steps() -> None:
    logits, context = _case(vocab=32000, rows=5, seed=2)
    settings = COMBOS["topk_topp_minp_rep"]
    out = []
    for capture in (False, True):
        gs = GraphSampler(32000, torch.device("cuda"), slots=5, capture=capture)
        for i in range(5):
            gs.bind_counts(i, context[i])
        toks = []
        for step in range(6):
            t, _, ok = gs.sample(logits.cuda(), [GraphRow(settings, slot=i, seed=i, counter=step) for i in range(5)])
            assert bool(ok.all())
            toks.append(t.cpu().tolist())
        out.append(toks)
    assert out[0] == out[1]


# --- the generators: captured path against the old one --------------------------------------------------------------

def _dynamic_tokens(graph: bool, jobs_kw: list[dict[str, Any]], ids: list[torch.Tensor], n: int) -> list[list[int]]:
    from tests.test_generator_helpers import aidreams_cpu, drain

    model, tok = aidreams_cpu()
    g = ExLlamaV2DynamicGenerator(model, ExLlamaV2Cache(model, max_seq_len=2048), tok)
    g.graph_sampling = graph
    jobs = [ExLlamaV2DynamicJob(i, n, stop_conditions=[], **kw) for i, kw in zip(ids, jobs_kw)]
    for j in jobs:
        g.enqueue(j)
    res = drain(g)
    assert (g.stepper.graphed is not None) == graph
    return [res[j]["tokens"] for j in jobs]


def test_dynamic_generator_captured_path_matches_old_path_and_oracles() -> None:
    from tests.test_dynamic_overlap import sampled_oracle
    from tests.test_generator_helpers import PROMPTS, aidreams_cpu

    _, tok = aidreams_cpu()
    ids = [tok.encode(p, add_bos=True) for p in PROMPTS[:5]]
    n = 10
    pen = COMBOS["topk_topp_minp_rep"]
    top_p = COMBOS["server_top_p"]
    window = COMBOS["penalty_window"]
    kws = [{"gen_settings": Settings.greedy()}, {"gen_settings": Settings.greedy()},
           {"gen_settings": top_p, "seed": 12}, {"gen_settings": pen, "seed": 13}, {"gen_settings": window, "seed": 14}]
    old, new = _dynamic_tokens(False, kws, ids, n), _dynamic_tokens(True, kws, ids, n)
    assert new[:2] == old[:2]  # greedy: identical
    assert new[2] == sampled_oracle(ids[2], n, top_p, 12)  # seeded: the host's draws (whole-vocabulary top-p)
    assert new[3] == sampled_oracle(ids[3], n, pen, 13)  # penalties from the device counts
    assert new[4] == sampled_oracle(ids[4], n, window, 14)  # a penalty range and decay: the device window


def test_streaming_generator_captured_path_matches_old_path() -> None:
    from exlpy.generator import ExLlamaV2StreamingGenerator
    from tests.test_dynamic_overlap import sampled_oracle
    from tests.test_generator_helpers import aidreams_cpu
    from tests.test_generator_streaming import stream_all

    model, tok = aidreams_cpu()
    ids = tok.encode("Echoes of", add_bos=True)
    out = {}
    for graph in (False, True):
        sg = ExLlamaV2StreamingGenerator(model, ExLlamaV2Cache(model, max_seq_len=256), tok)
        sg.set_stop_conditions([])
        sg.graph_sampling = graph
        sg.begin_stream_ex(ids, Settings.greedy())
        greedy = stream_all(sg, 12)[1]
        sg.begin_stream_ex(ids, COMBOS["plain_temperature"])
        sg.set_seed(21)
        sampled = stream_all(sg, 12)[1]
        sg.begin_stream_ex(ids, COMBOS["topk_topp_minp_rep"])  # penalties: the old path samples on the host
        sg.set_seed(22)
        out[graph] = (greedy, sampled, stream_all(sg, 12)[1])
        assert (sg.graphed is not None) == graph
    assert out[True] == out[False]
    assert out[True][1] == sampled_oracle(ids, 12, COMBOS["plain_temperature"], 21)
    assert out[True][2] == sampled_oracle(ids, 12, COMBOS["topk_topp_minp_rep"], 22)


@pytest.mark.slow
def test_sampling_kernels_compile_for_sm90() -> None:
    """What only the compiler sees (the interpreter accepts more): every kernel compiles for an H100, no spills."""
    pytest.importorskip("triton")
    from tests.conftest import run_compile_check

    res = run_compile_check("sample_compile_check.py")
    assert {"chunk V128256", "select V128256", "full", "whole pass 0", "whole resolve", "whole mass",
            "whole draw"} <= set(res)
    for name, v in res.items():
        assert 0 < v["regs"] <= 255 and v["spill_bytes"] == 0 and v["shared"] <= 227 * 1024, (name, v)


# --- speculative verification ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kinds", [("greedy", "greedy"), ("topk_topp_minp", "typical"), ("greedy", "temp_last")])
def test_verification_equals_verify_rows(kinds: tuple[str, str]) -> None:
    """Rows with drafts that the target likes (its argmax) or not: accepted counts and added tokens as the
    host-side rejection rule computes them, at the same points."""
    from exlpy.generator.sampling.batched import RowSample
    from exlpy.generator.speculative.verify import verify_rows

    table = {"greedy": Settings.greedy(), "typical": EXTENDED["typical"],
             "temp_last": EXTENDED["temperature_last"],
             "topk_topp_minp": Settings(temperature=0.9, top_k=40, top_p=0.9, min_p=0.05,
                                        token_repetition_penalty=1.0)}
    settings = [table[k] for k in kinds]
    g = torch.Generator().manual_seed(11)
    B, T, V = 2, 4, 300
    logits = torch.randn(B, T, V, generator=g) * 2
    argmax = logits.argmax(-1)
    drafts = argmax[:, :T - 1].clone()
    drafts[1, 1] = (drafts[1, 1] + 1) % V  # row 1's second draft is not the target's argmax
    gs = GraphSampler(V, logits.device, slots=2)
    for trial in range(5):
        pts = torch.rand(B, 2 * T - 1, generator=g)
        u, r = pts[:, :T - 1], pts[:, T - 1:]
        m, tok = gs.verify(logits, drafts, settings, u.tolist(), r.tolist())
        want_m, want_tok = verify_rows(logits, drafts, [RowSample(s) for s in settings], u, r, None)
        assert m.tolist() == want_m.tolist() and tok.tolist() == want_tok.tolist(), (kinds, trial)


def test_dynamic_speculation_captured_path_matches_old_path() -> None:
    from tests.test_generator_helpers import PROMPTS, aidreams_cpu, drain

    model, tok = aidreams_cpu()
    ids = [tok.encode(p, add_bos=True) for p in PROMPTS[:3]]
    out = []
    for graph in (False, True):
        g = ExLlamaV2DynamicGenerator(model, ExLlamaV2Cache(model, max_seq_len=2048), tok, use_ngram_draft=True,
                                      num_draft_tokens=3)
        g.graph_sampling = graph
        jobs = [ExLlamaV2DynamicJob(i, 16, stop_conditions=[], gen_settings=s, seed=5)
                for i, s in zip(ids, (Settings.greedy(), COMBOS["plain_temperature"], Settings.greedy()))]
        for j in jobs:
            g.enqueue(j)
        res = drain(g)
        assert g.get_sd_stats()[3] > 0  # drafted
        assert (g.stepper.graphed is not None and g.stepper.graphed._verifier is not None) == graph
        out.append([res[j]["tokens"] for j in jobs])
    assert out[0] == out[1]


def test_streaming_speculation_captured_path_matches_greedy() -> None:
    from exlpy.generator import ExLlamaV2StreamingGenerator
    from tests.test_generator_helpers import aidreams_cpu, argmax_tokens
    from tests.test_generator_streaming import stream_all

    model, tok = aidreams_cpu()
    sg = ExLlamaV2StreamingGenerator(model, ExLlamaV2Cache(model, max_seq_len=256), tok)
    sg.graph_sampling = True
    sg.speculative_ngram = True
    sg.ngram_preload("Echoes of vectors unfold, a gentle hum of precision")
    ids = tok.encode("Echoes of", add_bos=True)
    sg.set_stop_conditions([])
    sg.begin_stream_ex(ids, Settings.greedy())
    assert stream_all(sg, 24)[1][:24] == argmax_tokens(model, ids, 24)
    assert sg.get_sd_stats()[3] > 0 and sg.graphed is not None and sg.graphed._verifier is not None


@requires_cuda
def test_dynamic_generator_on_gpu_captured_sampler() -> None:
    """On a GPU the captured sampler is what a generator uses by default (EXLPY_GRAPH_SAMPLING=0 turns it off):
    greedy as the old path token for token, sampled rows (penalties,
    whole-vocabulary top-p, a seeded row) run and stay reproducible."""
    from dataclasses import replace

    from exlpy.runtime import options, use_options
    from tests.test_generator_helpers import PROMPTS, aidreams

    model, tok = aidreams()
    ids = [tok.encode(p, add_bos=True) for p in PROMPTS[:4]]
    kws = [{"gen_settings": Settings.greedy()}, {"gen_settings": Settings(), "seed": 1},
           {"gen_settings": COMBOS["server_top_p"], "seed": 2}, {"gen_settings": EXTENDED["typical"], "seed": 3}]

    def run(graph: bool | None) -> list[list[int]]:
        g = ExLlamaV2DynamicGenerator(model, ExLlamaV2Cache(model, max_seq_len=2048), tok)
        if graph is not None:
            g.graph_sampling = graph
        jobs = [ExLlamaV2DynamicJob(i, 24, stop_conditions=[], **kw) for i, kw in zip(ids, kws)]
        for j in jobs:
            g.enqueue(j)
        from tests.test_generator_helpers import drain

        res = drain(g)
        assert all(res[j]["final"]["eos_reason"] == "max_new_tokens" for j in jobs)
        assert (g.stepper.graphed is not None) == (graph is not False and options().graph_sampling)
        return [res[j]["tokens"] for j in jobs]

    with use_options(replace(options(), graph_sampling=True)):
        default, again = run(None), run(None)
    old = run(False)
    assert default == again  # seeded rows repeat
    assert default[0] == old[0]


def test_generators_go_on_without_a_failing_captured_sampler(monkeypatch: Any) -> None:
    """A step of the captured sampler that fails (on a GPU: a capture the driver refuses) turns it off with a
    warning; the jobs finish with the old path's tokens."""
    from tests.test_generator_helpers import PROMPTS, aidreams_cpu

    _, tok = aidreams_cpu()
    ids = [tok.encode(p, add_bos=True) for p in PROMPTS[:2]]
    kws = [{"gen_settings": Settings.greedy()}, {"gen_settings": COMBOS["topk_topp_minp_rep"], "seed": 3}]
    want = _dynamic_tokens(False, kws, ids, 8)

    def broken(self: GraphSampler, *args: Any) -> Any:
        self.failed = True
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(GraphSampler, "_sample", broken)
    with pytest.warns(UserWarning, match="captured sampler failed"):
        got = _dynamic_tokens(True, kws, ids, 8)
    assert got == want
