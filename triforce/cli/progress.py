"""The prefill's progress: a rich bar at a terminal, a line a minute in a log file, and a time left
that knows a long prompt slows down as it goes (every token attends to all the tokens before it).

The bar moves within a piece too: `watch_layers` hooks the model's decoder layers, so a 4,096-token
piece that takes minutes at long context advances a layer's share at a time, and the same hooks time
each layer's attention apart from the rest. That split gives the clock both parts of the cost from
the first layer on: a * tokens (weights: projections and MLP) + b * (query, key) pairs (attention)."""
from __future__ import annotations

import time
from contextlib import contextmanager

from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn,
                           TimeElapsedColumn)
from rich.text import Text

PROGRESS_LOG_SECONDS = 60.0


def pairs(start: int, end: int) -> float:
    """(query, key) pairs the tokens [start, end) attend over: token p sees p + 1 keys."""
    return (end * end - start * start + end - start) / 2


class PrefillClock:
    """Seconds left in a prefill whose cost per token is a + b * (tokens before it).

    With layer timings (`layer`): a = seconds outside attention per token, b = seconds in attention
    per (query, key) pair, both measured, so the first layer of the first piece already predicts how
    the cost grows. Without them (a model whose layers cannot be watched): fitted by least squares to
    whole pieces, a piece from context s to e costing a * (e - s) + b * (e^2 - s^2) / 2. A rate alone
    (rich's estimate) says "33 min left" halfway through a whole book on a CPU when twice that is
    left: the second half attends to more."""

    def __init__(self, done: int = 0):
        self.first = self.at = done  # tokens before this run; tokens in finished pieces
        self.since = time.monotonic()
        self.pieces: list[tuple[int, int, float]] = []  # (start, end, seconds)
        # work timed so far, in fractions of pieces, and its seconds split in two
        self.tokens_timed = self.pairs_timed = 0.0
        self.linear_seconds = self.attention_seconds = 0.0
        self.piece_fraction = self.piece_seconds = 0.0  # of the piece under way
        self._piece_tokens = 0

    @property
    def position(self) -> float:
        """Tokens done, counting the layers done of the piece under way."""
        return self.at + self.piece_fraction * self._piece_tokens if self.piece_fraction else self.at

    def layer(self, tokens: int, fraction: float, seconds: float, attention_seconds: float) -> None:
        """`fraction` of the piece of `tokens` after self.at took `seconds`, `attention_seconds` of
        them in attention."""
        self._piece_tokens = tokens
        self._timed(tokens, fraction, seconds - attention_seconds, attention_seconds)
        self.piece_fraction += fraction
        self.piece_seconds += seconds

    def piece(self, n: int, seconds: float) -> None:
        """The piece of n tokens after self.at is done, in `seconds` all told."""
        rest, extra = max(1.0 - self.piece_fraction, 0.0), max(seconds - self.piece_seconds, 0.0)
        if self.tokens_timed > 0 and rest > 1e-9:  # this piece's layers unseen: split as the layers seen were
            a, b = self._measured()
            linear, attention = a * n, b * pairs(self.at, self.at + n)
            share = attention / (linear + attention) if linear + attention > 0 else 0.0
            self._timed(n, rest, extra * (1 - share), extra * share)
        elif self.tokens_timed > 0:  # embedding, final norm, output head: per token
            self._timed(n, 0.0, extra, 0.0)
        self.pieces.append((self.at, self.at + n, seconds))
        self.at += n
        self.piece_fraction = self.piece_seconds = 0.0

    def advance(self, n: int) -> None:
        now = time.monotonic()
        self.piece(n, now - self.since)
        self.since = now

    def seconds_left(self, total: int) -> float | None:
        if not self.pieces and not self.piece_fraction:
            return None
        if self.position >= total:
            return 0.0
        if self.tokens_timed > 0:
            a, b = self._measured()
            return (a * (total - self.first - self.tokens_timed)
                    + b * (pairs(self.first, total) - self.pairs_timed))
        a, b = self._fit()
        return a * (total - self.at) + b * (total ** 2 - self.at ** 2) / 2

    def layer_seconds(self, tokens: int, layers: int) -> float | None:
        """Expected seconds of one of `layers` layers of the piece of `tokens` after self.at."""
        if self.tokens_timed <= 0:
            return None
        a, b = self._measured()
        return (a * tokens + b * pairs(self.at, self.at + tokens)) / layers

    def _timed(self, tokens: int, fraction: float, linear: float, attention: float) -> None:
        self.tokens_timed += fraction * tokens
        self.pairs_timed += fraction * pairs(self.at, self.at + tokens)
        self.linear_seconds += linear
        self.attention_seconds += attention

    def _measured(self) -> tuple[float, float]:
        return self.linear_seconds / self.tokens_timed, self.attention_seconds / self.pairs_timed

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
    def __init__(self, advance: "PrefillAdvance"):
        super().__init__()
        self.advance = advance

    def render(self, task):
        left = None if task.finished else self.advance.seconds_left()
        return Text(f"{minutes(left)} left" if left is not None else "", style="progress.remaining")


