"""The drafter's StreamingLLM cache over a prompt: computed cheaply (the sinks and the last window
tokens, nothing between), taken as it stands right after a prefill, restored from such a window
(a chat's /reset, a kept prompt or book), or started again after a rollback past its window.

Every function takes the drafter's level (levels.Level over a caches.StreamingCache); what they
change is that level's cache and how much of the sequence it holds. A drafter only proposes, so
what its window keeps or skips moves drafts and speed, never the output.
"""
from __future__ import annotations

import torch

from .levels import Level, Sequence


def prefill(level: Level, seq: Sequence, n: int) -> None:
    """StreamingLLM state after the sequence's first n tokens: the sinks and the last window tokens,
    nothing between. Running the drafter over just those costs a window, not the prompt."""
    cache = level.cache
    sinks, window = cache.sinks, cache.window
    if n <= sinks + window:
        level.run(seq, n, 1, one_off=True)
        return
    ids = seq.ids
    # one piece into the empty cache, where a drafter's feeds go in pieces of its slack (64): 260
    # tokens as one prefill cost 0.59-0.77 s of the main job's start on the avx512 Xeon, against
    # 1.07-1.10 in pieces. The window's keys round as one piece's do, which moves drafts, never output
    level.feed(torch.cat((ids[:sinks], ids[n - window:n])), 1, one_off=True, piece=sinks + window)
    cache.skipped_to(n)
    level.adopt(n)


def restart(level: Level, seq: Sequence, n: int) -> None:
    """Empty the drafter's cache and prefill it cheaply for the sequence's first n tokens."""
    level.cache.reset()
    level.adopt(0)
    prefill(level, seq, n)


def taken(level: Level | None) -> dict | None:
    """The drafter's cache as it stands for the committed prompt right after a prefill or a resume
    (the sinks and the window, computed as one piece), with the prompt length it holds; None without
    a drafter or where it has moved on."""
    if level is None or not 0 < level.held == level.agreed == level.cache.length:
        return None
    return level.cache.snapshot() | {"prompt": torch.tensor(level.held)}


def restore(level: Level, n: int, window: dict | None) -> bool:
    """The drafter's cache for the first n tokens from a window taken at n; False where there is none
    (or it does not fit the cache), and the caller computes it."""
    if window is None or int(window["prompt"]) != n:
        return False
    try:
        level.cache.restore(window)
    except ValueError:
        return False
    level.adopt(n)
    return True
