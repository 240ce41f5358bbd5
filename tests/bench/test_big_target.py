"""bench.big_target: every mode measured through the engine at a target's shape on random weights, and
each mode's tokens per second projected from those costs by the chooser's arithmetic at given
acceptance rates (on CPU, rehearsed at tiny shapes)."""
import json
import subprocess
import sys

import pytest
import torch

from bench import big_target
from triforce.speculative.adaptive import Chooser
from triforce.speculative.pricing import tokens_per_verification


def test_rehearsal_measures_every_level_and_projects_every_mode(tmp_path):
    out = tmp_path / "big.json"
    done = subprocess.run([sys.executable, "-m", "bench.big_target", "--rehearse", "--new-tokens", "12",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(out.read_text())
    runs = figures["measured"]["runs"]
    assert list(runs) == list(big_target.MODES)
    levels = {"autoregressive": {"verify"}, "speculative": {"draft", "verify"}, "retrieval": {"middle", "verify"}}
    for mode, run in runs.items():
        assert run["tokens"] == 12 and run["full_passes"] >= 1 and run["ms_per_token"] > 0
        assert levels.get(mode, {"verify"}) <= set(run["ms_per_pass"])
        # each run priced at the acceptance it saw, beside what it measured: the projection's check
        assert run["predicted_ms_per_token"] > 0
        edges = {"speculative": {"draft->verify"}, "retrieval": {"middle->verify"},
                 "triforce": {"draft->middle", "middle->verify"}}.get(mode, set())
        assert set(run["rates"]) == edges
    costs = figures["measured"]["pass_costs_ms"]
    assert {"verify", "middle", "draft"} <= set(costs) and "1" in costs["verify"]
    rows = figures["projected (acceptance given, costs measured)"]
    assert len(rows) == 2 * len(big_target.MIDDLE_RATES) * len(big_target.DRAFT_RATES)
    for row in rows:
        assert set(big_target.MODES) <= set(row)
        assert all(row[m]["gamma"] <= row["gamma_cap"] for m in big_target.MODES)
    assert "PROJECTED" in done.stdout and "MEASURED" in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_one_line_naming_the_rehearsal():
    done = subprocess.run([sys.executable, "-m", "bench.big_target"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "--rehearse" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def measured_meter() -> Chooser:
    """A chooser that measured: a full pass 300 ms at any width, a middle pass 4 ms, a drafter pass 1 ms."""
    meter = Chooser(big_target.MODES, 4, 16)
    for width in (1, 5, 17):
        meter.costs.record("verify", width, 0.300)
        meter.costs.record("verify", width, 0.300)
    for level, seconds in (("middle", 0.004), ("draft", 0.001)):
        for width in (1, 5):
            meter.costs.record(level, width, seconds)
            meter.costs.record(level, width, seconds)
    return meter


def test_projection_is_the_choosers_arithmetic_at_the_given_rates():
    meter = measured_meter()
    projected = big_target.project(meter, {m: 0.0 for m in big_target.MODES}, middle=0.9, draft=0.6, cap=16)
    assert projected["autoregressive"] == (pytest.approx(300.0), 0)
    ms, gamma = projected["retrieval"]
    by_gamma = {g: 1e3 * (g * 0.004 + 0.300) / tokens_per_verification(0.9, g) for g in range(1, 17)}
    assert gamma == min(by_gamma, key=by_gamma.get) and ms == pytest.approx(by_gamma[gamma])
    # better acceptance is never dearer; a cap never lets a longer run in
    assert big_target.project(meter, {}, middle=0.95, draft=0.6, cap=16)["retrieval"][0] < ms
    assert big_target.project(meter, {}, middle=0.9, draft=0.6, cap=6)["retrieval"][1] <= 6
    # the meter's own measured acceptance is left as it was
    assert not meter.acceptance.known("middle->verify")


def test_a_rounds_overhead_is_priced_per_full_pass():
    meter = measured_meter()
    without = big_target.project(meter, {}, middle=0.9, draft=0.6, cap=6)["retrieval"]
    overhead = big_target.project(meter, {"retrieval": 0.010}, middle=0.9, draft=0.6, cap=6)["retrieval"]
    gamma = overhead[1]
    assert overhead[0] == pytest.approx(1e3 * (gamma * 0.004 + 0.310) / tokens_per_verification(0.9, gamma))
    assert overhead[0] > without[0]


def test_each_run_is_checked_at_its_own_plan_and_acceptance():
    meter = measured_meter()
    seen = {mode: big_target.WholeRun() for mode in ("autoregressive", "retrieval", "speculative")}
    for accepted in (16, 0) * 8:  # all or nothing: 17 tokens, then 1
        seen["retrieval"].record("middle->verify", 16, accepted)
    # speculative saw no verification: it is not priced
    predicted = big_target.check(meter, {"retrieval": 0.001}, seen, {"autoregressive": 0, "retrieval": 16,
                                                                     "speculative": 4})
    assert predicted["autoregressive"] == pytest.approx(300.0)
    tokens = seen["retrieval"].expected("middle->verify", 16)
    assert 8.5 < tokens < 9.2  # what came: 9 on average; one rate (129 of 138) would expect 10.5
    assert predicted["retrieval"] == pytest.approx(1e3 * (16 * 0.004 + 0.301) / tokens)
    assert "speculative" not in predicted


def test_seen_rates_are_successes_over_trials_without_the_prior():
    from triforce.speculative.pricing import Acceptance

    seen = Acceptance()
    seen.record("middle->verify", 16, 16)  # all stood: no failure
    seen.record("middle->verify", 16, 4)  # 4 stood, the fifth failed
    assert big_target.seen_rates(seen) == {"middle->verify": 20 / 21}
