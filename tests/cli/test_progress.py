"""The prefill's progress: plain lines in a log file, and a time left that expects the slowdown of a
long prompt (per-token cost a + b * context)."""
import io

import pytest
from rich.console import Console

from triforce.cli import progress as prefill
from triforce.cli.progress import PrefillClock


def logged(monkeypatch, every: float, done: int = 0) -> list[str]:
    monkeypatch.setattr(prefill, "PROGRESS_LOG_SECONDS", every)
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=120)
    bar, advance = prefill.prefill_progress(console, 1000, done=done)
    with bar:
        for _ in range((1000 - done) // 250):
            advance(250)
    return out.getvalue().splitlines()


def test_a_log_file_gets_a_line_per_period(monkeypatch):
    lines = logged(monkeypatch, every=0.0)
    assert lines[0] == "prefill: 1,000 tokens ..."
    assert [line.split(" tokens")[0] for line in lines[1:4]] == [
        "prefill: 250 of 1,000", "prefill: 500 of 1,000", "prefill: 750 of 1,000"]
    assert "(25%)" in lines[1] and not any("1,000 of 1,000" in line for line in lines[1:4])


def test_resumed_tokens_count_toward_the_progress(monkeypatch):
    lines = logged(monkeypatch, every=0.0, done=500)
    assert lines[0] == "prefill: 500 tokens after 500 resumed ..."
    assert lines[1].startswith("prefill: 750 of 1,000 tokens (75%)")


def test_no_line_before_the_period(monkeypatch):
    lines = logged(monkeypatch, every=3600.0)
    assert not any(" of 1,000 tokens (" in line for line in lines)


def clock_with(pieces, done=0) -> PrefillClock:
    clock = PrefillClock(done)
    for start, end, seconds in pieces:
        assert start == clock.at
        clock.pieces.append((start, end, seconds))
        clock.at = end
    return clock


def cost(a, b, start, end):
    return a * (end - start) + b * (end * end - start * start) / 2


@pytest.mark.parametrize("a,b,done", [(0.01, 2e-6, 0), (0.02, 0.0, 0), (0.0, 5e-7, 8192), (0.005, 1e-6, 36864)])
def test_the_clock_recovers_a_cost_that_grows_with_context(a, b, done):
    starts = range(done, done + 5 * 4096, 4096)
    clock = clock_with([(s, s + 4096, cost(a, b, s, s + 4096)) for s in starts], done)
    assert clock.seconds_left(105_563) == pytest.approx(cost(a, b, clock.at, 105_563), rel=1e-6)


def test_a_rate_alone_would_promise_too_little():
    """Halfway through a book whose cost grows with context, the rate so far underestimates."""
    a, b = 0.01, 2e-6
    clock = clock_with([(s, s + 4096, cost(a, b, s, s + 4096)) for s in range(0, 53248, 4096)])
    rate_based = (105_563 - clock.at) * sum(p[2] for p in clock.pieces) / clock.at
    assert clock.seconds_left(105_563) > 1.5 * rate_based


def test_one_piece_or_noise_falls_back_to_the_rate():
    assert clock_with([(0, 1000, 10.0)]).seconds_left(3000) == pytest.approx(20.0)
    # a later piece faster than an earlier one (a quieter minute): no negative slope
    clock = clock_with([(0, 1000, 20.0), (1000, 2000, 10.0)])
    assert clock.seconds_left(3000) == pytest.approx(1000 * 30.0 / 2000)
    assert clock_with([(0, 1000, 10.0)]).seconds_left(1000) == 0.0
    assert PrefillClock().seconds_left(10) is None
