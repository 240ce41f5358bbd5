"""The one table of which levels each mode has; everything that asks "does this mode draft?" or
"does it retrieve?" reads it here.

    level    model + cache                           role
    draft    drafter + StreamingLLM cache            proposes gamma1 tokens per middle pass
    middle   target + retrieval cache (a budget)     verifies drafts, proposes gamma2 per full pass
    verify   target + full cache                     verifies, commits
    lookup   none: drafts looked up in the sequence      proposes like the drafter (lookup.py), beside it

An adaptive run whose drafter is a model also weighs the same hierarchies with the drafter's drafts
looked up instead (LOOKUP_VARIANT): a lookup costs no weights, so where the text repeats itself (a
quotation in a book chat, code, a looping model) it drafts for less than any model, and elsewhere the
chooser keeps the model.
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
# the modes with a drafter, run with lookups in its place: adaptive only, beside a model drafter
LOOKUP_VARIANT = {"speculative": "lookup", "triforce": "triforce-lookup"}
ALL_LEVELS = {**LEVELS, "lookup": ("lookup", "verify"), "triforce-lookup": ("lookup", "middle", "verify")}
# what each mode's levels make: the proposer shapes the adaptive arithmetic knows
SHAPE = {**{m: m for m in MODES}, **{v: m for m, v in LOOKUP_VARIANT.items()}}
# the mode without the retrieval level, for a prompt too short to retrieve from
WITHOUT_RETRIEVAL = {"retrieval": "autoregressive", "triforce": "speculative"}


def retrieves(mode: str) -> bool:
    """Whether the mode has a retrieval level (a budget to choose)."""
    return "middle" in ALL_LEVELS[mode]


def drafts(mode: str) -> bool:
    """Whether the mode has a drafter level (a StreamingLLM cache)."""
    return "draft" in ALL_LEVELS[mode]


def proposing_level(mode: str) -> str | None:
    """The level whose proposals the full pass verifies (None: plain decoding): the edge `x->verify`."""
    levels = ALL_LEVELS[mode]
    return levels[-2] if len(levels) > 1 else None


def first_level(mode: str) -> str:
    """The level that drafts first: 'draft', 'lookup', or the middle level of retrieval."""
    return ALL_LEVELS[mode][0]


def adaptive_modes(mode: str, lookup: bool) -> tuple[str, ...]:
    """What an adaptive run of `mode` switches between: its sub-modes, and with `lookup` (a model
    drafter beside which lookups are weighed) the lookup variants of those that draft."""
    subs = SUB_MODES[mode]
    return subs + tuple(LOOKUP_VARIANT[m] for m in subs if lookup and m in LOOKUP_VARIANT)
