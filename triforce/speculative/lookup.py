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
    """The host's index of the committed text: where each run of 1..longest tokens last ended. It
    tells, before a pass and without touching the device, how many tokens the lookup's match will
    span there (`length`), which is what makes its drafts good or bad: on a book chat's answers
    (Qwen2.5-Coder-1.5B over Pride and Prejudice) a verification of 3 looked-up drafts accepted 0.24
    on average after a 1-token match and 1.77 after a 3-token one. The adaptive chooser counts a
    lookup's acceptance apart by this length (adaptive.Chooser).

    Fed the context as it grows (`length` catches up on what it has not seen); `rollback(n)` forgets
    what ended at or after position n - 1, restoring the earlier ends those runs had overwritten, so
    a chat's truncation costs what it removes. Runs are keyed by their tokens packed in one int."""

    def __init__(self, longest: int = LONGEST_NGRAM):
        self.longest = longest
        self.last_end: dict[tuple, int] = {}  # a run of tokens -> the position of its last token
        self.undo: list[tuple[tuple, int | None]] = []  # per insert, in order: (run, the end it replaced)
        self.indexed = 0  # runs ending at positions < indexed are in the index

    def length(self, context: list[int]) -> int:
        """The longest k <= longest such that context's last k tokens occurred ending before the last
        token (so a token followed them): the lookup's match at position len(context), 0 for none."""
        if self.indexed > max(len(context) - 1, 0):  # cut without rollback(): forget what it lost
            self.rollback(len(context))
        self._catch_up(context)
        k = 0
        while k < min(self.longest, len(context)) and tuple(context[-k - 1:]) in self.last_end:
            k += 1
        return k

    def _catch_up(self, context: list[int]) -> None:
        for end in range(self.indexed, len(context) - 1):  # a run counts once a token follows it
            for k in range(1, min(self.longest, end + 1) + 1):
                run = tuple(context[end - k + 1:end + 1])
                self.undo.append((run, self.last_end.get(run)))
                self.last_end[run] = end
        self.indexed = max(self.indexed, len(context) - 1)

    def rollback(self, length: int) -> None:
        """The context was cut to `length` tokens: forget the runs that ended at or after length - 1."""
        keep = max(length - 1, 0)
        while self.indexed > keep:
            end = self.indexed - 1
            for _ in range(min(self.longest, end + 1)):
                run, before = self.undo.pop()
                if before is None:
                    del self.last_end[run]
                else:
                    self.last_end[run] = before
            self.indexed = end
