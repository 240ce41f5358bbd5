"""The adaptive generator: its arithmetic, its choices on known costs, and that switching modes pass
by pass stays lossless - greedy tokens identical to autoregressive decoding (float64), sampled
tokens with exactly the target's distribution (chi-square against enumeration, test_sampling.py)."""
from __future__ import annotations

import json
import math
import random
from collections import defaultdict, deque

import pytest
import torch

from triforce.speculative import GenerationConfig, Generator, Models, generate_ids
from triforce.speculative.modes import SUB_MODES, adaptive_modes
from triforce.speculative.adaptive import Chooser, Plan
from triforce.speculative.pricing import Acceptance, PassCosts, full_pass, seconds_per_token, tokens_per_verification
from triforce.model.loader import load_model
from triforce.speculative.sampling import Sampler

from ..helpers import run
from ..conftest import save_tiny
from .test_sampling import PROMPT as SAMPLING_PROMPT, SETTINGS as SAMPLING_SETTINGS
from .test_sampling import SAMPLES, chi_square_rejects, exact_joint, models  # noqa: F401 (models: a fixture)

# ------------------------------------------------------------------------------ arithmetic


def test_acceptance_counts_one_failure_per_rejection():
    a = Acceptance()
    a.record("middle->verify", proposed=4, accepted=4)  # 4 successes, nothing rejected
    a.record("middle->verify", proposed=4, accepted=1)  # 1 success, then a rejection; 2 never tried
    assert a.rate("middle->verify") == pytest.approx((5 + 1) / (5 + 1 + 2))
    a.record("draft->verify", proposed=0, accepted=0)  # an autoregressive pass proposes nothing
    assert not a.known("draft->verify")


def test_acceptance_forgets_old_passes():
    a = Acceptance()
    for _ in range(Acceptance.WINDOW):
        a.record("e", 3, 0)
    low = a.rate("e")
    for _ in range(Acceptance.WINDOW):
        a.record("e", 3, 3)
    assert low < 0.1 and a.rate("e") > 0.95



def test_expected_tokens_follow_what_verifications_accepted_position_by_position():
    """All or nothing (a run of proposals the target agrees with, or none): one rate per proposal
    says more than came; counted position by position, what came (to within the prior's pull)."""
    a = Acceptance()
    for accepted in (6,) * 10 + (0,) * 6:  # 7 tokens 10 times, 1 token 6 times: 4.75 on average
        a.record("middle->verify", 6, accepted)
    assert a.expected("middle->verify", 6) == pytest.approx(4.75, abs=0.05)
    assert tokens_per_verification(a.rate("middle->verify"), 6) > 5.1  # one rate: 5.17
    assert a.expected("middle->verify", 0) == 1.0
    # past the positions seen, the pooled rate carries on from where the count stopped
    survive = a.expected("middle->verify", 6) - a.expected("middle->verify", 5)
    r = a.rate("middle->verify")
    assert a.expected("middle->verify", 8) == pytest.approx(a.expected("middle->verify", 6) + survive * (r + r * r))


def test_expected_tokens_are_the_geometric_ones_where_each_proposal_stands_alone():
    """Proposals accepted independently at 0.8: the count by position agrees with one rate (both
    within sampling error of the truth), and with nothing seen it is the rate's formula exactly."""
    rng = random.Random(0)
    a = Acceptance()
    a.recent = defaultdict(lambda: deque(maxlen=None))  # every verification, not the last 16
    for _ in range(4000):
        accepted = 0
        while accepted < 6 and rng.random() < 0.8:
            accepted += 1
        a.record("e", 6, accepted)
    for gamma in (1, 3, 6):
        assert a.expected("e", gamma) == pytest.approx(tokens_per_verification(0.8, gamma), rel=0.02)
    fresh = Acceptance()
    assert fresh.expected("e", 4) == pytest.approx(tokens_per_verification(fresh.rate("e"), 4))
    # a fractional gamma (device rounds' expected proposals) lies between its neighbours
    assert a.expected("e", 2) < a.expected("e", 2.5) < a.expected("e", 3)


def test_the_chooser_prices_runs_by_what_verifications_accepted():
    """Retrieval's verifications all or nothing: the chooser prices a plan at the tokens that came."""
    chooser = Chooser(SUB_MODES["retrieval"], gamma1=2, gamma2=6)
    teach(chooser, verify=lambda n: 1.0 + 0.1 * n, middle=0.05)
    for accepted in (6,) * 10 + (0,) * 6:
        chooser.acceptance.record("middle->verify", 6, accepted)
    seconds, tokens = full_pass("retrieval", 6, 2, chooser.costs.estimate, chooser.acceptance.rate,
                                expect=chooser.acceptance.expected)
    assert tokens == pytest.approx(4.75, abs=0.05)
    assert chooser.predict(Plan("retrieval", 6)) == pytest.approx(seconds / tokens)


def test_pass_costs_fit_a_line_between_and_beyond_measured_sizes():
    c = PassCosts()
    c.record("verify", 1, 0.8)
    c.record("verify", 4, 1.4)
    assert c.estimate("verify", 1) == 0.8 and c.estimate("verify", 4) == 1.4
    assert c.estimate("verify", 2) == pytest.approx(1.0) and c.estimate("verify", 7) == pytest.approx(2.0)
    c.record("draft", 1, 0.05)
    assert c.estimate("draft", 3) == 0.05  # one size measured: the same cost for any size


def test_a_first_pass_at_a_size_stands_only_until_a_second():
    """The first pass at a token count is often a warm-up: the second replaces it, later ones move
    the average."""
    c = PassCosts(decay=0.7)
    c.record("verify", 4, 0.073)
    assert c.estimate("verify", 4) == 0.073
    c.record("verify", 4, 0.040)
    assert c.estimate("verify", 4) == 0.040
    c.record("verify", 4, 0.050)
    assert c.estimate("verify", 4) == pytest.approx(0.7 * 0.040 + 0.3 * 0.050)