class _MovingProgress(Progress):
    """rich's Progress, bringing the bar up to the expected position before each refresh (10 a
    second at a terminal)."""

    def __init__(self, *columns, before_refresh=None, **kwargs):
        self.before_refresh = before_refresh  # first: rich renders once while it sets up
        super().__init__(*columns, **kwargs)

    def get_renderables(self):
        if self.before_refresh is not None:
            self.before_refresh()
        yield from super().get_renderables()


class PrefillAdvance:
    """What a prefill calls: `advance(n)` after each piece of n tokens (Generator.prefill's
    `progress`), and `advance.layer(...)` after each decoder layer (through `watch_layers`).

    Between two reports the bar moves on at the measured pace: a layer of Qwen2.5-1.5B over a
    4,096-token piece at 100K tokens of context takes about 13 s on a 2-core CPU, longer than a bar
    may sit still. It goes no further than the end of the layer under way, so it runs at most one
    layer's share ahead of what is done, and waits there if the layer is slower than expected."""

    def __init__(self, clock: PrefillClock, total: int, label: str, console=None, now=time.monotonic):
        self.clock, self.total, self.label, self.now = clock, total, label, now
        self.progress: Progress | None = None
        self.task = None
        self.console = console  # a log file's console: a line once a minute; None at a terminal
        self.logged = self.reported = now()
        self.piece_tokens = self.layers = 0  # of the latest layer report

    def __call__(self, n: int) -> None:
        self.clock.advance(n)
        self._show()

    def layer(self, tokens: int, layer: int, layers: int, seconds: float, attention_seconds: float) -> None:
        self.piece_tokens, self.layers = tokens, layers
        self.clock.layer(tokens, 1 / layers, seconds, attention_seconds)
        self._show()

    def expected_position(self) -> float:
        """Tokens done by now as the clock expects: those reported, and the share of the layer under
        way that its expected seconds say is done, up to that layer's end."""
        done = min(self.clock.position, self.total)  # a self-drafter's window prefill reports through the same layers
        if not self.layers or self.clock.piece_fraction >= 1 - 1e-9:
            return done  # no layer seen yet, or every layer of the piece done: nothing to expect
        tokens = min(self.piece_tokens, self.total - self.clock.at)
        expected = self.clock.layer_seconds(tokens, self.layers)
        if not expected or tokens <= 0:
            return done
        share = min((self.now() - self.reported) / expected, 1.0)
        return min(done + share * tokens / self.layers, self.total)

    def seconds_left(self) -> float | None:
        """The clock's time left, less the time since the last report."""
        left = self.clock.seconds_left(self.total)
        return None if left is None else max(left - (self.now() - self.reported), 0.0)

    def catch_up(self) -> None:
        """Bring the bar to the expected position (never back)."""
        if self.progress is not None and self.progress.tasks[0].completed < (at := self.expected_position()):
            self.progress.update(self.task, completed=at)

    def _show(self) -> None:
        self.reported = self.now()
        self.progress.update(self.task, completed=min(self.clock.position, self.total))
        if self.console is not None and self.now() - self.logged >= PROGRESS_LOG_SECONDS:
            self._log()

    def _log(self) -> None:
        state = self.progress.tasks[0]
        if state.finished:
            return
        self.logged = self.now()
        left = self.clock.seconds_left(self.total)
        self.console.print(f"{self.label}: {state.completed:,.0f} of {self.total:,} tokens ({state.percentage:.0f}%)"
                           + (f", {state.speed:,.0f} tok/s" if state.speed else "")
                           + (f", about {minutes(left)} left" if left is not None else ""))


