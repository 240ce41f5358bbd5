"""The prefill's progress in a log file: no live bar there, so plain lines say how far it is."""
import io

from rich.console import Console

from scripts import common


def logged(monkeypatch, every: float, done: int = 0) -> list[str]:
    monkeypatch.setattr(common, "PROGRESS_LOG_SECONDS", every)
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=120)
    progress, advance = common.prefill_progress(console, 1000, done=done)
    with progress:
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
