"""Choosing one measured option per module within the bit budget (spec §4.5), exactly rather than by annealing.

The budget is `int(numel * bpw)` over every decoder linear. Each slot (a layer's attention or MLP) has measured
options (total bits, error). Minimizing the sum of errors under the budget is a multiple-choice knapsack, solved
here by dynamic programming over the budget cut into 20,000 steps (costs rounded up, so the answer always fits),
then topped up greedily with the bits the rounding left over. Deterministic, and optimal up to that rounding,
where exllamav2's simulated annealing is neither.
"""

from __future__ import annotations

import math

import numpy as np

from exlpy.errors import ConvertSettingsError

STEPS = 20_000


def slot_error(entry: dict) -> float:
    """exlpy measurements carry `err` (relative squared error); exllamav2's have accuracy only."""
    if "err" in entry:
        return float(entry["err"])
    return (1.0 - float(entry["accuracy"])) ** 2


def reachable(slots: list[list[int]], numel: int) -> tuple[float, float]:
    """(lowest, highest) bpw the options can reach."""
    return sum(min(s) for s in slots) / numel, sum(max(s) for s in slots) / numel


def choose(costs: list[list[int]], errors: list[list[float]], budget: int) -> list[int]:
    """Index of the chosen option per slot: least total error with total cost <= budget."""
    lo = sum(min(c) for c in costs)
    if lo > budget:
        raise ConvertSettingsError(f"budget of {budget} bits is below the cheapest options ({lo} bits)")
    unit = budget / STEPS
    inf = math.inf
    dp = np.full(STEPS + 1, inf)
    dp[0] = 0.0
    picks = np.zeros((len(costs), STEPS + 1), dtype=np.int16)
    for s, (cs, es) in enumerate(zip(costs, errors)):
        new = np.full(STEPS + 1, inf)
        for o, (c, e) in enumerate(zip(cs, es)):
            d = min(STEPS + 1, math.ceil(c / unit - 1e-9))
            cand = np.full(STEPS + 1, inf)
            cand[d:] = dp[:STEPS + 1 - d] + e
            better = cand < new
            new[better] = cand[better]
            picks[s, better] = o
        dp = new
    if not np.isfinite(dp).any():
        # rounding up pushed even the cheapest set over: fall back to the cheapest options
        choice = [int(np.argmin(c)) for c in costs]
    else:
        c = int(np.argmin(dp))
        choice = [0] * len(costs)
        for s in range(len(costs) - 1, -1, -1):
            o = int(picks[s, c])
            choice[s] = o
            c -= min(STEPS + 1, math.ceil(costs[s][o] / unit - 1e-9))
    return _top_up(costs, errors, budget, choice)


def _top_up(costs: list[list[int]], errors: list[list[float]], budget: int, choice: list[int]) -> list[int]:
    """Spend what is left: repeatedly take the switch that lowers the error most per extra bit and fits."""
    used = sum(c[o] for c, o in zip(costs, choice))
    while True:
        best, best_gain = None, 0.0
        for s, (cs, es) in enumerate(zip(costs, errors)):
            cur = choice[s]
            for o in range(len(cs)):
                extra = cs[o] - cs[cur]
                gain = es[cur] - es[o]
                if gain <= 0 or used + extra > budget:
                    continue
                score = gain / max(extra, 1)
                if score > best_gain:
                    best, best_gain = (s, o), score
        if best is None:
            return choice
        s, o = best
        used += costs[s][o] - costs[s][choice[s]]
        choice[s] = o
