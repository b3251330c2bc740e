"""How many tokens to draft: fixed when the user set a number, otherwise adapted to the recent acceptance rate
and to the measured cost of a draft step (exllamav3's dynamic draft length).

With a per-token acceptance rate a, k drafts yield on average (1 - a^(k+1)) / (1 - a) tokens per round (the
accepted drafts plus the target's own token), for the time of one round: a fixed part (the verification, the
host's work, the read-back) plus k draft steps. The draft length maximises tokens per unit of time, with
`step_cost` the time of a draft step relative to the fixed part of a round.

The acceptance rate is estimated from the rounds themselves as a geometric rate: accepted drafts / (accepted
drafts + rejections), both counted over recent rounds (an exponential moving sum, so a round of 16 rows weighs
16 times a round of one). Summing counts before dividing keeps the estimate unbiased whatever the draft length:
an average of per-round ratios is not (at a = 0.8 and k = 4 it reads ~0.7, which then picks shorter drafts).
Every round updates it, a round of one draft too, so an early low estimate cannot hold the length at 1.

Drafting turns itself off (length 0: the generator decodes one token at a time, overlapped) when no length is
expected to beat plain decoding: a round is synchronous (its read-back decides the next input), so its fixed
part costs ROUND_OVERHEAD more than an overlapped plain step, which a low acceptance rate does not pay back.
While off, every PROBE_EVERY-th planning (`tick`) drafts one token, so the estimate can see the rate recover.

The cost starts from a static guess (a draft model's weight bytes over the target's, near zero for n-grams)
and, once rounds were timed (`observe`), is the median of the recent measurements: the time of the draft
steps over the rest of the round. The median ignores the odd round that captured a CUDA graph.
"""

from __future__ import annotations

from collections import deque
from statistics import median

START_RATE = 0.7
PRIOR_ROUNDS = 3.0  # weight of the starting rate, in drafts
SMOOTHING = 0.15  # per round, the share by which older counts fade
VERIFY_COST_PER_TOKEN = 0.02  # a verification of k+1 tokens costs a little more than one of 1
COST_WINDOW = 16  # timed rounds the measured cost is the median of
ROUND_OVERHEAD = 0.1  # a round's fixed part over a plain step (sync, host work not overlapped: H100, 8B, batch 1)
PROBE_EVERY = 16  # while off, one round of one draft per this many plannings
MIN_TIMED = 3  # timed rounds before the measurement replaces the static guess


def expected_tokens(rate: float, k: int) -> float:
    if rate >= 1.0:
        return k + 1.0
    return (1.0 - rate ** (k + 1)) / (1.0 - rate)


def gain(rate: float, cost: float, k: int) -> float:
    """Expected tokens per round of k drafts over the plain steps its time would take."""
    return expected_tokens(rate, k) / ((1.0 + ROUND_OVERHEAD) * (1.0 + (cost + VERIFY_COST_PER_TOKEN) * k))


def best_length(rate: float, cost: float, max_k: int) -> int:
    """The k in 1..max_k with the most expected tokens per unit of time, or 0 when none beats plain decoding."""
    best, best_k = 0.0, 1
    for k in range(1, max_k + 1):
        value = gain(rate, cost, k)
        if value > best:
            best, best_k = value, k
    return best_k if best > 1.0 else 0


class DraftLength:
    def __init__(self, fixed: int | None, max_k: int, cost: float) -> None:
        self.fixed, self.max_k, self.cost = fixed, max_k, cost
        self.accepted = START_RATE * PRIOR_ROUNDS  # moving sums of accepted drafts and of rejections
        self.rejected = (1.0 - START_RATE) * PRIOR_ROUNDS
        self.costs: deque[float] = deque(maxlen=COST_WINDOW)
        self.idle = 0  # plannings since the last round

    @property
    def rate(self) -> float:
        return self.accepted / max(self.accepted + self.rejected, 1e-9)

    @property
    def step_cost(self) -> float:
        """A draft step's time relative to the fixed part of a round: measured, else the static guess."""
        return median(self.costs) if len(self.costs) >= MIN_TIMED else self.cost

    def update(self, accepted: int, rejections: int) -> None:
        """One round: drafts accepted and rows whose drafts were cut short by a rejection."""
        keep = 1.0 - SMOOTHING
        self.idle = 0
        self.accepted = keep * self.accepted + accepted
        self.rejected = keep * self.rejected + rejections

    def observe(self, k: int, draft_seconds: float, round_seconds: float) -> None:
        """One timed round of k drafts: the draft steps took `draft_seconds` of its `round_seconds`."""
        rest = round_seconds - draft_seconds
        if k < 1 or draft_seconds <= 0.0 or rest <= 0.0:
            return
        base = rest / (1.0 + VERIFY_COST_PER_TOKEN * k)  # the fixed part, less the verification's growth
        self.costs.append(min(draft_seconds / k / base, 4.0))

    def tick(self) -> None:
        """A planning (the generators call it before `choose` when they may draft)."""
        self.idle += 1

    def choose(self) -> int:
        """The draft length for the next round; 0 = off (plain decoding), except on a probe."""
        if self.fixed is not None:
            return self.fixed
        k = best_length(self.rate, self.step_cost, self.max_k)
        return 1 if k == 0 and self.idle >= PROBE_EVERY else k