def test_seconds_per_token_matches_the_cost_model():
    from bench.costmodel import ms_per_token_from_passes

    ms = {"draft": 2.0, "middle": 5.0, "verify": 40.0}
    acc = {"draft->verify": 0.5, "draft->middle": 0.7, "middle->verify": 0.8}
    for mode in SUB_MODES["triforce"]:
        direct = seconds_per_token(mode, 2 if mode == "speculative" else 4, 2,
                                   lambda level, n: ms[level], lambda e: acc[e])
        assert ms_per_token_from_passes(mode, ms, acc, gamma1=2, gamma2=4) == pytest.approx(direct)
    # triforce: rounds of min(2, r) drafts while r of the 4 middle tokens remain, a round of g costing
    # 2 g + 5; 0, 1 or 2 of 2 drafts stand with chances .3, .21, .49 (of 1: .3, .7). By hand, the rounds
    # that make r tokens cost 7 (r = 1), 9 + .3 x 7 = 11.1 (2), 9 + .3 x 11.1 + .21 x 7 = 13.8 (3) and
    # 9 + .3 x 13.8 + .21 x 11.1 + .49 x 7 = 18.901 (4); plus a verify, over E(.8, 4) = 3.3616
    assert ms_per_token_from_passes("triforce", ms, acc, 2, 4) == pytest.approx((18.901 + 40) / 3.3616)
    # device rounds: whole rounds of 2 drafts, ceil(4 / 2.19) = 2 of them, each verified in full (6 positions)
    assert seconds_per_token("triforce", 4, 2, lambda level, n: ms[level], lambda e: acc[e], device_rounds=True) == \
        pytest.approx((2 * 9 + 40) / tokens_per_verification(0.8, 2 * 2.19))


def test_a_lookup_variant_is_its_mode_with_the_lookup_in_the_drafters_place():
    """The lookup variants are priced by the drafter's arithmetic over the 'lookup' level's costs
    and edges (a whole round: its own timing), never the model drafter's."""
    ms = {"draft": 2.0, "lookup": 0.1, "middle": 5.0, "verify": 40.0, "draft+middle": 9.0, "lookup+middle": 5.5}
    acc = {"draft->verify": 0.5, "draft->middle": 0.7, "lookup->verify": 0.3, "lookup->middle": 0.4,
           "middle->verify": 0.8}
    renamed = {"draft": "lookup", "draft->verify": "lookup->verify", "draft->middle": "lookup->middle"}
    for mode, variant in (("speculative", "lookup"), ("triforce", "triforce-lookup")):
        for device_rounds in (False, True):
            as_lookup = seconds_per_token(mode, 4, 2, lambda lv, n: ms[renamed.get(lv, lv)],
                                          lambda e: acc[renamed.get(e, e)], device_rounds=device_rounds)
            assert seconds_per_token(variant, 4, 2, lambda lv, n: ms[lv], lambda e: acc[e],
                                     device_rounds=device_rounds) == pytest.approx(as_lookup)
    chooser = Chooser(adaptive_modes("triforce", lookup=True), gamma1=2, gamma2=6)
    teach(chooser, lambda n: 0.04, accept={"draft->middle": 0.7, "lookup->middle": 0.4, "middle->verify": 0.8})
    assert not chooser.known("triforce-lookup")  # its level never timed
    chooser.costs.record("lookup+middle", 2, 0.0055)
    assert chooser.known("triforce-lookup") and chooser.known("triforce")
    seen = chooser.acceptance
    expected = full_pass("triforce", 6, 2, chooser.costs.estimate, lambda e: seen.rate(renamed.get(e, e)), round_cost=0.0055,
                         expect=lambda e, g: seen.expected(renamed.get(e, e), g))
    assert chooser.predict(Plan("triforce-lookup", 6)) == pytest.approx(expected[0] / expected[1])
    assert chooser.order == ("autoregressive", "retrieval", "speculative", "lookup", "triforce", "triforce-lookup")


# ------------------------------------------------------------------------------ choices


def teach(chooser: Chooser, verify, draft=0.01, middle=0.02, accept=None):
    """Feed the chooser measurements: verify(n) seconds per pass, flat draft and middle passes, and per
    edge a window of single proposals accepted in the proportion given."""
    for n in range(1, 9):
        chooser.costs.record("verify", n, verify(n))
        chooser.costs.record("middle", n, middle)
        chooser.costs.record("draft", n, draft)
    for edge, rate in (accept or {}).items():
        successes = round(rate * Acceptance.WINDOW)
        for i in range(Acceptance.WINDOW):
            chooser.acceptance.record(edge, 1, int(i < successes))
    for mode in chooser.modes:
        chooser.last_used[mode] = 0
    chooser.passes = max(chooser.passes, Chooser.WARM_PASSES)  # plain decoding's warm-up passes are behind it


def test_choice_follows_the_costs():
    """A full pass whose cost grows steeply with the tokens it verifies (a CPU at long context) and
    low acceptance: plain decoding wins. A flat full pass (a GPU streaming KV) and good acceptance:
    triforce with the longest run."""
    cpu = Chooser(SUB_MODES["triforce"], gamma1=2, gamma2=6)
    teach(cpu, verify=lambda n: 0.8 + 0.4 * (n - 1), accept={"draft->middle": 0.25, "draft->verify": 0.25,
                                                            "middle->verify": 0.25})
    assert cpu.choose() == Plan("autoregressive", 0)

    gpu = Chooser(SUB_MODES["triforce"], gamma1=2, gamma2=6)
    teach(gpu, verify=lambda n: 1.0 + 0.001 * n, draft=0.005, middle=0.05, accept={"draft->middle": 0.75, "draft->verify": 0.25,
                                                          "middle->verify": 0.75})
    assert gpu.choose() == Plan("triforce", 6)
    predicted = gpu.summary()
    assert predicted["triforce"]["ms_per_token"] < predicted["retrieval"]["ms_per_token"] < predicted["autoregressive"]["ms_per_token"]


