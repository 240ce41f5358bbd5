"""Triforce's drafter->middle rounds with no host decision inside (issue 22, item 4).

The host-driven proposer (engine.SpeculativeProposer) reads each middle-level verification's
acceptance to learn where the drafter goes next: one wait per middle pass. Here the position where
the next drafts go is a device tensor (`at`), and every pass has a shape fixed before the round:

    round r (R rounds, R chosen on the host before the step from the acceptance seen so far):
        drafter: gamma1 steps; the first feeds the tokens the drafter is missing (2 after a middle
                 verification: the last accepted token and the middle's own; 1-3 at a step's start),
                 each writes one draft at a device position
        middle:  one pass over the gamma1 + 1 positions [at - 1, at + gamma1), verification on the
                 device, its token written at at + accepted, at += accepted + 1

The middle level has then made `at - c` tokens (a device count, between R and R * (gamma1 + 1)); the
full level verifies the R * (gamma1 + 1) positions after c with acceptance capped at that count
(sampling.verify_*'s `limit`), so the proposal's length is a stopping time of the proposer's own
randomness and verification stays exact. Caches are addressed through `CursorView`s: the same
buffers, slots and RoPE positions computed on the device from `at`, attention over the whole
capacity under a mask (graphs.StaticView). What the caches' own host-side bookkeeping must learn
(how far the drafter got, how many tokens each round made) comes back with the round's one read.
"""
from __future__ import annotations

import math

import torch

from .graphs import StaticView


class CursorView(StaticView):
    """A cache's buffers addressed by a device position: slot = position - shift, with `shift` fixed
    for the round (no eviction happens inside one). The RoPE position is the sequence position
    (retrieval) or the slot (StreamingLLM, whose positions are its slots)."""

    def __init__(self, cache, T: int, rope_by_slot: bool):
        super().__init__(cache, T)
        self.rope_by_slot = rope_by_slot

    def point(self, start: torch.Tensor, shift: int) -> None:
        """The T tokens fed next sit at sequence positions [start, start + T) (start: 0-dim, device)."""
        torch.add(self.offsets, start - shift, out=self.slots)
        self.positions.copy_(self.slots if self.rope_by_slot else self.slots + shift)


class DeviceRoundProposer:
    """Drafter + StreamingLLM cache proposing gamma1 tokens per pass of the middle level (retrieval
    cache), for R rounds without a host read. `propose` returns (width, distributions, made): the
    full level verifies `width` positions, of which the first `made` (device count) are proposals."""

    def __init__(self, drafter, middle, gamma1: int, sampling):
        self.drafter, self.middle, self.gamma1, self.sampling = drafter, middle, gamma1, sampling
        self.views: dict[tuple[str, int], CursorView] = {}
        self.tokens_per_round = float(gamma1 + 1)  # running mean of what a round makes; optimistic start
        self.origins: list[str] = []

    # ------------------------------------------------------------------ planning (host, before the round)
    def rounds_for(self, gamma: int) -> int:
        """Rounds expected to make about `gamma` tokens, from the rounds seen so far."""
        return max(1, min(gamma, math.ceil(gamma / self.tokens_per_round - 1e-9)))

    def _catch_up_drafter(self, seq, c: int) -> int:
        """Bring the drafter to hold 1-3 tokens short of position c (what the first step feeds);
        a drafter further behind (after a prefill, a chat turn) catches up on the host, once."""
        level = self.drafter
        level.rollback(min(level.agreed, c - 1))
        if level.held < c - 3:
            level.run(seq, c - 1, 1)
        return level.held

    # ------------------------------------------------------------------ the round
    def propose(self, seq, c: int, gamma: int):
        g, device = self.gamma1, seq.ids.device
        R = self.rounds_for(gamma)
        width = R * (g + 1)
        held = self._catch_up_drafter(seq, c)
        self.drafter.cache.make_room(c - held + width + 1)  # the round writes at most this many slots
        assert self.middle.held == c - 1, (self.middle.held, c)  # absorbed up to the committed tokens
        draft_shift = self.drafter.cache.length - self.drafter.cache.used
        middle_shift = self.middle.cache.length - self.middle.cache.used
        at = torch.full((), c, dtype=torch.long, device=device)
        steps = torch.arange(g + 1, device=device)
        dists = None  # the middle level's distribution at each of the width positions (sampled runs)
        accepts = []
        for r in range(R):
            draft_dists = []
            for k in range(g):
                T = (c - held if r == 0 else 2) if k == 0 else 1
                logits = self._pass(self.drafter, "draft", seq, at + k - T, T, draft_shift, rope_by_slot=True)
                token, probs = self.sampling.pick(logits)
                seq.ids.index_copy_(0, (at + k)[None], token)
                draft_dists.append(probs)
            logits = self._pass(self.middle, "middle", seq, at - 1, g + 1, middle_shift, rope_by_slot=False)
            drafts = seq.ids.index_select(0, at + steps[:g])
            q = None if draft_dists[0] is None else torch.cat(draft_dists)
            accepted, nxt, probs = self.sampling.verify(drafts, q, logits)
            seq.ids.index_copy_(0, (at + accepted)[None], nxt[None])
            if probs is not None:  # rows past the round's accepted ones are overwritten by the next round
                dists = probs.new_zeros(width, probs.shape[1]) if dists is None else dists
                dists.index_copy_(0, at - c + steps, probs)
            accepts.append(accepted)
            if r < R - 1:
                at = at + accepted + 1
        # what the host learns with the round's one read: each round's acceptance
        self.pending = torch.stack(accepts)
        made = at + accepts[-1] + 1 - c
        return width, dists, made

    def _pass(self, level, name: str, seq, start: torch.Tensor, T: int, shift: int, rope_by_slot: bool):
        """Logits of `level` over seq[start : start + T] (device start): all T rows for the middle
        level, the last one for the drafter. A level wrapped for graphs (graphs.GraphedModel: CUDA
        graphs, or --compile) replays its graph of this view; others run eagerly."""
        last_only = name == "draft"
        key = (name, T)
        if key not in self.views:
            self.views[key] = CursorView(level.cache, T, rope_by_slot)
        view = self.views[key]
        view.point(start, shift)
        ids = seq.ids.index_select(0, start + view.offsets)
        begun = level.clock.now()
        if hasattr(level.model, "run_view"):
            logits = level.model.run_view(view, ids, last_only)
        else:
            logits = level.model(ids, view, last_only)
        level.timed(T, begun)
        return logits

    # ------------------------------------------------------------------ after the read (host)
    def settle(self, accepts: list[int], c: int, made: int) -> None:
        """The round's acceptance came back: the drafter's cache and level learn how far they got,
        statistics and origins are recorded."""
        g = self.gamma1
        last_at = c + made - accepts[-1] - 1
        self.drafter.cache.wrote_to(last_at + g - 1)  # the last step fed up to (not including) this position
        self.drafter.adopt(last_at + g - 1)
        self.drafter.changed_from(c + made - 1)  # where the middle's last token replaced a draft
        origins = []
        for a in accepts:
            self.drafter.stats.add_acceptance("draft->middle", g, a)
            if self.middle.meter is not None:
                self.middle.meter.acceptance.record("draft->middle", g, a)
            origins += [self.drafter.name] * a + [self.middle.name]
        self.origins = origins
        per_round = made / len(accepts)
        self.tokens_per_round += 0.3 * (per_round - self.tokens_per_round)
