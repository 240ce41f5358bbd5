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
configured one, with the arithmetic below; it runs the cheapest. Each mode is tried once first:
plain decoding first (twice: the pass every prediction leans on, never a loss against plain decoding,
and the first pass after a prefill is a warm-up),
then the others by how many levels they run, so that triforce comes after the modes that time its
drafter and its middle level - at their longest gamma (one pass at gamma 1 tells too little of the
acceptance: SmolLM2 at 16K, exploring so, settled on plain decoding, 8.6 tokens/s against 11.6 for
retrieval), skipping a mode whose best case (every proposal accepted, its untimed passes free)
already loses to what is measured (triforce on a 2-core CPU at 4K, where its drafter costs about
what a full pass costs, when acceptance is low). After that a mode not run lately is run once, at its longest gamma, to refresh
what it knows, when what the probe is predicted to lose against the best plan is at most
PROBE_SHARE of the decoding time since the mode last ran: a mode that nearly wins is probed every
few passes (a stale estimate of it costs most), one far behind rarely, and probing costs at most
about PROBE_SHARE of the run per mode. What a probe costs is taken as the larger of its prediction and
what the mode's probes really lost (a drafter that sat out catches up first). Against the doubling
intervals this replaced (every 16 passes, then 32, ... 256), side by side with plain decoding: a CPU
without bf16 at 16K (float32, one thread) 0.93x -> 0.97x; the 4K job on 2 bf16 cores, where nothing
beats plain decoding and a probe loses 2-3 plain passes, 0.92-1.00x -> 0.95-0.96x over 512 tokens;
at 16K, where the levels win, 1.17x -> 1.15x (within run-to-run noise).

