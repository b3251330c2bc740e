"""How many tokens to draft: fixed when the user set a number, otherwise adapted to the recent acceptance rate
(exllamav3's dynamic draft length).

With a per-token acceptance rate a, k drafts yield on average (1 - a^(k+1)) / (1 - a) tokens per round (the
accepted drafts plus the target's own token), for the cost of one verification plus k draft steps. The draft
length maximises tokens per unit of cost, with `cost` the price of a draft token relative to a verification
(a draft model's weight bytes over the target's; near zero for n-grams). The acceptance rate is estimated
from the rounds themselves, as a geometric rate (accepted drafts / (accepted drafts + rejections)), smoothed
over recent rounds.
"""

from __future__ import annotations

START_RATE = 0.7
SMOOTHING = 0.15  # weight of the newest round in the running estimate
VERIFY_COST_PER_TOKEN = 0.02  # a verification of k+1 tokens costs a little more than one of 1


def expected_tokens(rate: float, k: int) -> float:
    if rate >= 1.0:
        return k + 1.0
    return (1.0 - rate ** (k + 1)) / (1.0 - rate)


class DraftLength:
    def __init__(self, fixed: int | None, max_k: int, cost: float) -> None:
        self.fixed, self.max_k, self.cost = fixed, max_k, cost
        self.accepted = START_RATE * 10.0  # pseudo-counts of the running estimate
        self.rejected = (1.0 - START_RATE) * 10.0

    @property
    def rate(self) -> float:
        return self.accepted / max(self.accepted + self.rejected, 1e-9)

    def update(self, accepted: int, rejections: int) -> None:
        """One round: drafts accepted and rows whose drafts were cut short by a rejection."""
        keep = 1.0 - SMOOTHING
        self.accepted = keep * self.accepted + SMOOTHING * 10.0 * accepted / max(accepted + rejections, 1)
        self.rejected = keep * self.rejected + SMOOTHING * 10.0 * rejections / max(accepted + rejections, 1)

    def choose(self) -> int:
        if self.fixed is not None:
            return self.fixed
        rate = self.rate
        best, best_k = 0.0, 1
        for k in range(1, self.max_k + 1):
            value = expected_tokens(rate, k) / (1.0 + (self.cost + VERIFY_COST_PER_TOKEN) * k)
            if value > best:
                best, best_k = value, k
        return best_k
