"""Adaptive decoding: each full-cache pass takes the proposer that this run's own measurements say
costs least per committed token.

Every mode is lossless on its own - what one full-cache pass commits is distributed exactly as the
target's autoregressive output, whichever proposer drafted it - so choosing the proposer afresh
before each pass changes the speed and never the output distribution. Which mode is fastest is not
knowable in advance: at 105K tokens on a 2-core CPU a 4-token verification costs 1.7x a 1-token
pass and triforce lost to plain decoding (docs/results/2026-11-23-cpu-epyc-2core.md), on a GPU streaming the KV the full
pass dwarfs the rest and triforce wins 2-3x, and acceptance moves with the text.

So the generator times every pass (seconds against tokens fed, per level) and every round as a
whole (what its passes leave out - sampling, the retrieval cache's upkeep - is the mode's overhead),
counts acceptance per edge (draft->middle, draft->verify, middle->verify), and before each full
pass predicts the
milliseconds per token of every sub-hierarchy of the levels it built, at every gamma up to the
configured one, with the arithmetic below; it runs the cheapest. Each mode is tried once first -
the configured one, then plain decoding, then the rest, at their longest gamma (one pass at gamma 1
tells too little of the acceptance: SmolLM2 at 16K, exploring so, settled on plain decoding, 8.6
tokens/s against 11.6 for retrieval), skipping a mode whose best case (every proposal accepted, its
untimed passes free) already loses to what is measured - and a mode left unused for its probe interval is
run once, at its longest gamma, to refresh what it knows, which bounds what a stale estimate can cost; the interval
doubles (PROBE_EVERY up to PROBE_MAX passes) each time a mode is probed and starts again from
PROBE_EVERY when the mode wins, so a mode that keeps losing costs ever less.
"""
from __future__ import annotations

import math
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Callable

from .modes import SUB_MODES  # noqa: F401 (the modes a hierarchy can run)
from .stats import ROUND


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
                      device_rounds: bool = False) -> float:
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
    """
    e = tokens_per_verification
    if mode == "autoregressive":
        return cost("verify", 1) + overhead
    if mode == "speculative":
        return (gamma * cost("draft", 1) + cost("verify", gamma + 1) + overhead) / e(accept("draft->verify"), gamma)
    if mode == "retrieval":
        return (gamma * cost("middle", 1) + cost("verify", gamma + 1) + overhead) / e(accept("middle->verify"), gamma)
    if mode == "triforce":
        if round_cost is None:
            round_cost = gamma1 * cost("draft", 1) + cost("middle", gamma1 + 1)
        per_round = e(accept("draft->middle"), gamma1)
        if device_rounds:
            rounds = max(1, math.ceil(gamma / per_round - 1e-9))
            width = rounds * (gamma1 + 1)
            return (rounds * round_cost + cost("verify", width + 1) + overhead) / e(accept("middle->verify"), rounds * per_round)
        per_middle_token = round_cost / per_round
        return (gamma * per_middle_token + cost("verify", gamma + 1) + overhead) / e(accept("middle->verify"), gamma)
    raise ValueError(f"unknown mode {mode!r}")


def needs(mode: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(levels timed, acceptance edges counted) before `mode` can be predicted."""
    return {"autoregressive": (("verify",), ()),
            "speculative": (("draft", "verify"), ("draft->verify",)),
            "retrieval": (("middle", "verify"), ("middle->verify",)),
            "triforce": (("draft", "middle", "verify"), ("draft->middle", "middle->verify"))}[mode]


