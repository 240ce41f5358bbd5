"""What a plan costs: the arithmetic that turns pass costs and acceptance into seconds per committed
token for each mode (seconds_per_token, full_pass, host_rounds), and what a run has measured to feed
it (PassCosts: seconds per pass of each level; Acceptance: what each edge's verifications accept).
adaptive.Chooser prices every plan with them before each full pass; the benchmarks' cost models
(bench/costmodel.py, bench/big_target.py) use the same arithmetic.
"""
from __future__ import annotations

import math
from collections import defaultdict, deque
from functools import lru_cache
from typing import Callable

from .modes import ALL_LEVELS, SHAPE, first_level


def tokens_per_verification(a: float, gamma: int) -> float:
    """Expected tokens one verification of `gamma` proposals yields when each is accepted with rate a
    independently: 1 + a + ... + a^gamma = (1 - a^(gamma+1)) / (1 - a)."""
    if gamma < 0 or not 0 <= a <= 1:
        raise ValueError(f"need gamma >= 0 and a in [0, 1] (got {gamma}, {a})")
    if a == 1:
        return gamma + 1.0
    return (1 - a ** (gamma + 1)) / (1 - a)


def seconds_per_token(mode: str, gamma: int, gamma1: int, cost: Callable[[str, int], float],
                      accept: Callable[[str], float], overhead: float = 0.0, round_cost: float | None = None,
                      device_rounds: bool = False, expect: Callable[[str, float], float] | None = None) -> float:
    """Seconds per committed token of `mode` proposing `gamma` tokens per full pass; cost(level, n) is
    a pass of `level` over n tokens, accept(edge) the rate one proposal is accepted at, overhead the
    seconds a full pass's round spends outside the levels' passes (sampling, cache upkeep):

        autoregressive  (verify(1) + overhead)
        speculative     (gamma draft(1) + verify(gamma+1) + overhead) / E(a_draft->verify, gamma)
        retrieval       (gamma middle(1) + verify(gamma+1) + overhead) / E(a_middle->verify, gamma)
        triforce        (gamma m + verify(gamma+1) + overhead) / E(a_middle->verify, gamma), where a middle
                        token costs m = round / E(a_draft->middle, gamma1), and a drafter->middle round
                        gamma1 draft(1) + middle(gamma1+1), or `round_cost` where rounds ran as one
                        graph and were timed whole
        triforce, device rounds (rounds.py): R = ceil(gamma / E1) whole rounds, E1 = E(a_draft->middle,
                        gamma1) what one makes; the full pass verifies all their R (gamma1 + 1)
                        positions, capped at the R E1 tokens they make on average:
                        (R round + verify(R (gamma1+1) + 1) + overhead) / E(a_middle->verify, R E1)

    E(a, g) is `expect(edge, g)` where given (Acceptance.expected: counted position by position),
    else tokens_per_verification at the edge's rate.
    """
    seconds, tokens = full_pass(mode, gamma, gamma1, cost, accept, overhead, round_cost, device_rounds, expect)
    return seconds / tokens


def full_pass(mode: str, gamma: int, gamma1: int, cost: Callable[[str, int], float], accept: Callable[[str], float],
              overhead: float = 0.0, round_cost: float | None = None, device_rounds: bool = False,
              expect: Callable[[str, float], float] | None = None) -> tuple[float, float]:
    """(seconds, expected committed tokens) of one full pass of `mode` at `gamma` with its proposals:
    seconds_per_token's numerator and denominator. A lookup variant (modes.LOOKUP_VARIANT) is priced
    as its mode with the level 'lookup' in the drafter's place."""
    e = expect or (lambda edge, g: tokens_per_verification(accept(edge), g))
    shape, d = SHAPE[mode], first_level(mode)
    if shape == "autoregressive":
        return cost("verify", 1) + overhead, 1.0
    if shape == "speculative":
        return gamma * cost(d, 1) + cost("verify", gamma + 1) + overhead, e(f"{d}->verify", gamma)
    if shape == "retrieval":
        return gamma * cost("middle", 1) + cost("verify", gamma + 1) + overhead, e("middle->verify", gamma)
    if round_cost is None and not device_rounds:  # the host decides each round: priced round by round
        proposing = host_rounds(gamma, gamma1, lambda g: g * cost(d, 1) + cost("middle", g + 1),
                                lambda j: e(f"{d}->middle", j))
        return proposing + cost("verify", gamma + 1) + overhead, e("middle->verify", gamma)
    if round_cost is None:
        round_cost = gamma1 * cost(d, 1) + cost("middle", gamma1 + 1)
    per_round = e(f"{d}->middle", gamma1)
    if device_rounds:
        rounds = max(1, math.ceil(gamma / per_round - 1e-9))
        width = rounds * (gamma1 + 1)
        return rounds * round_cost + cost("verify", width + 1) + overhead, e("middle->verify", rounds * per_round)
    per_middle_token = round_cost / per_round
    return gamma * per_middle_token + cost("verify", gamma + 1) + overhead, e("middle->verify", gamma)