def test_rounds_timed_whole_price_triforce():
    """Where each drafter->middle round runs as one graph (rounds.RoundGraph) its passes are not timed
    one by one: the round's own time prices triforce, and is all triforce needs besides the full pass."""
    from triforce.speculative.stats import ROUND

    acc = {"draft->middle": 0.75, "draft->verify": 0.25, "middle->verify": 0.75}
    chooser = Chooser(SUB_MODES["triforce"], gamma1=2, gamma2=6)
    teach(chooser, verify=lambda n: 1.0, accept=acc)
    from_passes = chooser.predict(Plan("triforce", 6))
    seen = chooser.acceptance
    assert from_passes == pytest.approx(seconds_per_token("triforce", 6, 2, chooser.costs.estimate, seen.rate,
                                                          expect=seen.expected))
    chooser.passed(ROUND, 2, 0.5)  # one round as a graph: dearer than its passes' sum (0.01 x 2 + 0.02)
    whole = chooser.predict(Plan("triforce", 6))
    per_middle = 0.5 / seen.expected("draft->middle", 2)
    e = seen.expected("middle->verify", 6)
    assert whole == pytest.approx((6 * per_middle + 1.0) / e) and whole > from_passes

    alone = Chooser(SUB_MODES["triforce"], gamma1=2, gamma2=6)  # only whole rounds and the full pass timed
    alone.passed("verify", 7, 1.0)
    alone.passed(ROUND, 2, 0.05)
    for edge in ("draft->middle", "middle->verify"):
        alone.acceptance.record(edge, 2, 1)
    assert alone.known("triforce") and not alone.known("speculative")


def test_device_rounds_are_priced_by_the_positions_their_full_pass_verifies():
    """Device rounds (rounds.py) verify every position of their R rounds, R (gamma1 + 1), capped at what
    the rounds made: where a wide verification is dear (a CPU at long context) the chooser must see
    that they cost more than host-driven rounds of the same gamma."""
    acc = {"draft->middle": 0.5, "draft->verify": 0.25, "middle->verify": 0.5}
    host, device = (Chooser(SUB_MODES["triforce"], gamma1=2, gamma2=6, device_rounds=d) for d in (False, True))
    for chooser in (host, device):
        teach(chooser, verify=lambda n: 0.1 * n, accept=acc)
    a_dm, a_mv = host.acceptance.rate("draft->middle"), host.acceptance.rate("middle->verify")
    e1 = 1 + a_dm + a_dm ** 2
    rounds = math.ceil(3 / e1)  # gamma 3: two rounds of 2 drafts, 6 positions verified
    made = rounds * e1
    expected = (rounds * (2 * 0.01 + 0.02) + 0.1 * (rounds * 3 + 1)) / ((1 - a_mv ** (made + 1)) / (1 - a_mv))
    assert rounds == 2 and device.predict(Plan("triforce", 3)) == pytest.approx(expected)
    assert device.predict(Plan("triforce", 3)) > host.predict(Plan("triforce", 3))


def test_a_lookup_is_priced_by_the_verifications_after_a_match_as_long_as_this_one():
    """A lookup drafts well after a long match and badly after a short one (a book chat's quotation
    against its prose): its edge's verifications are counted by the pass's match length, and a pass
    is priced from those of its own length once there are MATCHED; a model drafter's edge is not split."""
    chooser = Chooser(("autoregressive", "speculative", "lookup"), gamma1=3, gamma2=3, looked_up=("lookup",))
    for match, accepted in [(1, 0)] * 12 + [(3, 3)] * (Chooser.MATCHED - 1):
        chooser.match = match  # as choose(match) sets it
        chooser.verified("lookup->verify", 3, accepted)
        chooser.verified("draft->verify", 3, accepted)
    pooled = chooser.acceptance.rate("lookup->verify")
    chooser.match = 3  # one too few after a 3-token match: the pooled rate prices it
    assert chooser.rate("lookup->verify") == pooled
    chooser.verified("lookup->verify", 3, 3)
    assert chooser.rate("lookup->verify") == chooser.acceptance.rate("lookup->verify@3") > 0.8 > pooled
    assert chooser.expected("lookup->verify", 3) == chooser.acceptance.expected("lookup->verify@3", 3)
    chooser.match = 1
    assert chooser.rate("lookup->verify") == chooser.acceptance.rate("lookup->verify@1") < 0.1
    chooser.match = 2  # none seen after a 2-token match
    assert chooser.rate("lookup->verify") == chooser.acceptance.rate("lookup->verify")
    assert "draft->verify@1" not in chooser.acceptance.recent
    # so the same history picks the lookup at its longest gamma after a long match, plain decoding after a short one
    for plan in [Plan("autoregressive", 0)] * 2 + [Plan("lookup", 3)]:
        chooser.passed("verify", plan.gamma + 1, 0.010 + 0.002 * plan.gamma)
        chooser.passed("lookup", 1, 0.0001)
    chooser.match = 3
    assert chooser.best() == Plan("lookup", 3)
    chooser.match = 1
    assert chooser.best() == Plan("autoregressive", 0)


def test_lookups_alone_may_run_past_gamma2_but_are_tried_and_probed_at_it():
    """A full pass verifying lookups alone is weighed up to lookup_gamma (a lookup costs no pass); it
    is tried and probed at the drafter's gamma, and the longer plans win only where what lookups
    accepted after a match as long says so (a quotation). A model drafter's plans are not extended."""
    modes = ("autoregressive", "speculative", "lookup", "triforce-lookup", "retrieval")
    chooser = Chooser(modes, gamma1=2, gamma2=3, looked_up=("lookup",), lookup_gamma=8)
    longest = {m: max(p.gamma for p in chooser.plans if p.mode == m) for m in modes}
    assert longest == {"autoregressive": 0, "speculative": 3, "lookup": 8, "triforce-lookup": 3, "retrieval": 3}
    assert chooser.longest("lookup") == Plan("lookup", 3) and chooser.best("lookup") == Plan("lookup", 3)
    # every 3 lookups after a 3-token match stood, after a 1-token match none did
    for match, accepted in [(3, 3)] * Chooser.MATCHED + [(1, 0)] * Chooser.MATCHED:
        chooser.match = match
        chooser.verified("lookup->verify", 3, accepted)
    for width in range(1, 10):  # a verification costs 10 ms and 2 more a position
        chooser.passed("verify", width, 0.010 + 0.002 * (width - 1))
    chooser.passed("lookup", 1, 0.0001)
    chooser.match = 3
    assert chooser.best("lookup") == Plan("lookup", 8)
    chooser.match = 1
    assert chooser.best("lookup").gamma == 1
    assert max(p.gamma for p in Chooser(modes, 2, 3, looked_up=("lookup",)).plans if p.mode == "lookup") == 3