def max_gamma(mode: str, gamma1: int, gamma2: int) -> int:
    """The longest run of proposals per full pass a mode is tried with: gamma2 for the middle level's
    runs; the drafter alone as long as either (a speculative-only run's configured length is gamma1)."""
    return {"autoregressive": 0, "speculative": max(gamma1, gamma2)}.get(mode, gamma2)


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

    def record(self, level: str, tokens: int, seconds: float) -> None:
        seen = self.samples[level][tokens]
        old = self.mean[level].get(tokens)
        self.mean[level][tokens] = seconds if seen < 2 else self.decay * old + (1 - self.decay) * seconds
        self.samples[level][tokens] = seen + 1

    def known(self, level: str) -> bool:
        return bool(self.mean.get(level))

    def estimate(self, level: str, tokens: int) -> float:
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
    """Per edge, the rate one proposal is accepted at, from the last WINDOW verifications. A pass that
    accepts k of g proposals saw k successes and, when k < g, one failure (nothing after the first
    rejection was tried), so the rate is successes / (successes + failures), with one of each as
    a prior so that a short history never reads 0 or 1."""

    WINDOW = 16

    def __init__(self):
        self.recent: dict[str, deque] = defaultdict(lambda: deque(maxlen=self.WINDOW))

    def record(self, edge: str, proposed: int, accepted: int) -> None:
        if proposed:
            self.recent[edge].append((accepted, int(accepted < proposed)))

    def known(self, edge: str) -> bool:
        return bool(self.recent.get(edge))

    def rate(self, edge: str) -> float:
        history = self.recent[edge]
        successes = sum(s for s, _ in history)
        failures = sum(f for _, f in history)
        return (successes + 1) / (successes + failures + 2)


@dataclass(frozen=True)
class Plan:
    mode: str
    gamma: int  # tokens proposed per full pass (0: autoregressive)


