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

A second text may be searched beside the sequence (`reference`): a book chat's book with its line
wraps undone (runtime/text.py). A model quoting a hard-wrapped book may write a space where the book
breaks a line, and then in the book itself every wrapped line ends the quotation's match; in the
unwrapped text it runs on. Or it copies the breaks, and then the book is the better source. So the
reference's match is taken when it is longer, or when both reach `longest` and the reference's
agrees with the sequence further back (up to AGREE_WINDOW tokens: one of the two has met a line
break there that the sequence did or did not write). Either way the drafts are only proposals: the
output does not change.
"""
from __future__ import annotations

import numpy as np
import torch

LONGEST_NGRAM = 6  # the longest suffix matched; a shorter one serves where it finds none
# how far back two matches of `longest` tokens are compared to choose between the sequence and a
# reference: a hard-wrapped book breaks a line every 15-20 tokens
AGREE_WINDOW = 32


class LookupDrafter:
    """What Models.drafter holds for `Settings.draft = "lookup"`: proposes by lookup, not by a model."""

    name = "lookup"

    def __init__(self, longest: int = LONGEST_NGRAM):
        if longest < 1:
            raise ValueError(f"a lookup matches at least 1 token (got {longest})")
        self.longest = longest
        self.reference: torch.Tensor | None = None  # token ids of a second text searched too (1-D, on the device)

    def drafts(self, ids: torch.Tensor, at: torch.Tensor | int, n: int) -> torch.Tensor:
        """n drafts for positions [at, at + n), given ids[:at] (the window `ids` may run past `at`;
        what lies there is ignored). A match is the latest end position e < at - 1 with ids[e - j] ==
        ids[at - 1 - j] for j < k, for the largest k <= longest that has one; the drafts are the tokens
        after it, continuing periodically when they run into position at (a loop repeats). Without any
        match the last token is repeated (a draft like any other: verification decides). With a
        `reference`, its latest match of ids[:at]'s last tokens is found the same way and its
        following tokens drafted instead where that match is longer, or both are `longest` long
        and agrees further back (past the reference's end its last token repeats)."""
        steps = torch.arange(n, device=ids.device)
        positions = torch.arange(ids.shape[0], device=ids.device)
        end, k = self._latest_match(ids, positions < at - 1, at, ids)  # a token must follow a match
        source = torch.where(end >= 0, end + 1, at - 1)
        period = at - source  # >= 1: every index below reads a position before `at`
        own = ids.index_select(0, source + steps % period)
        if self.reference is None:
            return own
        ref = self.reference
        last = ref.shape[0] - 1
        ref_end, ref_k = self._latest_match(ref, torch.arange(ref.shape[0], device=ids.device) < last, at, ids)
        quoted = ref.index_select(0, (ref_end + 1 + steps).clamp(max=last))
        further = _agreement(ref, ref_end, ids, at) > _agreement(ids, end, ids, at)
        better = (ref_k > k) | ((ref_k == self.longest) & (k == self.longest) & further)
        return torch.where(better, quoted, own)

    def _latest_match(self, text: torch.Tensor, allowed: torch.Tensor, at, ids: torch.Tensor):
        """(e, k) as 0-dim device tensors: the latest position e where `allowed` holds and text's k
        tokens ending at e equal ids[:at]'s last k, for the largest k <= longest that has one; (-1, 0)
        for none."""
        positions = torch.arange(text.shape[0], device=text.device)
        match, end = allowed, torch.full((), -1, dtype=torch.long, device=text.device)
        k = torch.zeros((), dtype=torch.long, device=text.device)
        for j in range(self.longest):  # match holds where the last j + 1 tokens agree
            lead = min(j, text.shape[0])  # a text shorter than the match has no earlier tokens at all
            earlier = torch.cat((text.new_full((lead,), -1), text[:text.shape[0] - lead]))  # earlier[e] = text[e - j]
            match = match & (earlier == _token_at(ids, at - 1 - j))
            latest = torch.where(match, positions, -1).amax()
            end = torch.where(latest >= 0, latest, end)
            k = torch.where(latest >= 0, j + 1, k)
        return end, k


def _agreement(text: torch.Tensor, end: torch.Tensor, ids: torch.Tensor, at) -> torch.Tensor:
    """How many tokens, up to AGREE_WINDOW, text agrees with ids[:at] going back from text[end] and
    ids[at - 1] (0-dim; gathers of the window only)."""
    back = torch.arange(AGREE_WINDOW, device=text.device)
    mine, theirs = end - back, at - 1 - back
    same = text.index_select(0, mine.clamp_min(0)) == ids.index_select(0, theirs.clamp_min(0))
    return (same & (mine >= 0) & (theirs >= 0)).long().cumprod(0).sum()


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
        self.reference: np.ndarray | None = None  # LookupDrafter.reference's tokens

    def length(self, context: list[int]) -> int:
        """The longest k <= longest such that context's last k tokens occurred ending before the last
        token (so a token followed them), in the context or in the reference: the lookup's match at
        position len(context), 0 for none."""
        n = len(context)
        self.indexed = min(self.indexed, n)  # cut without rollback(): what it lost is not read
        if n > len(self.ids):
            self.ids = np.concatenate((self.ids[:self.indexed], np.empty(2 * n, dtype=np.int64)))
        self.ids[self.indexed:n] = context[self.indexed:n]
        self.indexed = n
        if n == 0:
            return 0
        own = self._longest_run(self.ids, n - 1, n)
        if self.reference is None or own == self.longest:
            return own
        return max(own, self._longest_run(self.reference, len(self.reference) - 1, n))

    def _longest_run(self, text: np.ndarray, limit: int, n: int) -> int:
        """The longest k <= longest with text[e - k + 1 : e + 1] equal to the context's last k tokens
        for some e < limit."""
        ids = self.ids
        ends = np.flatnonzero(text[:limit] == ids[n - 1])  # where a run of the last k tokens ends, k = 1 first
        k = 0
        while ends.size:
            k += 1
            if k == self.longest or k == n:
                break
            ends = ends[ends >= k]
            ends = ends[text[ends - k] == ids[n - 1 - k]]
        return k

    def rollback(self, length: int) -> None:
        """The context was cut to `length` tokens."""
        self.indexed = min(self.indexed, length)
