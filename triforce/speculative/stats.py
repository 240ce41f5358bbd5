"""What a generation reports: token counts, acceptance per level, passes and time per level."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

ROUND = "draft+middle"  # a drafter->middle round run as one graph (rounds.RoundGraph): timed as a whole
LOOKUP_ROUND = "lookup+middle"  # the same with lookups beside a model drafter (modes.LOOKUP_VARIANT)
LEVEL_ORDER = ("draft", "lookup", "middle", ROUND, LOOKUP_ROUND, "verify")


def round_name(drafter: str) -> str:
    """What a whole drafter->middle round is timed as, by the name of the level that drafts in it."""
    return LOOKUP_ROUND if drafter == "lookup" else ROUND


@dataclass
class Stats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    decode_tokens: int = 0  # new tokens produced by decode passes (the first comes from prefill)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    rebuilds: int = 0
    bytes_moved: int | None = None  # filled by the offload runtime
    phase: str = "decode"
    passes: dict = field(default_factory=lambda: defaultdict(int))
    seconds: dict = field(default_factory=lambda: defaultdict(float))
    untimed: dict = field(default_factory=lambda: defaultdict(int))  # passes inside a whole-round graph
    proposed: dict = field(default_factory=lambda: defaultdict(int))
    accepted: dict = field(default_factory=lambda: defaultdict(int))
    modes: dict = field(default_factory=lambda: defaultdict(int))  # full passes per mode (adaptive runs)
    estimates: dict = field(default_factory=dict)  # adaptive: {mode: {gamma, ms_per_token}} it believed last

    def add_pass(self, level: str, seconds: float | None, count: int = 1) -> None:
        """`count` passes of `level`; seconds None: they ran inside a round timed as a whole."""
        if self.phase == "prefill":
            return  # prefill time is counted as a whole by the generator
        self.passes[level] += count
        if seconds is None:
            self.untimed[level] += count
        else:
            self.seconds[level] += seconds

    def add_acceptance(self, key: str, proposed: int, accepted: int) -> None:
        self.proposed[key] += proposed
        self.accepted[key] += accepted

    def add_mode(self, mode: str) -> None:
        self.modes[mode] += 1

    def acceptance(self, key: str) -> float | None:
        return self.accepted[key] / self.proposed[key] if self.proposed.get(key) else None

    @property
    def full_passes(self) -> int:
        return self.passes.get("verify", 0)

    @property
    def tokens_per_full_pass(self) -> float | None:
        return self.decode_tokens / self.full_passes if self.full_passes else None

    @property
    def tokens_per_second(self) -> float | None:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else None

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "decode_tokens": self.decode_tokens,
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "tokens_per_second": self.tokens_per_second,
            "acceptance": {key: self.acceptance(key) for key in sorted(self.proposed)},
            "proposed": dict(self.proposed), "accepted": dict(self.accepted),  # acceptance's counts, to pool runs
            "tokens_per_full_pass": self.tokens_per_full_pass,
            "full_passes": self.full_passes,
            "passes": {k: self.passes.get(k, 0) for k in LEVEL_ORDER},
            "seconds": {k: self.seconds.get(k, 0.0) for k in LEVEL_ORDER},
            "timed_passes": {k: self.passes.get(k, 0) - self.untimed.get(k, 0) for k in LEVEL_ORDER},
            "rebuilds": self.rebuilds,
            "bytes_moved": self.bytes_moved,
            "modes": dict(self.modes),
            "estimates": self.estimates,
        }