def host_rounds(gamma: int, gamma1: int, round_cost: Callable[[int], float], expect: Callable[[int], float]) -> float:
    """Expected seconds of the drafter->middle rounds that make `gamma` middle tokens when the host
    decides each round (levels.SpeculativeProposer): with r still to make, a round drafts
    g = min(gamma1, r) and costs round_cost(g); the middle level keeps the j drafts it accepts and
    adds one of its own, so r - j - 1 remain. expect(g): the tokens a round of g drafts yields on
    average, whose differences are the chances that the first j stand. Pricing a middle token at a
    full round's cost over what a round yields (as device rounds are) missed the short last round
    each pass ends with: SmolLM2 at gamma1 4, gamma2 6 ran 2.03 rounds a pass (this says 2.00) where
    1.23 were priced."""
    g1 = min(gamma1, gamma)
    made = [expect(j) for j in range(g1 + 1)]
    stand = (1.0,) + tuple(made[j] - made[j - 1] for j in range(1, g1 + 1))  # P(first j accepted)
    # every gamma of a choice shares one table (a choice prices each plan: 16 of them at gamma2 16)
    return _rounds_table(stand, tuple(round_cost(g) for g in range(1, g1 + 1)), 1 << (gamma - 1).bit_length())[gamma]


@lru_cache(maxsize=32)
def _rounds_table(stand: tuple[float, ...], round_costs: tuple[float, ...], upto: int) -> list[float]:
    """host_rounds' cost[r] for r = 0..upto: the seconds to make r more tokens."""
    cost = [0.0] * (upto + 1)
    for r in range(1, upto + 1):
        g = min(len(round_costs), r)
        cost[r] = round_costs[g - 1] + sum((stand[j] - (stand[j + 1] if j < g else 0.0)) * cost[max(r - j - 1, 0)]
                                           for j in range(g + 1))
    return cost