class Chooser:
    """Picks the plan of each full pass. `agree(index)` makes the ranks of a tensor-parallel group
    follow rank 0's choice (their timings differ, their tokens must not)."""

    PROBE_EVERY, PROBE_MAX = 16, 256  # full passes a mode may go unused before it is run once again
    # another mode must promise this much less per token to be switched to: a switch has costs the
    # per-pass figures miss (the drafter catching up on the tokens it did not see), and two modes
    # within noise of each other would otherwise alternate (SmolLM2 at 16K: speculative 9.3 tok/s,
    # retrieval 9.0, adaptive flipping between them 8.1)
    SWITCH_MARGIN = 0.1

    def __init__(self, modes: tuple[str, ...], gamma1: int, gamma2: int, agree: Callable[[int], int] | None = None,
                 device_rounds: bool = False):
        self.modes, self.gamma1, self.agree, self.device_rounds = modes, gamma1, agree, device_rounds
        # the order modes are first tried in: the configured one, then plain decoding (one cheap pass
        # that times verify(1), which every prediction leans on), then the others
        self.order = tuple(dict.fromkeys(modes[:1] + tuple(m for m in modes if m == "autoregressive") + modes))
        self.plans = [Plan(m, g) for m in modes for g in range(1 if m != "autoregressive" else 0,
                                                                 max_gamma(m, gamma1, gamma2) + 1)]
        self.costs, self.acceptance = PassCosts(), Acceptance()
        self.overhead: dict[str, float] = {}  # per mode: a round's seconds outside the passes (moving average)
        self.pass_seconds = 0.0  # every timed pass so far; a round's share is the difference
        self._round_start = 0.0
        self.passes = 0
        self.current: str | None = None  # the mode of the last pass that was not a probe
        self.last_used = {m: None for m in modes}
        self.interval = {m: self.PROBE_EVERY for m in modes}

    def passed(self, level: str, tokens: int, seconds: float, typical: bool = True) -> None:
        """A pass of `level` over `tokens` tokens took `seconds` (Level.run, decode only). An untypical
        one (it captured a CUDA graph) counts in its round's time but not in the level's costs."""
        if typical:
            self.costs.record(level, tokens, seconds)
        self.pass_seconds += seconds

    def finished(self, mode: str, seconds: float) -> None:
        """The round (proposals, verification, upkeep) that choose() began took `seconds` in all:
        what its passes do not account for is the mode's overhead. Its average is slow to move
        (a retrieval rebuild lands on one round in dozens)."""
        outside = max(seconds - (self.pass_seconds - self._round_start), 0.0)
        old = self.overhead.get(mode)
        self.overhead[mode] = outside if old is None else 0.9 * old + 0.1 * outside

    def known(self, mode: str) -> bool:
        levels, edges = needs(mode)
        if mode == "triforce" and self.costs.known(ROUND):  # whole rounds timed: their passes need not be
            levels = ("verify",)
        return all(self.costs.known(x) for x in levels) and all(self.acceptance.known(x) for x in edges)

    def predict(self, plan: Plan) -> float:
        return seconds_per_token(plan.mode, plan.gamma, self.gamma1, self.costs.estimate, self.acceptance.rate,
                                 self.overhead.get(plan.mode, 0.0), self._round_cost(self.costs.estimate),
                                 self.device_rounds)

    def _round_cost(self, cost: Callable[[str, int], float]) -> float | None:
        """A drafter->middle round as measured whole, where rounds ran as one graph (rounds.RoundGraph)."""
        return cost(ROUND, self.gamma1) if self.costs.known(ROUND) else None

    def bound(self, plan: Plan) -> float:
        """The best case of a plan given what is measured: every proposal on an edge never seen
        accepted, a level never timed free, and a pass no cheaper than the dearest measured pass of
        that level over no more tokens."""
        def cost(level: str, tokens: int) -> float:
            return max((s for n, s in self.costs.mean.get(level, {}).items() if n <= tokens), default=0.0)

        def accept(edge: str) -> float:
            return self.acceptance.rate(edge) if self.acceptance.known(edge) else 1.0

        return seconds_per_token(plan.mode, plan.gamma, self.gamma1, cost, accept, self.overhead.get(plan.mode, 0.0),
                                 self._round_cost(cost), self.device_rounds)

    def best(self, mode: str | None = None) -> Plan:
        """The plan predicted cheapest (of `mode`'s plans when given); a mode not measured yet runs
        its longest plan."""
        plans = [p for p in self.plans if mode in (None, p.mode)]
        measured = [p for p in plans if self.known(p.mode)]
        return min(measured, key=self.predict) if measured else max(plans, key=lambda p: p.gamma)

    def longest(self, mode: str) -> Plan:
        """A probe's plan: the mode at its longest gamma, which tells the most of its acceptance and
        refreshes the cost of the widest verification, the one a plan never run again would keep
        stale (the shorter ones are priced from the line through it and what does run)."""
        return max((p for p in self.plans if p.mode == mode), key=lambda p: p.gamma)

    def choose(self) -> Plan:
        plan = self._choose()
        if self.agree is not None:
            plan = self.plans[self.agree(self.plans.index(plan))]
        self.passes += 1
        self.last_used[plan.mode] = self.passes
        self._round_start = self.pass_seconds
        return plan

    def _choose(self) -> Plan:
        for mode in self.order:  # the first passes: every mode once, unless it cannot win
            if self.last_used[mode] is None:
                tried = [p for p in self.plans if self.last_used[p.mode] is not None and self.known(p.mode)]
                if tried and min(self.bound(p) for p in self.plans if p.mode == mode) > min(map(self.predict, tried)):
                    self.last_used[mode] = self.passes  # as if tried now: a probe comes back to it later
                    continue
                return self.best(mode)
        for mode in self.modes:
            if self.passes - self.last_used[mode] >= self.interval[mode]:
                self.interval[mode] = min(2 * self.interval[mode], self.PROBE_MAX)
                return self.longest(mode)
        plan = self.best()
        if self.current is not None and plan.mode != self.current:
            staying = self.best(self.current)
            if self.predict(plan) > (1 - self.SWITCH_MARGIN) * self.predict(staying):
                plan = staying
        self.current = plan.mode
        self.interval[plan.mode] = self.PROBE_EVERY
        return plan

    def summary(self) -> dict:
        """What the chooser believes now: predicted ms per token of each mode at its best gamma."""
        out = {}
        for mode in self.modes:
            if self.known(mode):
                plan = self.best(mode)
                out[mode] = {"gamma": plan.gamma, "ms_per_token": 1000 * self.predict(plan)}
        return out