def test_a_mode_that_cannot_win_is_not_tried_first():
    """Plain decoding first, then the modes with one proposer, whose passes time triforce's levels:
    with a drafter that costs more than a full pass (a CPU, the target drafting for itself), triforce's
    best case (every proposal accepted) still loses to plain decoding, so it waits for a probe."""
    chooser = Chooser(SUB_MODES["triforce"], gamma1=2, gamma2=3)
    for _ in range(Chooser.WARM_PASSES):
        assert chooser.choose() == Plan("autoregressive", 0)
        chooser.passed("verify", 1, 0.067)
    assert chooser.choose() == Plan("retrieval", 3)
    chooser.passed("middle", 1, 0.05)
    chooser.passed("verify", 4, 0.082)
    chooser.acceptance.record("middle->verify", 3, 1)
    assert chooser.choose() == Plan("speculative", 3)
    chooser.passed("draft", 1, 0.095)
    chooser.passed("verify", 4, 0.082)
    chooser.acceptance.record("draft->verify", 3, 0)
    # triforce at best: 2 drafts (0.19) and a middle pass per 3 middle tokens, 0.08 s each, then a
    # verification that keeps half its proposals: above plain decoding's 0.067 at every gamma
    assert min(chooser.bound(Plan("triforce", g)) for g in (1, 2, 3)) > 0.067
    assert chooser.choose().mode != "triforce"
    assert chooser.last_used["triforce"] == Chooser.WARM_PASSES + 2  # skipped then: a probe comes back to it


def simulate(chooser: Chooser, passes: int) -> list[Plan]:
    """Run the chooser's plans for `passes` full passes, each round taking what it predicts (its
    passes' share reported as untypical, so that costs and overheads stay as taught)."""
    plans = []
    for _ in range(passes):
        plan = chooser.choose()
        overhead = chooser.overhead.get(plan.mode, 0.0)
        seconds, _ = full_pass(plan.mode, plan.gamma, chooser.gamma1, chooser.costs.estimate, chooser.acceptance.rate,
                               overhead)
        chooser.passed("verify", plan.gamma + 1, seconds - overhead, typical=False)
        chooser.finished(plan.mode, seconds)
        plans.append(plan)
    return plans


def test_every_mode_is_tried_first_plain_decoding_then_by_levels():
    chooser = Chooser(SUB_MODES["triforce"], gamma1=2, gamma2=3)
    first = [chooser.choose() for _ in range(Chooser.WARM_PASSES + 3)]
    # nothing measured (no passes ran): every mode is tried, plain decoding first (twice: the first
    # pass after a prefill is a warm-up), triforce after the modes that time its levels, each at its
    # longest gamma
    assert first == [Plan("autoregressive", 0)] * Chooser.WARM_PASSES + [
        Plan("retrieval", 3), Plan("speculative", 3), Plan("triforce", 3)]


def test_a_restored_chooser_predicts_as_the_one_it_came_from_and_tries_nothing_first():
    """state() -> JSON -> restore(): the same predictions; no first tries (plain decoding's warm-up
    passes still come first), and a restored cost gives way to two fresh passes of its width."""
    learned = Chooser(SUB_MODES["triforce"], gamma1=2, gamma2=6)
    teach(learned, verify=lambda n: 1.0 + 0.001 * n, draft=0.005, middle=0.05,
          accept={"draft->middle": 0.75, "draft->verify": 0.25, "middle->verify": 0.75})
    learned.overhead["triforce"], learned.probe_loss["retrieval"] = 0.002, 0.01
    restored = Chooser(SUB_MODES["triforce"], gamma1=2, gamma2=6)
    restored.restore(json.loads(json.dumps(learned.state())))
    assert restored.summary() == learned.summary()  # JSON keeps a float exactly
    assert [restored.choose() for _ in range(Chooser.WARM_PASSES + 1)] == \
        [Plan("autoregressive", 0)] * Chooser.WARM_PASSES + [Plan("triforce", 6)]
    restored.costs.record("verify", 1, 3.0)  # a slow first pass after the load replaces the restored cost
    assert restored.costs.estimate("verify", 1) == 3.0
    restored.costs.record("verify", 1, 2.0)  # and the second replaces it: only then do passes average
    assert restored.costs.estimate("verify", 1) == 2.0
    restored.costs.record("verify", 1, 1.0)
    assert 1.0 < restored.costs.estimate("verify", 1) < 2.0


def test_a_restored_chooser_counts_the_time_since_each_mode_last_ran_before():
    """What a run kept says how long ago (passes, decoding seconds) each mode last ran there, so that
    short runs one after another probe a mode as one long run would: restored long idle, a mode
    behind the best is probed right after the warm-up; restored just run, it is not."""
    learned = Chooser(SUB_MODES["triforce"], gamma1=2, gamma2=6)
    teach(learned, verify=lambda n: 1.0 + 0.001 * n, draft=0.005, middle=0.05,
          accept={"draft->middle": 0.75, "draft->verify": 0.25, "middle->verify": 0.75})
    state = json.loads(json.dumps(learned.state()))
    assert set(state["idle"]) == set(SUB_MODES["triforce"])

    def after_warm_up(idle: dict) -> Plan:
        chooser = Chooser(SUB_MODES["triforce"], gamma1=2, gamma2=6)
        chooser.restore({**state, "idle": idle})
        for _ in range(Chooser.WARM_PASSES):
            chooser.choose()
        return chooser.choose()

    fresh = {m: [0, 0.0] for m in SUB_MODES["triforce"]}
    assert after_warm_up(fresh) == Plan("triforce", 6)
    assert after_warm_up({**fresh, "retrieval": [500, 1000.0]}) == Plan("retrieval", 6)
    assert after_warm_up({}) == Plan("triforce", 6)  # a state kept before idle times were: as just run


@pytest.mark.parametrize("state", [{}, {"costs": {"verify": {"x": 1.0}}, "acceptance": {}, "overhead": {}, "probe_loss": {}},
                                   {"costs": {}, "acceptance": {"middle->verify": [[1]]}, "overhead": {}, "probe_loss": {}},
                                   {"costs": [], "acceptance": {}, "overhead": {}, "probe_loss": {}}])
def test_malformed_state_raises_before_anything_changes(state):
    chooser = Chooser(SUB_MODES["triforce"], gamma1=2, gamma2=3)
    with pytest.raises((KeyError, ValueError, TypeError, AttributeError)):
        chooser.restore(state)
    assert not chooser.costs.mean and not chooser.acceptance.recent and all(v is None for v in chooser.last_used.values())