Beside a model drafter the modes that draft also come with lookups in its place (modes.LOOKUP_VARIANT:
'lookup', 'triforce-lookup'), priced by the same arithmetic over the 'lookup' level's timings and
edges: which drafter pays changes within a run (a quotation is looked up, prose is not). A lookup's
verifications are also counted by how long a match it drafted from (`matched`; the engine tells each
pass's length, lookup.MatchIndex), and a pass is priced from those of its own length once there are
MATCHED of them: one pooled rate, dragged down by prose, kept quotations in plain decoding.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from .modes import ALL_LEVELS, SHAPE, drafts, first_level, proposing_level
from .pricing import Acceptance, PassCosts, full_pass, matched, max_gamma, needs, seconds_per_token
from .stats import round_name


@dataclass(frozen=True)
class Plan:
    mode: str
    gamma: int  # tokens proposed per full pass (0: autoregressive)


class Chooser:
    """Picks the plan of each full pass. `agree(index)` makes the ranks of a tensor-parallel group
    follow rank 0's choice (their timings differ, their tokens must not)."""

    # a probe is due when its predicted loss against the best plan is at most this share of the
    # decoding time since its mode last ran, and never sooner than PROBE_MIN passes after, never later
    # than PROBE_MAX (a mode whose estimate is far off still comes back)
    PROBE_SHARE, PROBE_MIN, PROBE_MAX = 0.005, 4, 256
    # a mode with a drafter must promise this much less per token to be switched to from one without:
    # the switch makes the drafter catch up on the tokens it did not see, which the per-pass figures
    # miss, and two modes within noise of each other would otherwise alternate (SmolLM2 at 16K:
    # speculative 9.3 tok/s, retrieval 9.0, adaptive flipping between them 8.1). Switching to a mode
    # without one costs nothing extra (the retrieval cache takes in every round's tokens whichever
    # mode ran): held there by a margin, the 4K job stayed in retrieval at 0.91x plain decoding.
    SWITCH_MARGIN = 0.1
    # plain decoding's first passes: the first after a prefill is a warm-up (SmolLM2 at 4K: 17.3 ms,
    # then 11.7; the round around it 34 ms), and every prediction leans on verify(1), so the second
    # replaces it (PassCosts) before any other mode is weighed against it
    WARM_PASSES = 2

    # a lookup edge is priced from the verifications that followed a match as long as this pass's once
    # it has this many of them (below, from all of its verifications)
    MATCHED = 8

    def __init__(self, modes: tuple[str, ...], gamma1: int, gamma2: int, agree: Callable[[int], int] | None = None,
                 device_rounds: bool = False, looked_up: tuple[str, ...] = (), lookup_gamma: int = 0):
        self.modes, self.gamma1, self.agree, self.device_rounds = modes, gamma1, agree, device_rounds
        # the levels whose proposals are lookups ('lookup' beside a model drafter, 'draft' under
        # --draft lookup): how well they draft hangs on how long a match the lookup has (lookup.MatchIndex)
        self.looked_up = frozenset(looked_up)
        self.match: int | None = None  # this pass's match length, when the engine tells it
        # the order modes are first tried in: plain decoding (it times verify(1), which every
        # prediction leans on), then by the levels they run, so that a mode's best case is bounded by
        # the passes the modes before it timed
        self.order = tuple(sorted(modes, key=lambda m: len(ALL_LEVELS[m])))
        # what a mode is tried and probed at; a full pass verifying lookups alone may run them further
        # (up to lookup_gamma: they cost no pass), where what they accepted after a match as long says so
        self.tried = {m: max_gamma(m, gamma1, gamma2) for m in modes}
        self.plans = [Plan(m, g) for m in modes for g in range(1 if m != "autoregressive" else 0, 1 + max(
            self.tried[m], lookup_gamma if proposing_level(m) in self.looked_up else 0))]
        self.costs, self.acceptance = PassCosts(), Acceptance()
        self.overhead: dict[str, float] = {}  # per mode: a round's seconds outside the passes (moving average)
        self.pass_seconds = 0.0  # every timed pass so far; a round's share is the difference
        # per choice not yet finished, oldest first: (its pass count, the best plan's seconds per token
        # when it is a probe, pass_seconds when it was made). Two are open where a plain pass is
        # queued before the host reads the last one's token (choose's `ahead`; engine._queued_tokens).
        self._open: deque[tuple[int, float | None, float]] = deque()
        self._finished_at = 0.0  # pass_seconds when the last round finished
        self.passes = 0
        self.elapsed = 0.0  # seconds of every finished round
        self.current: str | None = None  # the mode of the last pass that was not a probe
        self.last_used = {m: None for m in modes}  # the pass count, and the elapsed seconds, when each mode last ran
        self.last_time = {m: 0.0 for m in modes}
        self.probe_loss: dict[str, float] = {}  # per mode: seconds its probes lost against the best plan (average)
        self._probing: float | None = None  # while a choice is made: the best plan's seconds per token, if it probes
        self._again: str | None = None  # a mode whose probe just beat the best plan: probed once more next
        # inside one choice nothing it reads changes: each plan priced once. A choice priced the same
        # plans over and over (26 prices, 38 `known` checks for 6 modes at gamma2 6): 0.147 ms a pass
        # against 0.102 priced once, 0.271 against 0.168 at gamma2 16, side by side on a 2-core Xeon;
        # a resident GPU pass of SmolLM2 (2 ms) pays it on the host
        self._priced: dict | None = None

    def passed(self, level: str, tokens: int, seconds: float, typical: bool = True) -> None:
        """A pass of `level` over `tokens` tokens took `seconds` (Level.run, decode only). An untypical
        one (it captured a CUDA graph) counts in its round's time but not in the level's costs."""
        if typical:
            self.costs.record(level, tokens, seconds)
        self.pass_seconds += seconds

    def finished(self, mode: str, seconds: float, tokens: int | None = None) -> None:
        """The round (proposals, verification, upkeep) that choose() began took `seconds` in all and
        committed `tokens`: what its passes do not account for is the mode's overhead. Its average is
        slow to move (a retrieval rebuild lands on one round in dozens). A probe's round also tells
        what probing that mode really loses (a drafter that sat out first catches up, which its
        per-pass prediction misses: at 4K a speculative probe lost 26 ms where 7 were predicted).

        A probe that made its tokens at least as cheaply as the best plan would have is run again on
        the next pass, and so on while it keeps doing so: one verification among the WINDOW its edge
        remembers barely moves the mode's estimate, and a mode whose text changed under it (a lookup
        once the output repeats itself) would otherwise wait a full probe interval per success. SmolLM2
        at 4K, greedy, 512 tokens: lookups failed before the output looped, speculative took over,
        and lookups came back once in 80 passes, their one success outvoted by 15 stale failures.

        Rounds finish in the order they were chosen. A plain pass chosen while the last one is still in
        flight (queued ahead) is finished after it: its passes are those timed since that one finished."""
        self.elapsed += seconds
        index, probed, start = self._open.popleft() if self._open else (0, None, self.pass_seconds)
        start, self._finished_at = max(start, self._finished_at), self.pass_seconds
        if probed is not None and tokens is not None:  # averaged: a probe commits 1 to gamma + 1 tokens
            lost, old = max(seconds - tokens * probed, 0.0), self.probe_loss.get(mode)
            self.probe_loss[mode] = lost if old is None else 0.5 * (old + lost)
            self._again = mode if lost == 0.0 else None
        if index == 1:  # the first round after a prefill pays one-time costs outside its passes
            return
        outside = max(seconds - (self.pass_seconds - start), 0.0)
        old = self.overhead.get(mode)
        self.overhead[mode] = outside if old is None else 0.9 * old + 0.1 * outside

    def verified(self, edge: str, proposed: int, accepted: int) -> None:
        """A verification on `edge` accepted `accepted` of `proposed`: counted for the edge, and for a
        lookup's edge also apart, under this pass's match length."""
        self.acceptance.record(edge, proposed, accepted)
        if self._looks_up(edge):
            self.acceptance.record(matched(edge, self.match), proposed, accepted)

    def _looks_up(self, edge: str) -> bool:
        return self.match is not None and edge.split("->")[0] in self.looked_up

    def _edge(self, edge: str) -> str:
        """The history that prices `edge` now: a lookup's verifications after a match as long as this
        pass's, once there are MATCHED of them; else all of the edge's."""
        if self._looks_up(edge):
            own = matched(edge, self.match)
            if len(self.acceptance.recent.get(own, ())) >= self.MATCHED:
                return own
        return edge

    def rate(self, edge: str) -> float:
        return self.acceptance.rate(self._edge(edge))

    def expected(self, edge: str, gamma: float) -> float:
        return self.acceptance.expected(self._edge(edge), gamma)

    def _once(self, key, compute: Callable[[], object]):
        """compute(), kept for the rest of the choice under way (keys: a mode's name, a Plan)."""
        if self._priced is None:
            return compute()
        if key not in self._priced:
            self._priced[key] = compute()
        return self._priced[key]

    def known(self, mode: str) -> bool:
        return self._once(mode, lambda: self._known(mode))

    def _known(self, mode: str) -> bool:
        levels, edges = needs(mode)
        if SHAPE[mode] == "triforce" and self.costs.known(round_name(first_level(mode))):
            levels = ("verify",)  # whole rounds timed: their passes need not be
        return all(self.costs.known(x) for x in levels) and all(self.acceptance.known(x) for x in edges)

    def predict(self, plan: Plan) -> float:
        # keyed by a tuple, whose hash is C's: a Plan's generated __hash__ is a Python call (a choice
        # looks up 60 keys)
        return self._once((plan.mode, plan.gamma), lambda: self._predict(plan))

    def _predict(self, plan: Plan) -> float:
        return seconds_per_token(plan.mode, plan.gamma, self.gamma1, self.costs.estimate, self.rate,
                                 self.overhead.get(plan.mode, 0.0), self._round_cost(plan.mode, self.costs.estimate),
                                 self.device_rounds, self.expected)

    def _round_cost(self, mode: str, cost: Callable[[str, int], float]) -> float | None:
        """A drafter->middle round of `mode` as measured whole, where rounds ran as one graph
        (rounds.RoundGraph); None for a mode without such rounds or before one was timed."""
        name = round_name(first_level(mode))
        return cost(name, self.gamma1) if SHAPE[mode] == "triforce" and self.costs.known(name) else None

    def bound(self, plan: Plan) -> float:
        """The best case of a plan given what is measured: every proposal on an edge never seen
        accepted, a level never timed free, and a pass no cheaper than the dearest measured pass of
        that level over no more tokens."""
        def cost(level: str, tokens: int) -> float:
            return max((s for n, s in self.costs.mean.get(level, {}).items() if n <= tokens), default=0.0)

        def expect(edge: str, gamma: float) -> float:
            return self.expected(edge, gamma) if self.acceptance.known(edge) else gamma + 1.0

        return seconds_per_token(plan.mode, plan.gamma, self.gamma1, cost, self.rate,
                                 self.overhead.get(plan.mode, 0.0), self._round_cost(plan.mode, cost), self.device_rounds,
                                 expect)

    def best(self, mode: str | None = None) -> Plan:
        """The plan predicted cheapest (of `mode`'s plans when given); a mode not measured yet runs
        its longest plan."""
        plans = [p for p in self.plans if mode in (None, p.mode)]
        measured = [p for p in plans if self.known(p.mode)]
        if measured:
            return min(measured, key=self.predict)
        return self.longest(mode) if mode is not None else max(plans, key=lambda p: p.gamma)

    def longest(self, mode: str) -> Plan:
        """A probe's plan: the mode at its longest gamma, which tells the most of its acceptance and
        refreshes the cost of the widest verification, the one a plan never run again would keep
        stale (the shorter ones are priced from the line through it and what does run). Lookups are
        tried no further than a model drafter would be: past that they pay only after a long match,
        which the prediction, not a probe, finds."""
        return Plan(mode, self.tried[mode])

    def choose(self, match: int | None = None, ahead: bool = False) -> Plan:
        """The next full pass's plan; `match`: how many tokens the lookup's match spans there
        (lookup.MatchIndex), for a chooser with lookups. `ahead`: the last pass chosen is still in
        flight, and finishes first; else any choice not finished was forgotten (a pass queued past a
        stop), and finished() refers to this one."""
        self.match = match
        self._priced = {}  # modes' `known` and plans' prices, for this choice only
        try:
            plan = self._choose()
        finally:
            self._priced = None
        if self.agree is not None:
            plan = self.plans[self.agree(self.plans.index(plan))]
        self.passes += 1
        self.last_used[plan.mode], self.last_time[plan.mode] = self.passes, self.elapsed
        if not ahead:
            self._open.clear()
        self._open.append((self.passes, self._probing, self.pass_seconds))
        self._probing = None
        return plan

    def _choose(self) -> Plan:
        if "autoregressive" in self.modes and self.passes < self.WARM_PASSES:
            return Plan("autoregressive", 0)
        for mode in self.order:  # the first passes: every mode once, unless it cannot win
            if self.last_used[mode] is None:
                tried = [p for p in self.plans if self.last_used[p.mode] is not None and self.known(p.mode)]
                if tried and min(self.bound(p) for p in self.plans if p.mode == mode) > min(map(self.predict, tried)):
                    # as if tried now: a probe comes back to it later
                    self.last_used[mode], self.last_time[mode] = self.passes, self.elapsed
                    continue
                if tried:  # what this first try loses tells when probing the mode pays
                    self._probing = min(map(self.predict, tried))
                return self.best(mode)
        plan = self.best()
        again, self._again = self._again, None
        if again is not None and again != plan.mode:
            self._probing = self.predict(plan)
            return self.longest(again)
        for mode in self.modes:
            if mode != plan.mode and self._probe_due(mode, plan):
                self._probing = self.predict(plan)
                return self.longest(mode)
        if self.current is not None and drafts(plan.mode) and not drafts(self.current):
            staying = self.best(self.current)
            if self.predict(plan) > (1 - self.SWITCH_MARGIN) * self.predict(staying):
                plan = staying
        self.current = plan.mode
        return plan

    def loss(self, probe: Plan, best: Plan) -> float:
        """Seconds a pass of `probe` is predicted to lose against making its tokens at `best`'s rate
        (a mode not yet predictable is priced at its best case)."""
        if self.known(probe.mode):  # bound is its best case: every proposal accepted
            seconds, tokens = full_pass(probe.mode, probe.gamma, self.gamma1, self.costs.estimate, self.rate,
                                        self.overhead.get(probe.mode, 0.0), self._round_cost(probe.mode, self.costs.estimate),
                                        self.device_rounds, self.expected)
            per_token = seconds / tokens
        else:
            per_token, tokens = self.bound(probe), probe.gamma + 1.0
        return max(per_token - self.predict(best), 0.0) * tokens

    def _probe_due(self, mode: str, best: Plan) -> bool:
        since = self.passes - self.last_used[mode]
        if since < self.PROBE_MIN:
            return False
        loss = max(self.loss(self.longest(mode), best), self.probe_loss.get(mode, 0.0))
        return since >= self.PROBE_MAX or loss <= self.PROBE_SHARE * (self.elapsed - self.last_time[mode])

    def state(self) -> dict:
        """What this chooser learned, as JSON-able data: each level's pass costs by width, each
        edge's recent verifications, each mode's round overhead and what its probes lost, and how
        long ago (passes, decoding seconds) each mode last ran."""
        idle = {m: [self.passes - self.last_used[m], self.elapsed - self.last_time[m]]
                for m in self.modes if self.last_used[m] is not None}
        return {"costs": {level: {str(n): s for n, s in widths.items()} for level, widths in self.costs.mean.items()},
                "acceptance": {edge: [list(v) for v in history] for edge, history in self.acceptance.recent.items()},
                "overhead": dict(self.overhead), "probe_loss": dict(self.probe_loss), "idle": idle}

    def restore(self, state: dict) -> None:
        """Start from what an earlier run learned (`state()`), as if every mode had been tried: the
        first passes go to the plan those figures price cheapest, and the others come back as probes
        when due, counting the passes and seconds since each last ran in that run (so that short runs
        one after another still probe, as one long run would). A restored cost stands only until two fresh passes of that width replace it
        (PassCosts): the machine may be busier now, and the first pass after a load is a warm-up.
        Malformed data raises (ValueError, TypeError, KeyError, AttributeError) before anything changes."""
        costs = {level: {int(n): float(s) for n, s in widths.items()} for level, widths in state["costs"].items()}
        history = {edge: [(int(a), int(f)) for a, f in pairs] for edge, pairs in state["acceptance"].items()}
        overhead = {m: float(v) for m, v in state["overhead"].items() if m in self.modes}
        probe_loss = {m: float(v) for m, v in state["probe_loss"].items() if m in self.modes}
        idle = {m: (int(p), float(t)) for m, (p, t) in state.get("idle", {}).items() if m in self.modes}
        for level, widths in costs.items():
            for tokens, seconds in widths.items():
                self.costs.assume(level, tokens, seconds)
        for edge, pairs in history.items():
            self.acceptance.recall(edge, pairs)
        self.overhead.update(overhead)
        self.probe_loss.update(probe_loss)
        for mode in self.modes:
            passes, seconds = idle.get(mode, (0, 0.0))
            self.last_used[mode], self.last_time[mode] = -passes, -seconds

    def summary(self) -> dict:
        """What the chooser believes now: predicted ms per token of each mode at its best gamma."""
        out = {}
        for mode in self.modes:
            if self.known(mode):
                plan = self.best(mode)
                out[mode] = {"gamma": plan.gamma, "ms_per_token": 1000 * self.predict(plan)}
        return out
