"""The one table of which levels each mode has; everything that asks "does this mode draft?" or
"does it retrieve?" reads it here.

    level    model + cache                           role
    draft    drafter + StreamingLLM cache            proposes gamma1 tokens per middle pass
    middle   target + retrieval cache (a budget)     verifies drafts, proposes gamma2 per full pass
    verify   target + full cache                     verifies, commits
"""
from __future__ import annotations

LEVELS = {
    "autoregressive": ("verify",),
    "speculative": ("draft", "verify"),
    "retrieval": ("middle", "verify"),
    "triforce": ("draft", "middle", "verify"),
}
MODES = tuple(LEVELS)
# a mode and every mode made of a subset of its levels (what an adaptive run may switch between)
SUB_MODES = {mode: tuple(m for m in MODES[::-1] if set(LEVELS[m]) <= set(LEVELS[mode])) for mode in MODES}
# the mode without the retrieval level, for a prompt too short to retrieve from
WITHOUT_RETRIEVAL = {"retrieval": "autoregressive", "triforce": "speculative"}


def retrieves(mode: str) -> bool:
    """Whether the mode has a retrieval level (a budget to choose)."""
    return "middle" in LEVELS[mode]


def drafts(mode: str) -> bool:
    """Whether the mode has a drafter level (a StreamingLLM cache)."""
    return "draft" in LEVELS[mode]