def prefill_progress(console, total: int, label: str = "prefill", done: int = 0):
    """A rich progress bar (tokens done / total, tokens/s, time left, time elapsed); returns
    (progress, advance): pass `advance` as the prefill's progress, and to `watch_layers` for a bar
    that moves within pieces. `done`: tokens already there (loaded from checkpoints or a kept prompt), shown but
    not counted in the rate."""
    clock = PrefillClock(done)
    advance = PrefillAdvance(clock, total, label, None if console.is_terminal else console)
    progress = _MovingProgress(TextColumn(f"[bold]{label}"), BarColumn(bar_width=20), MofNCompleteColumn(), _Rate(),
                               _TimeLeft(advance), TimeElapsedColumn(), console=console, transient=False,
                               speed_estimate_period=300,  # a piece can take minutes at long context
                               before_refresh=advance.catch_up)
    advance.progress, advance.task = progress, progress.add_task(label, total=total, completed=done)
    if not console.is_terminal:
        # A log file gets no live bar, only the final one; a whole book takes an hour on a CPU, so the
        # log says when the prefill starts and then, once a minute, how far it is and how long is left.
        console.print(f"{label}: {total - done:,} tokens ..." if not done else
                      f"{label}: {total - done:,} tokens after {done:,} loaded ...")
    return progress, advance


@contextmanager
def watch_layers(model, advance):
    """While inside, each decoder layer of each forward of `model` reports to
    `advance.layer(tokens, layer, layers, seconds, attention_seconds)`: forward hooks, so the model
    and the engine need no change. `attention_seconds` is the time from the fused q/k/v projection's
    end to the output projection's start (rotation, cache write, attention). A model without the
    decoder's layout (another wrapper) is left unwatched: the bar then moves once a piece. On a GPU
    each stamp waits for the queued kernels (launch times would say nothing of the cost): a wait per
    layer, microseconds against a prefill piece's milliseconds."""
    layers = getattr(model, "layers", None)
    report = getattr(advance, "layer", None)
    if report is None or layers is None or not all(hasattr(b, "attention") and hasattr(b, "mlp") for b in layers):
        yield
        return
    n = len(layers)
    stamps = {"layer": 0.0, "qkv": 0.0, "attention": 0.0}
    now = _clock_for(model)

    def forward_starts(_module, _inputs):
        stamps["layer"] = now()

    def qkv_done(_module, _inputs, _output):
        stamps["qkv"] = now()

    def attention_done(_module, _inputs):  # the output projection is about to start
        stamps["attention"] = now() - stamps["qkv"]

    def layer_done(i):
        def hook(_module, inputs, _output):
            end = now()
            seconds, stamps["layer"] = end - stamps["layer"], end
            report(inputs[0].shape[0], i + 1, n, seconds, stamps["attention"])
        return hook

    handles = [model.register_forward_pre_hook(forward_starts)]
    for i, block in enumerate(layers):
        handles += [block.attention.wqkv.register_forward_hook(qkv_done),
                    block.attention.wo.register_forward_pre_hook(attention_done),
                    block.mlp.register_forward_hook(layer_done(i))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _clock_for(model):
    """time.perf_counter, after the device's queued work where the model computes asynchronously."""
    weight = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    if weight is None or weight.device.type != "cuda":
        return time.perf_counter
    import torch

    def after_the_queue() -> float:
        torch.cuda.synchronize(weight.device)
        return time.perf_counter()
    return after_the_queue