def needs(mode: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(levels timed, acceptance edges counted) before `mode` can be predicted: its levels, and each
    level's proposals to the one above."""
    levels = ALL_LEVELS[mode]
    return levels, tuple(f"{a}->{b}" for a, b in zip(levels, levels[1:]))


def max_gamma(mode: str, gamma1: int, gamma2: int) -> int:
    """The longest run of proposals per full pass a mode is tried with: gamma2 for the middle level's
    runs; the drafter alone as long as either (a speculative-only run's configured length is gamma1)."""
    return {"autoregressive": 0, "speculative": max(gamma1, gamma2)}.get(SHAPE[mode], gamma2)


class PassCosts:
    """Seconds per pass of each level as a function of the tokens it feeds: a moving average per
    token count, and between or beyond measured counts the least-squares line through them (a pass
    reads the weights once and attends once per token fed, so cost grows about linearly).

    The first pass at a count stands only until a second one comes: it is often a warm-up (the
    first 4-token verification after a 16K prefill took 73 ms, later ones about 40), and averaged
    in it kept retrieval at gamma 3 priced above plain decoding for a whole run."""

    def __init__(self, decay: float = 0.7):
        self.decay = decay
        self.mean: dict[str, dict[int, float]] = defaultdict(dict)
        self.samples: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        # estimates since the last record: a choice prices ~20 plans, each a few passes, and the
        # line's refit per call took a round 0.15 ms of host time (1.4% of a 4K pass on a CPU)
        self._known: dict[tuple[str, int], float] = {}

    def record(self, level: str, tokens: int, seconds: float) -> None:
        self._known.clear()
        seen = self.samples[level][tokens]
        old = self.mean[level].get(tokens)
        self.mean[level][tokens] = seconds if seen < 2 else self.decay * old + (1 - self.decay) * seconds
        self.samples[level][tokens] = seen + 1

    def assume(self, level: str, tokens: int, seconds: float) -> None:
        """An estimate from elsewhere (an earlier run's): it stands until two passes replace it."""
        self._known.clear()
        self.mean[level][tokens] = seconds
        self.samples[level][tokens] = 0

    def known(self, level: str) -> bool:
        return bool(self.mean.get(level))

    def estimate(self, level: str, tokens: int) -> float:
        key = (level, tokens)
        if key not in self._known:
            self._known[key] = self._fit(level, tokens)
        return self._known[key]

    def _fit(self, level: str, tokens: int) -> float:
        points = self.mean[level]
        if tokens in points:
            return points[tokens]
        if len(points) == 1:
            return next(iter(points.values()))
        n = len(points)
        mx, my = sum(points) / n, sum(points.values()) / n
        slope = sum((x - mx) * (y - my) for x, y in points.items()) / sum((x - mx) ** 2 for x in points)
        return max(my + max(slope, 0.0) * (tokens - mx), min(points.values()))


class Acceptance:
    """Per edge, what verifications accept, from the last WINDOW of them. A pass that accepts k of g
    proposals saw k successes and, when k < g, one failure (nothing after the first rejection was
    tried), so the rate is successes / (successes + failures), with one of each as a prior so that
    a short history never reads 0 or 1.

    What a verification of gamma proposals yields is counted position by position (`expected`): one
    rate for every position overstated long runs, where verifications accept all or nothing more
    often than independent proposals would (SmolLM2's retrieval level at gamma 6: 5.13 tokens a
    verification expected from its rate, 4.75 came)."""

    WINDOW = 16
    PRIOR = 2  # pseudo-verifications at the pooled rate behind each position's own count
    # below this many verifications one rate stands for every position: a first try that failed at
    # its first proposal would otherwise price that position by itself (SmolLM2 at 4K, greedy, 512
    # tokens: lookups' one failed first try kept them out for 116-125 passes in 2 of 5 runs)
    COUNTED = 8

    def __init__(self):
        self.recent: dict[str, deque] = defaultdict(lambda: deque(maxlen=self.WINDOW))
        self._rates: dict[str, float] = {}  # since the last record (a choice reads each edge ~30 times)
        self._totals: dict[str, list[float]] = {}  # per edge: expected tokens at gamma 0, 1, ... (seen)

    def record(self, edge: str, proposed: int, accepted: int) -> None:
        if proposed:
            self.recent[edge].append((accepted, int(accepted < proposed)))
            self._forget(edge)

    def recall(self, edge: str, history: list[tuple[int, int]]) -> None:
        """(successes, failures) of an earlier run's verifications, as if recorded before this one's."""
        self.recent[edge].extend(history)
        self._forget(edge)

    def _forget(self, edge: str) -> None:
        self._rates.pop(edge, None)
        self._totals.pop(edge, None)

    def known(self, edge: str) -> bool:
        return bool(self.recent.get(edge))

    def rate(self, edge: str) -> float:
        if edge not in self._rates:
            self._rates[edge] = self._rate(edge)
        return self._rates[edge]

    def _rate(self, edge: str) -> float:
        history = self.recent[edge]
        successes = sum(s for s, _ in history)
        failures = sum(f for _, f in history)
        return (successes + 1) / (successes + failures + 2)

    def expected(self, edge: str, gamma: float) -> float:
        """Tokens a verification of `gamma` proposals commits on average, the target's own next token
        included: 1 + the sum over positions j <= gamma of the chance that the first j are accepted.
        Position j is accepted, once the ones before it were, at the share of the verifications that
        reached j and accepted it, shrunk toward the pooled rate by PRIOR verifications; past the
        positions seen, and at all below COUNTED verifications, at the pooled rate. A fractional
        gamma (device rounds' expected proposals) is interpolated between its neighbours."""
        totals = self._totals.get(edge)
        if totals is None:
            totals = self._totals[edge] = self._expected_by_gamma(edge)
        low = int(gamma)
        if low == gamma and low < len(totals):  # the common case: a whole gamma within the positions seen
            return totals[low]
        a = self.rate(edge)
        if low + 1 >= len(totals):  # the positions past those seen: one pooled rate, the geometric tail
            last = len(totals) - 1
            survive = (totals[last] - totals[last - 1]) if last else 1.0
            return totals[last] + survive * a * (1 - a ** (gamma - last)) / (1 - a) if a < 1 else totals[last] + survive * (gamma - last)
        return totals[low] + (gamma - low) * (totals[low + 1] - totals[low])

    def _expected_by_gamma(self, edge: str) -> list[float]:
        """[expected tokens at gamma 0, 1, ..., the furthest position a verification reached]."""
        history, a = self.recent[edge], self.rate(edge)
        furthest = max((s + f for s, f in history), default=0) if len(history) >= self.COUNTED else 0
        totals, survive = [1.0], 1.0
        for j in range(1, furthest + 1):
            reached = sum(1 for s, f in history if s >= j or (f and s == j - 1))
            passed = sum(1 for s, _ in history if s >= j)
            survive *= (passed + self.PRIOR * a) / (reached + self.PRIOR)
            totals.append(totals[-1] + survive)
        return totals


def matched(edge: str, length: int) -> str:
    """The name a lookup edge's verifications after a match of `length` tokens are counted under."""
    return f"{edge}@{length}"