def test_probes_cost_a_bounded_share_and_a_mode_far_behind_is_probed_rarely():
    """A nearly flat full pass, proposals nearly always rejected: plain decoding is best, retrieval a
    little behind, speculative and triforce further behind by their overheads. Each mode is probed, at
    its longest gamma, as soon as what the probe is predicted to lose is at most PROBE_SHARE of the
    time since the mode last ran (a plain pass takes 1 s here): the further behind, the more rarely,
    and no mode's probes lose more than PROBE_SHARE of the run (plus one probe)."""
    chooser = Chooser(SUB_MODES["triforce"], gamma1=2, gamma2=3)
    for _ in range(Chooser.WARM_PASSES + 3):
        chooser.choose()
    teach(chooser, verify=lambda n: 1.0 + 0.05 * (n - 1),
          accept={"draft->middle": 0.0, "draft->verify": 0.0, "middle->verify": 0.0})
    chooser.overhead.update(speculative=0.5, triforce=2.0)
    best = chooser.best()
    assert best == Plan("autoregressive", 0)
    plans = simulate(chooser, 600)
    assert plans.count(best) > 0.8 * len(plans)
    probes = [p for p in plans if p != best]
    assert set(probes) == {chooser.longest(m) for m in ("retrieval", "speculative", "triforce")}
    gaps, losses = {}, {}
    for mode in ("retrieval", "speculative", "triforce"):
        at = [i for i, p in enumerate(plans) if p.mode == mode]
        gaps[mode] = [b - a for a, b in zip(at, at[1:])]
        losses[mode] = loss = chooser.loss(chooser.longest(mode), best)
        assert len(at) * loss <= Chooser.PROBE_SHARE * chooser.elapsed + loss
        # due after loss / PROBE_SHARE seconds of 1 s passes (a pass taken by another probe delays it)
        assert max(gaps[mode]) <= max(Chooser.PROBE_MIN, math.ceil(loss / Chooser.PROBE_SHARE)) + 2, (mode, gaps)
    assert 0 < losses["retrieval"] < losses["speculative"] < losses["triforce"]
    assert max(gaps["retrieval"]) < min(gaps["speculative"]) and max(gaps["speculative"]) < min(gaps["triforce"])


def test_a_choice_prices_each_plan_once_and_chooses_what_pricing_afresh_chooses(monkeypatch):
    """Inside one choice nothing the prices read changes, so each plan is priced once (a choice priced
    the same plans over and over: 0.13 ms a pass of host time). The plans chosen over a run of probes
    and switches are those of a chooser that prices every time."""
    def run(memo: bool) -> tuple[list[Plan], list[int]]:
        chooser = Chooser(SUB_MODES["triforce"], gamma1=2, gamma2=6)
        for _ in range(Chooser.WARM_PASSES + 3):
            chooser.choose()
        teach(chooser, verify=lambda n: 1.0 + 0.05 * (n - 1),
              accept={"draft->middle": 0.5, "draft->verify": 0.3, "middle->verify": 0.7})
        chooser.overhead.update(speculative=0.05, triforce=0.2)
        priced, per_choice = [0], []
        real_predict, real_choose = Chooser._predict, Chooser._choose

        def counted(self, plan):
            priced[0] += 1
            return real_predict(self, plan)

        def choose(self):
            if not memo:
                self._priced = None
            priced[0] = 0
            plan = real_choose(self)
            per_choice.append(priced[0])
            return plan

        monkeypatch.setattr(Chooser, "_predict", counted)
        monkeypatch.setattr(Chooser, "_choose", choose)
        plans = simulate(chooser, 300)
        monkeypatch.undo()
        return plans, per_choice

    (fresh, fresh_prices), (memo, memo_prices) = run(False), run(True)
    assert memo == fresh and len(set(memo)) > 2  # probes and the best plan, the same passes
    plans = len(Chooser(SUB_MODES["triforce"], gamma1=2, gamma2=6).plans)
    assert max(memo_prices) <= plans < max(fresh_prices)


def test_a_probe_that_loses_more_than_predicted_makes_the_next_one_later():
    """What a probe's round really lost (a drafter that sat out catches up first, which the per-pass
    prediction misses) spaces that mode's next probe, when it exceeds the prediction."""
    def gaps(extra: float) -> list[int]:
        chooser = Chooser(SUB_MODES["speculative"], gamma1=1, gamma2=3)
        for _ in range(Chooser.WARM_PASSES + 1):
            chooser.choose()
        teach(chooser, verify=lambda n: 1.0 + 0.05 * (n - 1), accept={"draft->verify": 0.0})
        chooser.overhead["speculative"] = 0.1
        at = []
        for i in range(400):
            plan = chooser.choose()
            seconds, tokens = full_pass(plan.mode, plan.gamma, 1, chooser.costs.estimate, chooser.acceptance.rate,
                                        chooser.overhead.get(plan.mode, 0.0))
            if plan.mode == "speculative":
                at.append(i)
                seconds += extra
            chooser.passed("verify", plan.gamma + 1, seconds, typical=False)
            chooser.finished(plan.mode, seconds, 1)
        return [b - a for a, b in zip(at, at[1:])]

    predicted, costly = gaps(0.0), gaps(1.0)
    assert len(predicted) > len(costly) >= 1
    # over 1 s lost per probe, in passes of about 1 s: due after 1 / PROBE_SHARE passes (or PROBE_MAX)
    assert min(costly) >= 0.9 * min(Chooser.PROBE_MAX, 1.0 / Chooser.PROBE_SHARE)


def test_a_mode_whose_estimate_is_far_off_still_comes_back():
    """However far behind a mode is predicted to be, it runs again within PROBE_MAX passes."""
    chooser = Chooser(SUB_MODES["retrieval"], gamma1=1, gamma2=2)
    for _ in range(Chooser.WARM_PASSES + 1):
        chooser.choose()
    teach(chooser, verify=lambda n: 0.5 * n, accept={"middle->verify": 0.0})
    chooser.overhead["retrieval"] = 100.0
    plans = simulate(chooser, 2 * Chooser.PROBE_MAX + 2)
    at = [i for i, p in enumerate(plans) if p.mode == "retrieval"]
    assert [b - a for a, b in zip(at, at[1:])] == [Chooser.PROBE_MAX + 1] and at[0] < Chooser.PROBE_MAX


