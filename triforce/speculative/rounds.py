"""Triforce's drafter->middle rounds with no host decision inside (issue 22, item 4).

The host-driven proposer (levels.SpeculativeProposer) reads each middle-level verification's
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

Where the levels run as graphs (CUDA graphs, or --compile), each round is itself one graph
(RoundGraph): its uniforms are drawn before it in one call (a graph cannot draw from the seeded
generator), the caches' shifts are device inputs, and the drafter's first step always feeds
FIRST_FEED tokens, rewriting with the same K/V any it already holds, so every round, the first of a
step or a later one, has one shape. The round is timed whole, and the adaptive chooser prices
triforce with that time (pricing.seconds_per_token's `round_cost`).
"""
from __future__ import annotations

import math

import torch

from .graphs import GraphedModel, StaticView, capture_graph, compile_static
from .graphs import made as graphs_made
from .lookup import point_masses
from .stats import round_name

FIRST_FEED = 3  # a whole round's first drafter step feeds 3 tokens: 1-3 are new, the rest rewritten


class CursorView(StaticView):
    """A cache's buffers addressed by a device position: slot = position - shift, with `shift` fixed
    for the round (no eviction happens inside one). The RoPE position is the sequence position
    (retrieval) or the slot (StreamingLLM, whose positions are its slots)."""

    def __init__(self, cache, T: int, rope_by_slot: bool):
        super().__init__(cache, T)
        self.rope_by_slot = rope_by_slot

    def point(self, start: torch.Tensor, shift) -> None:
        """The T tokens fed next sit at sequence positions [start, start + T) (start: 0-dim, device;
        shift: an int, or a 0-dim device tensor inside a whole-round graph)."""
        self.slots.copy_(self.offsets + (start - shift))
        self.positions.copy_(self.slots if self.rope_by_slot else self.slots + shift)


