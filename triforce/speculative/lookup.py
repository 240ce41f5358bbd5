"""A drafter with no model: the tokens that followed the latest earlier occurrence of the sequence's
last few tokens (prompt-lookup drafting).

Why a hierarchy wants it: a drafter pays only when its pass costs much less than the middle level's.
A drafter->middle round makes (a + 1) tokens for gamma1 draft passes and one middle pass, where the
middle level alone makes one token per pass, so with a drafter as dear as the middle level (SmolLM2
drafting for itself: on a GPU every pass of a 135M model costs its ~850 kernels, 1.9 ms, whatever
its cache; on a CPU its int8 window pass costs about what the middle pass does) a round can never
beat the middle level alone. A lookup costs a few device ops over the sequence and no weights, so any
accepted draft is a gain. It proposes well where the text repeats what came before it: a book's
names and phrases quoted in an answer, code, a model that loops; on novel prose sampled at
temperature 1 it proposes little, and then the adaptive chooser runs the middle level alone.

A lookup is a deterministic function of the sequence, so its "distribution" is a point mass on each
draft: speculative sampling then accepts draft x with probability p(x) and, on rejection, draws from
p with x removed (sampling.verify_sampled with one-hot rows), exactly the target's distribution.

Everything is device work over a fixed number of positions (the matches are sought in the whole
window given, positions at or past `at` masked), so a lookup runs inside a captured or compiled
drafter->middle round with no host read.
"""
from __future__ import annotations

import numpy as np
import torch

LONGEST_NGRAM = 6  # the longest suffix matched; a shorter one serves where it finds none


class LookupDrafter:
    """What Models.drafter holds for `Settings.draft = "lookup"`: proposes by lookup, not by a model."""

    name = "lookup"

    def __init__(self, longest: int = LONGEST_NGRAM):
        if longest < 1:
            raise ValueError(f"a lookup matches at least 1 token (got {longest})")
        self.longest = longest

    def drafts(self, ids: torch.Tensor, at: torch.Tensor | int, n: int) -> torch.Tensor:
        """n drafts for positions [at, at + n), given ids[:at] (the window `ids` may run past `at`;
        what lies there is ignored). A match is the latest end position e < at - 1 with ids[e - j] ==
        ids[at - 1 - j] for j < k, for the largest k <= longest that has one; the drafts are the tokens
        after it, continuing periodically when they run into position at (a loop repeats). Without any
        match the last token is repeated (a draft like any other: verification decides)."""
        length = ids.shape[0]
        positions = torch.arange(length, device=ids.device)
        match = positions < at - 1  # a match must end before the last token, so a token follows it
        best = torch.full((), -1, dtype=torch.long, device=ids.device)
        for j in range(self.longest):  # match holds where the last j + 1 tokens agree
            earlier = torch.cat((ids.new_full((j,), -1), ids[:length - j]))  # earlier[e] = ids[e - j]
            match = match & (earlier == _token_at(ids, at - 1 - j))
            end = torch.where(match, positions, -1).amax()
            best = torch.where(end >= 0, end, best)
        source = torch.where(best >= 0, best + 1, at - 1)
        period = at - source  # >= 1: every index below reads a position before `at`
        return ids.index_select(0, source + torch.arange(n, device=ids.device) % period)


def _token_at(ids: torch.Tensor, position) -> torch.Tensor:
    """ids[position] as a (1,) tensor, -2 (no token) where position < 0; `position` a host int or a
    0-dim device tensor (no host read either way)."""
    if isinstance(position, int):
        return ids[position:position + 1] if position >= 0 else ids.new_full((1,), -2)
    return torch.where(position >= 0, ids.index_select(0, position.clamp_min(0)[None]), -2)


def point_masses(tokens: torch.Tensor, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """(n, vocab) distributions with all their mass on each token: a deterministic draft's q."""
    return torch.nn.functional.one_hot(tokens, vocab).to(dtype)


class MatchIndex:
    """The host's copy of the committed text, to tell before a pass and without touching the device
    how many tokens the lookup's match will span there (`length`). That is what makes its drafts good
    or bad: on a book chat's answers (Qwen2.5-Coder-1.5B over Pride and Prejudice) a verification of 3
    looked-up drafts accepted 0.2 on average after a 1-token match and 1.6 after a 3-token one. The
    adaptive chooser counts a lookup's acceptance apart by this length (adaptive.Chooser).

    Fed the context as it grows (`length` copies what it has not seen into a numpy array); a cut
    context is `rollback(n)`. A query compares the whole text with the last token once (128K tokens:
    well under a millisecond), then narrows those positions token by token."""

    def __init__(self, longest: int = LONGEST_NGRAM):
        self.longest = longest
        self.ids = np.empty(1024, dtype=np.int64)
        self.indexed = 0  # context[:indexed] is in ids

    def length(self, context: list[int]) -> int:
        """The longest k <= longest such that context's last k tokens occurred ending before the last
        token (so a token followed them): the lookup's match at position len(context), 0 for none."""
        n = len(context)
        self.indexed = min(self.indexed, n)  # cut without rollback(): what it lost is not read
        if n > len(self.ids):
            self.ids = np.concatenate((self.ids[:self.indexed], np.empty(2 * n, dtype=np.int64)))
        self.ids[self.indexed:n] = context[self.indexed:n]
        self.indexed = n
        if n < 2:
            return 0
        ids = self.ids
        ends = np.flatnonzero(ids[:n - 1] == ids[n - 1])  # where a run of the last k tokens ends, k = 1 first
        k = 0
        while ends.size:
            k += 1
            if k == self.longest:
                break
            ends = ends[ends >= k]
            ends = ends[ids[ends - k] == ids[n - 1 - k]]
        return k

    def rollback(self, length: int) -> None:
        """The context was cut to `length` tokens."""
        self.indexed = min(self.indexed, length)
