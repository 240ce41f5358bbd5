"""The prefill's progress: a rich bar at a terminal, a line a minute in a log file, and a time left
that knows a long prompt slows down as it goes (every token attends to all the tokens before it)."""
from __future__ import annotations

import time

from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn
from rich.text import Text

PROGRESS_LOG_SECONDS = 60.0


class PrefillClock:
    """Seconds left in a prefill whose cost per token is a + b * (tokens before it).

    Fitted by least squares to this run's pieces: a piece from context s to e costs
    a * (e - s) + b * (e^2 - s^2) / 2. A rate alone (rich's estimate) says "33 min left" halfway
    through a whole book on a CPU when twice that is left: the second half attends to more."""

    def __init__(self, done: int = 0):
        self.at, self.since = done, time.monotonic()
        self.pieces: list[tuple[int, int, float]] = []  # (start, end, seconds)

    def advance(self, n: int) -> None:
        now = time.monotonic()
        self.pieces.append((self.at, self.at + n, now - self.since))
        self.at, self.since = self.at + n, now

    def seconds_left(self, total: int) -> float | None:
        if not self.pieces or self.at >= total:
            return None if not self.pieces else 0.0
        a, b = self._fit()
        return a * (total - self.at) + b * (total ** 2 - self.at ** 2) / 2

    def _fit(self) -> tuple[float, float]:
        rows = [(e - s, (e * e - s * s) / 2, t) for s, e, t in self.pieces]
        linear = sum(y * x for x, _, y in rows) / sum(x * x for x, _, _ in rows)
        if len(rows) < 2:
            return linear, 0.0  # one piece cannot tell the parts apart: the rate so far
        sxx = sum(x * x for x, _, _ in rows)
        szz = sum(z * z for _, z, _ in rows)
        sxz = sum(x * z for x, z, _ in rows)
        sxy = sum(x * y for x, _, y in rows)
        szy = sum(z * y for _, z, y in rows)
        det = sxx * szz - sxz * sxz
        if det <= 1e-9 * sxx * szz:  # pieces alike in context: no slope to see
            return linear, 0.0
        a, b = (sxy * szz - szy * sxz) / det, (szy * sxx - sxy * sxz) / det
        if b < 0:  # noise: a cost that falls with context is not real
            return linear, 0.0
        if a < 0:
            return 0.0, szy / szz
        return a, b


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


class _Rate(ProgressColumn):
    def render(self, task):
        speed = task.finished_speed or task.speed
        return Text(f"{speed:,.0f} tok/s" if speed else "")


class _TimeLeft(ProgressColumn):
    def __init__(self, clock: PrefillClock):
        super().__init__()
        self.clock = clock

    def render(self, task):
        left = None if task.finished else self.clock.seconds_left(int(task.total))
        return Text(f"{minutes(left)} left" if left is not None else "", style="progress.remaining")


def prefill_progress(console, total: int, label: str = "prefill", done: int = 0):
    """A rich progress bar (tokens done / total, tokens/s, time left); returns (progress, advance).
    `done`: tokens already there (resumed from a checkpoint), shown but not counted in the rate."""
    clock = PrefillClock(done)
    progress = Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), _Rate(),
                        _TimeLeft(clock), console=console, transient=False,
                        speed_estimate_period=300)  # a piece can take minutes at long context
    task = progress.add_task(label, total=total, completed=done)

    def advance(n: int) -> None:
        clock.advance(n)
        progress.advance(task, n)

    if console.is_terminal:
        return progress, advance
    # A log file gets no live bar, only the final one; a whole book takes an hour on a CPU, so the
    # log says when the prefill starts and then, once a minute, how far it is and how long is left.
    console.print(f"{label}: {total - done:,} tokens ..." if not done else
                  f"{label}: {total - done:,} tokens after {done:,} resumed ...")
    logged = [time.monotonic()]

    def advance_and_log(n: int) -> None:
        advance(n)
        now, state = time.monotonic(), progress.tasks[0]
        if now - logged[0] >= PROGRESS_LOG_SECONDS and not state.finished:
            logged[0] = now
            left = clock.seconds_left(total)
            console.print(f"{label}: {state.completed:,.0f} of {total:,} tokens ({state.percentage:.0f}%)"
                          + (f", {state.speed:,.0f} tok/s" if state.speed else "")
                          + (f", about {minutes(left)} left" if left is not None else ""))
    return progress, advance_and_log