def test_what_passes_leave_out_counts_against_the_mode():
    """A round that takes longer than its passes (cache upkeep, sampling) makes its mode dearer."""
    chooser = Chooser(SUB_MODES["retrieval"], gamma1=1, gamma2=1)
    teach(chooser, verify=lambda n: 1.0, middle=0.01, accept={"middle->verify": 0.5})
    assert chooser.choose() == Plan("retrieval", 1)  # (0.01 + 1) / 1.5 s per token against 1.0
    chooser.passed("middle", 1, 0.01)
    chooser.passed("verify", 2, 1.0)
    chooser.finished("retrieval", 1.01 + 0.9)  # 0.9 s outside the passes
    assert chooser.overhead["retrieval"] == pytest.approx(0.9)
    assert chooser.predict(Plan("retrieval", 1)) == pytest.approx((0.01 + 1.0 + 0.9) / 1.5)
    assert chooser.choose() == Plan("autoregressive", 0)


def test_the_first_round_after_a_prefill_is_no_overhead_sample():
    """The first round pays one-time costs (threads starting, state built lazily): counted in it,
    they kept plain decoding priced at three times its cost for a whole 4K run."""
    chooser = Chooser(SUB_MODES["retrieval"], gamma1=1, gamma2=1)
    assert chooser.choose() == Plan("autoregressive", 0)
    chooser.passed("verify", 1, 0.017)
    chooser.finished("autoregressive", 0.034)
    assert "autoregressive" not in chooser.overhead and chooser.elapsed == 0.034
    assert chooser.choose() == Plan("autoregressive", 0)
    chooser.passed("verify", 1, 0.012)
    chooser.finished("autoregressive", 0.013)
    assert chooser.overhead["autoregressive"] == pytest.approx(0.001)
    assert chooser.costs.estimate("verify", 1) == 0.012  # the second pass replaced the warm-up


def test_a_plan_chosen_ahead_is_finished_after_the_pass_in_flight():
    """Plain passes queued ahead (engine._queued_tokens): the next plan is chosen before the last
    pass's round finishes. Each round is finished in the order chosen, with the passes timed since
    the one before it finished; a probe chosen ahead is judged when its own round finishes; a choice
    whose pass was forgotten (queued past a stop) is dropped by the next choice made with nothing
    in flight."""
    chooser = Chooser(SUB_MODES["retrieval"], gamma1=1, gamma2=2)
    plain = Plan("autoregressive", 0)
    assert chooser.choose() == plain and chooser.choose(ahead=True) == plain
    chooser.passed("verify", 1, 0.010)
    chooser.finished("autoregressive", 0.030)  # the first round after a prefill: no overhead sample
    # retrieval, never tried, is chosen while the second plain pass is in flight: a first try
    assert chooser.choose(ahead=True).mode == "retrieval"
    chooser.passed("verify", 1, 0.012)
    chooser.finished("autoregressive", 0.013)  # its own 12 ms, not the first pass's too; not the probe
    assert chooser.overhead["autoregressive"] == pytest.approx(0.001) and chooser.probe_loss == {}
    chooser.passed("middle", 1, 0.004)
    chooser.passed("verify", 2, 0.013)
    chooser.verified("middle->verify", 1, 0)
    chooser.finished("retrieval", 0.040, 1)  # judged against plain decoding's 13 ms a token: lost
    assert chooser.probe_loss["retrieval"] > 0 and chooser.overhead["retrieval"] == pytest.approx(0.023)
    # a plain pass chosen ahead, then forgotten (a stop): the next choice is finished by itself
    chooser.choose()
    chooser.choose(ahead=True)
    chooser.choose()
    chooser.passed("verify", 1, 0.012)
    chooser.finished("autoregressive", 0.014)
    assert chooser.overhead["autoregressive"] == pytest.approx(0.9 * 0.001 + 0.1 * 0.002)
    assert not chooser._open


def test_a_pass_that_captures_a_cuda_graph_is_not_a_cost_sample(tmp_path):
    """Level.run times every decode pass for the chooser; one in which the model captured a CUDA
    graph (a one-time cost, hundreds of times a replay) counts in its round, not in the level's
    costs, or the moving average would keep a cheap graphed level looking dear for dozens of passes."""
    from triforce.speculative.caches import FullCache
    from triforce.speculative.levels import Level, PassClock, Sequence
    from triforce.speculative.stats import Stats

    save_tiny(tmp_path, seed=2, vocab=48)
    model = load_model(tmp_path, torch.float32, "cpu")

    class Capturing:  # stands in for a GraphedModel whose first call captures
        captures = 0

        def __init__(self):
            self.embed = model.embed

        def __call__(self, tokens, cache, last_only=False):
            self.captures = 1
            return model(tokens, cache, last_only)

    stats = Stats()
    stats.phase = "decode"
    cpu = torch.device("cpu")
    seq = Sequence(8, cpu)
    seq.put(0, [3, 4, 5, 6])
    level = Level("verify", Capturing(), FullCache(model.kv_shape(), 64), stats, PassClock(cpu))
    seq.levels = [level]
    level.meter = chooser = Chooser(SUB_MODES["autoregressive"], gamma1=1, gamma2=1)
    level.run(seq, 3, 1)  # captures
    assert chooser.pass_seconds == 0  # timed passes are reported once the round's tokens are read
    level.report()
    first = chooser.pass_seconds
    assert not chooser.costs.known("verify") and first > 0  # in the round's time, not a cost sample
    level.run(seq, 4, 1)  # replays
    level.report()
    assert chooser.costs.mean["verify"] == {1: pytest.approx(chooser.pass_seconds - first)}