class DeviceRoundProposer:
    """Drafter + StreamingLLM cache proposing gamma1 tokens per pass of the middle level (retrieval
    cache), for R rounds without a host read. `propose` returns (width, distributions, made): the
    full level verifies `width` positions, of which the first `made` (device count) are proposals.

    With `graph` set (graphs.enable_cuda_graphs / enable_compiled_passes), each round is one graph
    (RoundGraph) whose drafter always feeds FIRST_FEED tokens first, so every round has one shape.

    With `lookup` (lookup.LookupDrafter) the drafts are looked up in the sequence instead: `drafter`
    is then a level in name only, which times them and counts their acceptance; there is no drafter
    cache to catch up or shift."""

    def __init__(self, drafter, middle, gamma1: int, sampling, lookup=None):
        self.drafter, self.middle, self.gamma1, self.sampling = drafter, middle, gamma1, sampling
        self.lookup = lookup
        self.views: dict[tuple[str, int], CursorView] = {}
        self.tokens_per_round = float(gamma1 + 1)  # running mean of what a round makes; optimistic start
        self.origins: list[str] = []
        self.graph: RoundGraph | None = None

    # ------------------------------------------------------------------ planning (host, before the round)
    def rounds_for(self, gamma: int) -> int:
        """Rounds expected to make about `gamma` tokens, from the rounds seen so far."""
        return max(1, min(gamma, math.ceil(gamma / self.tokens_per_round - 1e-9)))

    def _catch_up_drafter(self, seq, c: int) -> int:
        """Bring the drafter to hold 1-3 tokens short of position c (what the first step feeds);
        a drafter further behind (after a prefill, a chat turn) catches up on the host, once."""
        level = self.drafter
        level.rollback(min(level.agreed, c - 1))
        if level.held < c - FIRST_FEED:
            level.run(seq, c - 1, 1)
        return level.held

    def _whole_rounds(self, c: int, shift: int) -> bool:
        """Whether rounds run as graphs here: the first feed's FIRST_FEED positions, some of which the
        drafter may hold already (rewritten with the same K/V), are all still in its window."""
        cache = self.drafter.cache
        floor = cache.sinks if cache.evictions else 0  # below: sinks, or positions evicted
        return self.graph is not None and c - FIRST_FEED - shift >= floor

    # ------------------------------------------------------------------ the round
    def propose(self, seq, c: int, gamma: int):
        g, device = self.gamma1, seq.ids.device
        R = self.rounds_for(gamma)
        width = R * (g + 1)
        held, draft_shift = c - 1, 0
        if self.lookup is None:
            held = self._catch_up_drafter(seq, c)
            self.drafter.cache.make_room(c - held + width + 1)  # the round writes at most this many slots
            draft_shift = self.drafter.cache.length - self.drafter.cache.used
        assert self.middle.held == c - 1, (self.middle.held, c)  # absorbed up to the committed tokens
        middle_shift = self.middle.cache.length - self.middle.cache.used
        whole = self.graph is not None if self.lookup is not None else self._whole_rounds(c, draft_shift)
        at = torch.full((), c, dtype=torch.long, device=device)
        steps = torch.arange(g + 1, device=device)
        dists = None  # the middle level's distribution at each of the width positions (sampled runs)
        accepts = []
        for r in range(R):
            # a round's uniforms drawn up front: gamma1 drafter draws, then the middle's gamma1 + 1
            uniforms = None if self.sampling.sampler.greedy else self.sampling.uniforms(2 * g + 1)
            if whole:
                accepted, probs = self._whole_round(seq.ids, at, draft_shift, middle_shift, uniforms)
            else:
                first = (c - held if r == 0 else 2)
                accepted, probs = self.round(seq.ids, at, first, draft_shift, middle_shift, uniforms, self._pass)
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

    def _whole_round(self, ids, at, draft_shift: int, middle_shift: int, uniforms):
        """A round as one graph, timed whole (its passes are counted, their times are the round's)."""
        g, builds = self.gamma1, self.graph.builds
        begun = self.middle.clock.now()
        accepted, probs = self.graph.run(ids, at, draft_shift, middle_shift, uniforms)
        self.middle.timed(g, begun, typical=self.graph.builds == builds, name=round_name(self.drafter.name))
        if self.middle.stats.phase != "prefill":
            self.drafter.stats.add_pass(self.drafter.name, None, count=g)
            self.middle.stats.add_pass("middle", None)
        return accepted, probs

    def round(self, ids: torch.Tensor, at: torch.Tensor, first: int, draft_shift, middle_shift,
              uniforms: torch.Tensor | None, forward, timed: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One drafter->middle round, device work only: gamma1 drafter steps (the first feeds `first`
        tokens ending at `at`, drafts go to at, at + 1, ...), the middle level's verification, its
        token written after the accepted drafts. Returns (accepted, the middle's distributions or
        None). forward(level, name, ids, start, T, shift) runs a pass; `timed` False inside a whole-round
        graph (no clock there). A flag, not `forward != self.raw_pass`: dynamo in torch 2.11 cannot
        compare bound methods (the compiled lookup rounds failed on the H200, session 36)."""
        g = self.gamma1
        if self.lookup is not None:
            q = self._look_up(ids, at, timed=timed)
        else:
            draft_dists = []
            for k in range(g):
                T = first if k == 0 else 1
                logits = forward(self.drafter, "draft", ids, at + k - T, T, draft_shift)
                token, probs = self.sampling.pick(logits, None if uniforms is None else uniforms[k:k + 1])
                ids.index_copy_(0, (at + k)[None], token)
                draft_dists.append(probs)
            q = None if draft_dists[0] is None else torch.cat(draft_dists)
        logits = forward(self.middle, "middle", ids, at - 1, g + 1, middle_shift)
        drafts = ids.index_select(0, at + torch.arange(g, device=ids.device))
        accepted, nxt, probs = self.sampling.verify(drafts, q, logits, uniforms=None if uniforms is None else uniforms[g:])
        ids.index_copy_(0, (at + accepted)[None], nxt[None])
        return accepted, probs

    def _look_up(self, ids: torch.Tensor, at: torch.Tensor, timed: bool) -> torch.Tensor | None:
        """gamma1 drafts looked up before `at` (the whole sequence buffer searched, later positions
        masked: one shape for every round), written at [at, at + gamma1); their point masses, or None
        when greedy."""
        g = self.gamma1
        begun = self.drafter.clock.now() if timed else None  # no clock inside a whole-round graph
        tokens = self.lookup.drafts(ids, at, g)
        ids.index_copy_(0, at + torch.arange(g, device=ids.device), tokens)
        if timed:
            self.drafter.timed(1, begun, count=g)
        if self.sampling.sampler.greedy:
            return None
        return point_masses(tokens, self.middle.model.cfg.vocab_size, torch.float32)

    def view(self, name: str, T: int) -> CursorView:
        key = (name, T)
        if key not in self.views:
            level = self.drafter if name == "draft" else self.middle
            self.views[key] = CursorView(level.cache, T, rope_by_slot=name == "draft")
        return self.views[key]

    def _pass(self, level, name: str, ids: torch.Tensor, start: torch.Tensor, T: int, shift: int):
        """Logits of `level` over ids[start : start + T] (device start), timed: all T rows for the
        middle level, the last one for the drafter. A level wrapped for graphs (graphs.GraphedModel:
        CUDA graphs, or --compile) replays its graph of this view; others run eagerly."""
        view = self.view(name, T)
        view.point(start, shift)
        tokens = ids.index_select(0, start + view.offsets)
        begun = level.clock.now()
        if hasattr(level.model, "run_view"):
            logits = level.model.run_view(view, tokens, name == "draft")
        else:
            logits = level.model(tokens, view, name == "draft")
        level.timed(T, begun)
        return logits

    def raw_pass(self, level, name: str, ids: torch.Tensor, start: torch.Tensor, T: int, shift):
        """_pass inside a whole-round graph: the bare model, untimed (the round is timed whole)."""
        view = self.view(name, T)
        view.point(start, shift)
        model = level.model.model if isinstance(level.model, GraphedModel) else level.model
        return model(ids.index_select(0, start + view.offsets), view, name == "draft")

    # ------------------------------------------------------------------ after the read (host)
    def settle(self, accepts: list[int], c: int, made: int) -> None:
        """The round's acceptance came back: the drafter's cache and level learn how far they got,
        statistics and origins are recorded."""
        g = self.gamma1
        if self.lookup is None:
            last_at = c + made - accepts[-1] - 1
            self.drafter.cache.wrote_to(last_at + g - 1)  # the last step fed up to (not including) this position
            self.drafter.adopt(last_at + g - 1)
            self.drafter.changed_from(c + made - 1)  # where the middle's last token replaced a draft
        origins, edge = [], f"{self.drafter.name}->middle"
        for a in accepts:
            self.drafter.stats.add_acceptance(edge, g, a)
            if self.middle.meter is not None:
                self.middle.meter.verified(edge, g, a)
            origins += [self.drafter.name] * a + [self.middle.name]
        self.origins = origins
        per_round = made / len(accepts)
        self.tokens_per_round += 0.3 * (per_round - self.tokens_per_round)


class RoundGraph:
    """Each drafter->middle round of a DeviceRoundProposer as one graph: its gamma1 drafter passes,
    the middle level's pass, sampling and verification. torch.compile'd whole (fullgraph) with
    `compiled`, captured as one CUDA graph with `capture`, else run eagerly (what the CPU tests check
    the graphs against). Inputs live in static tensors: the round's position, the caches' shifts
    between positions and slots, the round's uniforms; the sequence's ids and the caches' buffers
    are written in place."""

    def __init__(self, proposer: DeviceRoundProposer, compiled: bool = False, capture: bool = False,
                 options: dict | None = None):
        self.proposer, self.capture = proposer, capture
        device = proposer.middle.cache.k.device
        g = proposer.gamma1
        self.at = torch.zeros((), dtype=torch.long, device=device)
        self.shifts = torch.zeros(2, dtype=torch.long, device=device)  # drafter's, middle's
        self.uniforms = torch.zeros(2 * g + 1, dtype=torch.float64, device=device)
        for name, T in (("draft", FIRST_FEED), ("draft", 1), ("middle", g + 1)):  # made before any trace
            if name == "middle" or proposer.lookup is None:
                proposer.view(name, T)
        self.fn = self._round
        if compiled:
            self.fn = compile_static(self._round, options)
        self.graph, self.outputs = None, None
        self.builds = 0  # compilations and captures: the rounds that paid one are not typical
        self.runs = 0

    def _round(self, ids, at, shifts, uniforms):
        p = self.proposer
        return p.round(ids, at, FIRST_FEED, shifts[0], shifts[1], uniforms, p.raw_pass, timed=False)

    def run(self, ids: torch.Tensor, at: torch.Tensor, draft_shift: int, middle_shift: int,
            uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.at.copy_(at)
        self.shifts[0].fill_(draft_shift)
        self.shifts[1].fill_(middle_shift)
        if uniforms is not None:
            self.uniforms.copy_(uniforms)
        u = None if uniforms is None else self.uniforms
        self.runs += 1
        if not self.capture:
            if self.runs == 1 and self.fn is not self._round:
                self.builds += 1  # the first call compiles
                graphs_made["graphs"] += 1
            return self.fn(ids, self.at, self.shifts, u)
        if self.graph is None:
            models = tuple(lv.model for lv in (self.proposer.drafter, self.proposer.middle) if lv.model is not None)
            self.graph, self.outputs = capture_graph(lambda: self.fn(ids, self.at, self.shifts, u), models, ids.device)
            self.builds += 1
        self.graph.replay()
        accepted, probs = self.outputs
        return accepted.clone(), probs  # the next replay overwrites the outputs; probs is read before it