def test_a_mode_with_a_drafter_is_switched_to_only_for_a_clear_gain():
    """Switching to a drafting mode makes its drafter catch up, so it must promise SWITCH_MARGIN less
    per token; a switch to a mode without a drafter follows the predictions as they are."""
    chooser = Chooser(SUB_MODES["speculative"], gamma1=1, gamma2=1)
    teach(chooser, verify=lambda n: 1.0, draft=0.01, accept={"draft->verify": 0.5})
    assert chooser.choose() == Plan("speculative", 1)  # 0.67 s per token against 1.0
    chooser.overhead["speculative"] = 0.46  # now (1.01 + 0.46) / 1.5 = 0.98: within the margin of 1.0
    assert chooser.choose() == Plan("speculative", 1)
    chooser.overhead["speculative"] = 0.9  # (1.01 + 0.9) / 1.5 = 1.27
    assert chooser.choose() == Plan("autoregressive", 0)
    chooser.overhead["speculative"] = 0.46  # 0.98 against 1.0 again: autoregressive stays
    assert chooser.choose() == Plan("autoregressive", 0)

    chooser = Chooser(SUB_MODES["retrieval"], gamma1=1, gamma2=1)
    teach(chooser, verify=lambda n: 1.0, middle=0.01, accept={"middle->verify": 0.5})
    assert chooser.choose() == Plan("retrieval", 1)
    chooser.overhead["retrieval"] = 0.52  # (1.01 + 0.52) / 1.5 = 1.02
    assert chooser.choose() == Plan("autoregressive", 0)
    chooser.overhead["retrieval"] = 0.46  # 0.98 against 1.0
    assert chooser.choose() == Plan("retrieval", 1)


def test_agree_makes_every_rank_run_rank_0s_plan():
    rank0 = Chooser(SUB_MODES["triforce"], 2, 3)
    rank1 = Chooser(SUB_MODES["triforce"], 2, 3, agree=lambda index: rank0.plans.index(Plan("retrieval", 2)))
    assert rank1.choose() == Plan("retrieval", 2) and rank1.last_used["retrieval"] == 1


# ------------------------------------------------------------------------------ lossless


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("adaptive")
    save_tiny(folder, seed=11, vocab=48, layers=2)
    target, drafter = load_model(folder, torch.float64), load_model(folder, torch.float64)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.02 * torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(5)))
    return target, drafter


def scramble(monkeypatch, seed: int) -> None:
    """Every chooser picks a random plan per pass: all orders of switching get exercised."""
    rng = random.Random(seed)
    monkeypatch.setattr(Chooser, "_choose", lambda self: rng.choice(self.plans))


@pytest.mark.parametrize("mode", ["triforce", "retrieval", "speculative"])
@pytest.mark.parametrize("scrambled", [True, False])
def test_greedy_identical_whatever_the_plans(pair, monkeypatch, mode, scrambled):
    target, drafter = pair
    ids = torch.randint(0, 48, (130,), generator=torch.Generator().manual_seed(3)).tolist()
    cfg = GenerationConfig(max_new_tokens=300, budget=48, chunk_size=8, gamma1=3, gamma2=5,
                           draft_window=16, sink_tokens=4, adaptive=True)
    reference = generate_ids(Models(target, None), ids, "autoregressive", cfg)
    if scrambled:
        scramble(monkeypatch, seed=len(mode))
    else:  # the chooser's own plans, every mode coming back within 16 passes (its timings may skip one)
        monkeypatch.setattr(Chooser, "PROBE_MAX", 16)
    result = generate_ids(Models(target, drafter), ids, mode, cfg)
    assert result.tokens == reference.tokens
    # every mode ran (exploration, probes), lookups in the drafter's place included
    assert set(result.stats.modes) == set(adaptive_modes(mode, lookup=True))
    assert sum(result.stats.modes.values()) == result.stats.full_passes


def by_history(monkeypatch) -> None:
    """Every chooser picks its plan from what was accepted so far: a choice that depends on the
    sampled tokens themselves, as the real chooser's does."""
    def choose(self):
        seen = sum(a * 7 + f for edge in sorted(self.acceptance.recent) for a, f in self.acceptance.recent[edge])
        return self.plans[(seen + self.passes) % len(self.plans)]
    monkeypatch.setattr(Chooser, "_choose", choose)


def plain_or_random(monkeypatch, seed: int) -> None:
    """Every chooser picks plain decoding one pass in two, else a random plan: runs of plain passes,
    queued ahead where that is on, between rounds of every mode."""
    rng = random.Random(seed)
    monkeypatch.setattr(Chooser, "_choose", lambda self: Plan("autoregressive", 0) if rng.random() < 0.5
                        else rng.choice(self.plans))


@pytest.mark.parametrize("plans", ["random", "by history", "plain or random, queued ahead"])
def test_sampled_distribution_is_exact_whatever_the_plans(models, monkeypatch, plans):  # noqa: F811
    """As test_sampling.py: SAMPLES seeds, the joint law of tokens 2 and 3 against enumeration, with
    the plan of each pass drawn at random (a different stream from the sampler's), or chosen from
    the acceptance so far (so the plan of the pass that draws token 3 depends on token 2's), or
    plain decoding queued ahead (engine._queued_tokens: a plan chosen before the last token is read)
    between random plans."""
    target, drafter = models
    {"random": lambda: scramble(monkeypatch, seed=0), "by history": lambda: by_history(monkeypatch),
     "plain or random, queued ahead": lambda: plain_or_random(monkeypatch, seed=0)}[plans]()
    cfg = {**SAMPLING_SETTINGS, "adaptive": True, "queue_ahead": plans.endswith("queued ahead")}
    counts = torch.zeros(8, 8, dtype=torch.float64)
    for seed in range(SAMPLES):
        gen = Generator(Models(target, drafter), GenerationConfig(**cfg, seed=seed), "triforce",
                        max_len=len(SAMPLING_PROMPT) + 8)
        assert (gen.reads is not None) == cfg["queue_ahead"]
        gen.prefill(SAMPLING_PROMPT)
        tokens = gen.generate()
        counts[tokens[1], tokens[2]] += 1
    exact = exact_joint(target, Sampler(cfg["temperature"]))
    rejects, stat, critical = chi_square_rejects(counts, exact)
    assert not rejects, f"chi-square {stat:.1f} > {critical:.1f}: adaptive does not sample the target's distribution"


def test_a_chat_generator_keeps_what_it_learned(pair):
    """The chooser lives with the generator: a second turn starts from the first turn's figures."""
    target, drafter = pair
    ids = torch.randint(0, 48, (130,), generator=torch.Generator().manual_seed(4)).tolist()
    cfg = GenerationConfig(max_new_tokens=20, budget=48, chunk_size=8, adaptive=True)
    gen = Generator(Models(target, drafter), cfg, "triforce", max_len=400)
    gen.prefill(ids)
    gen.generate()
    chooser, before = gen.chooser, gen.chooser.passes
    # which modes the first turn tried depends on its timings (one whose best case loses is skipped)
    learned = {m for m in SUB_MODES["triforce"] if chooser.known(m)}
    assert "autoregressive" in learned
    gen.extend([5, 6, 7])
    gen.reset_stats()
    gen.generate()
    assert gen.chooser is chooser and chooser.passes > before and all(chooser.known(m) for m in learned)


def test_a_resumed_generator_learns_afresh_unless_asked_to_keep_what_it_learned(pair):
    """resume() starts a chooser afresh, as a new process would; with learned=True it keeps its
    figures (a benchmark's steady state: bench.bench --learned), and the tokens stay the target's."""
    target, drafter = pair
    ids = torch.randint(0, 48, (130,), generator=torch.Generator().manual_seed(4)).tolist()
    cfg = GenerationConfig(max_new_tokens=40, budget=48, chunk_size=8, adaptive=True)
    reference = generate_ids(Models(target, None), ids, "autoregressive", cfg).tokens
    gen = Generator(Models(target, drafter), cfg, "triforce", max_len=400)
    gen.prefill(ids)
    start = gen.snapshot()
    assert gen.generate() == reference
    chooser, passes = gen.chooser, gen.chooser.passes
    gen.resume(start.prompt, start.queries, start.first, learned=True)
    assert gen.chooser is chooser and chooser.passes == passes and gen.stats.full_passes == 0
    assert gen.generate() == reference and chooser.passes > passes
    gen.resume(start.prompt, start.queries, start.first)
    assert gen.chooser is not chooser and gen.chooser.passes == 0
    assert gen.generate() == reference


def test_generate_reports_the_passes_per_mode(tiny_folder):
    prompt = " ".join(f"t{i % 60 + 3}" for i in range(200))
    args = ["--model", tiny_folder, "--draft", "self", "--prompt", prompt, "--max-new-tokens", 40,
            "--temperature", 0, "--budget", 64, "--chunk-size", 8]
    adaptive = run("generate", *args, "--json")
    fixed = run("generate", *args, "--json", "--no-adaptive")
    table = run("generate", *args)
    for proc in (adaptive, fixed, table):
        assert proc.returncode == 0, proc.stderr
    a, f = json.loads(adaptive.stdout), json.loads(fixed.stdout)
    assert a["tokens"] == f["tokens"]  # greedy: the same tokens whichever passes ran
    assert a["adaptive"] and list(a["modes"])[:2] == ["autoregressive", "retrieval"]
    assert set(a["modes"]) <= set(adaptive_modes("triforce", lookup=True)) and sum(a["modes"].values()) == a["full_passes"]
    assert not f["adaptive"] and f["modes"] == {}
    assert "adaptive over triforce's levels" in table.stdout and "full-cache passes per mode" in table.stdout
    assert "vs plain decoding" in table.stdout
    assert "predicted ms per token" in table.stdout and set(a["modes"]) <= set(a["estimates"])


def test_a_drafter_that_sat_out_feeds_only_its_last_tokens_but_a_new_turn_whole(pair, monkeypatch):
    """After passes of another mode the drafter catches up on engine.DRAFT_CATCH_UP tokens, skipping
    older ones as its prefill skips all but its window (the output stays the target's); a chat turn
    added by extend() is fed whole: its text is what the drafter most needs."""
    from triforce.speculative import engine
    from triforce.speculative.adaptive import Plan

    target, drafter = pair
    ids = torch.randint(0, 48, (130,), generator=torch.Generator().manual_seed(4)).tolist()
    cfg = GenerationConfig(max_new_tokens=60, budget=48, chunk_size=8, gamma1=3, gamma2=5,
                           draft_window=16, sink_tokens=4, adaptive=True)
    reference = generate_ids(Models(target, None), ids, "autoregressive", cfg)
    # 20 passes of plain decoding (the drafter sits out), then speculation only
    monkeypatch.setattr(Chooser, "_choose", lambda self: Plan("autoregressive", 0) if self.passes < 20
                        else Plan("speculative", 5))
    gen = Generator(Models(target, drafter), cfg, "speculative", max_len=len(ids) + 200)
    fed = []
    feed = gen.drafter.feed
    monkeypatch.setattr(gen.drafter, "feed", lambda tokens, *a, **k: (fed.append(len(tokens)), feed(tokens, *a, **k))[1])
    gen.prefill(ids)
    fed.clear()  # the prefill's window
    assert gen.generate() == reference.tokens
    assert max(fed) == engine.DRAFT_CATCH_UP  # 20 missed tokens: the last 8 fed
    turn = torch.randint(0, 48, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    gen.extend(turn)
    fed.clear()
    gen.generate(max_new_tokens=10)
    assert fed[0] >= len(turn)  # the whole turn (and the answer's last token before it)


def test_a_few_verifications_are_priced_at_one_rate():
    """Below Acceptance.COUNTED verifications one rate prices every position: one first try that
    failed at its first proposal says little of the positions after it."""
    a = Acceptance()
    a.record("lookup->verify", 3, 0)
    assert a.expected("lookup->verify", 1) == pytest.approx(tokens_per_verification(a.rate("lookup->verify"), 1))
    for _ in range(Acceptance.COUNTED - 1):
        a.record("lookup->verify", 3, 3)
    assert a.expected("lookup->verify", 3) != pytest.approx(tokens_per_verification(a.rate("lookup->verify"), 3))


def test_a_probe_that_beats_the_best_plan_runs_again():
    """A probe that made its tokens as cheaply as the best plan is run once more on the next pass (its
    one verification barely moves what its edge remembers); one that lost is not."""
    chooser = Chooser(SUB_MODES["retrieval"], gamma1=2, gamma2=3)
    teach(chooser, verify=lambda n: 0.010 + 0.001 * n, middle=0.002, accept={"middle->verify": 0.1})
    assert chooser.choose() == Plan("autoregressive", 0)
    chooser.passed("verify", 1, 0.011)
    chooser.finished("autoregressive", 0.011, 1)
    chooser.last_used["retrieval"] = -100  # long unprobed: its probe is due
    chooser.elapsed = 10.0
    assert chooser.choose() == Plan("retrieval", 3)
    chooser.finished("retrieval", 0.020, 4)  # 4 tokens for 20 ms: 5 ms a token, the best plan's 11
    assert chooser.choose() == Plan("retrieval", 3)  # again
    chooser.finished("retrieval", 0.030, 1)  # lost this time
    assert chooser.choose() == Plan("autoregressive", 0)
