"""The engines: autoregressive, single-level speculative, retrieval self-speculation, hierarchical.

All four are one loop over levels (levels.py): the sequence lives on the model's device, each level
is a model plus a cache holding a prefix of it, and proposers write a round's tokens into the
sequence. Tokens, distributions and acceptance stay on the device, and the host reads once per
full-cache round (plus, in triforce's host-driven rounds, once per middle-level pass, whose
acceptance decides where the drafter goes next; its device rounds, rounds.py, make no such read).

The top level verifies gamma proposals per pass against the full cache and commits.

    mode            proposer under the full cache
    autoregressive  none (one token per full pass)
    speculative     drafter + StreamingLLM cache
    retrieval       target + retrieval cache
    triforce        target + retrieval cache, fed by drafter + StreamingLLM cache

With `adaptive`, a generator builds the mode's levels and before each full pass picks whichever of
the modes those levels make (and its gamma) its measurements predict cheapest (adaptive.py); where
the drafter is a model, those modes include the drafting ones with lookups in its place
(`lookup`, `triforce-lookup`: modes.LOOKUP_VARIANT), proposed by a level named "lookup".
"""
from __future__ import annotations

import copy
import time
from collections import deque
from contextlib import nullcontext
from typing import Callable

import numpy as np
import torch

from triforce.model import cpu_pool
from triforce.model.errors import UserError
from triforce.model.transformer import Transformer

from .adaptive import Chooser, Plan
from .caches import FullCache, StreamingCache
from .config import GenerationConfig
from .levels import (AutoregressiveProposer, Level, LookupProposer, PassClock, Sampling, Sequence,
                     SpeculativeProposer, TokenReads)
from .lookup import LookupDrafter, MatchIndex
from .models import CacheSizes, Models, Prefilled, self_drafter
from .rounds import DeviceRoundProposer
from .retrieval import RebuildPolicy, RetrievalCache, check_budget
from .stats import Stats
from . import windows

from .modes import ALL_LEVELS, MODES, SHAPE, adaptive_modes, drafts as modes_draft, proposing_level, retrieves


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# The most tokens a drafter feeds to catch up after passes it sat out (another mode ran): those
# before them are skipped, as its prefill skips all but the sinks and the window. Each catch-up took
# a pass of every missed token: 14-64 after an adaptive run's probe, ~25% of a 128-token run at 4K
# (session 18). A drafter only proposes, so what it skips changes acceptance, never the output.
DRAFT_CATCH_UP = 8


class Generator:
    """A stateful generation session: prefill once, then generate (and extend, for chat)."""

    def __init__(self, models: Models, cfg: GenerationConfig, mode: str, max_len: int,
                 full_cache_factory: Callable | None = None, prefilled: "Prefilled | None" = None,
                 agree: Callable[[int], int] | None = None):
        """full_cache_factory(shape, slots, reserve_bytes) makes the full cache (default: a FullCache on
        the target's device); `reserve_bytes` is what the other caches will take after it. With
        cfg.adaptive each full pass runs the cheapest mode `mode`'s levels make, as measured
        (adaptive.Chooser); agree(i) returns rank 0's i under tensor parallelism, so that every rank
        runs the same plan."""
        if mode not in MODES:
            raise UserError(f"unknown mode '{mode}': choose one of {', '.join(MODES)}")
        self.models, self.cfg, self.mode, self.max_len = models, cfg, mode, max_len
        target = models.target
        self.device = target.embed.weight.device
        self.stats = Stats()
        self.sampling = Sampling(cfg, self.device)
        self.prompt_logits: torch.Tensor | None = None  # the prompt's last position, after prefill()
        # lookups: the drafter itself (--draft lookup), or weighed beside a model drafter (adaptive)
        beside = cfg.adaptive and cfg.lookup and models.lookup is None and modes_draft(mode)
        # (a copy of the models' own: a reference text, refer_lookups_to, belongs to this generator)
        self.lookup = copy.copy(models.lookup) if models.lookup is not None else LookupDrafter() if beside else None
        self.modes = adaptive_modes(mode, beside) if cfg.adaptive else (mode,)
        self.sizes = sizes = CacheSizes.of(cfg, mode, max_len, model_drafter=models.lookup is None,
                                           lookups=len(self.modes) > 1 and self.lookup is not None and modes_draft(mode))
        proposing = models.proposing_target or target
        drafter = None
        if sizes.streaming_slack is not None:
            drafter = models.drafter or self_drafter(proposing, models.self_draft_rotary)
        if prefilled:
            full_cache = prefilled.cache
        else:
            make_full = full_cache_factory or (lambda shape, slots, reserve: FullCache(shape, slots, cfg.prefill_piece(self.device)))
            reserve = sizes.after_full_bytes(target.kv_shape(), drafter.kv_shape() if drafter else None)
            full_cache = make_full(target.kv_shape(), sizes.full, reserve)
        # a verification pass in one forward, however small the prompt's pieces: split, it cost a
        # forward (a read of every weight) per piece, and kept only the last piece's queries
        full_cache.max_feed = max(full_cache.max_feed, sizes.widest + 1)
        self.clock = PassClock(self.device)
        # room past max_len: a round may propose (and the middle level overshoot) past the last token kept
        self.seq = Sequence(max_len + 2 * sizes.margin, self.device)
        for model in (target, proposing, drafter):  # every position of the sequence has its RoPE values before any pass
            if getattr(model, "rotary", None) is not None:
                model.rotary.cover(self.seq.ids.shape[0])
        self.full = Level("verify", target, full_cache, self.stats, self.clock)
        self.middle = self.drafter = self.rebuilds = None
        if sizes.budget is not None:
            cache = RetrievalCache(target.kv_shape(), sizes.budget, cfg.chunk_size, scratch=sizes.scratch)
            self.middle = Level("middle", proposing, cache, self.stats, self.clock)
            self.rebuilds = RebuildPolicy(cfg.rebuild_threshold)
        if drafter is not None:
            cache = StreamingCache(drafter.kv_shape(), drafter.rotary, sizes.sinks, sizes.window,
                                   slack=sizes.streaming_slack)
            self.drafter = Level("draft", drafter, cache, self.stats, self.clock, catch_up=DRAFT_CATCH_UP)
        # a lookup drafter has no model and no cache: a level only in name, which times its drafts
        # (named as the drafter where it is the drafter, "lookup" beside a model drafter)
        self.lookup_level = None
        if self.lookup is not None and modes_draft(mode):
            self.lookup_level = Level("lookup" if beside else "draft", None, None, self.stats, self.clock)
        self.seq.levels = [lv for lv in (self.full, self.middle, self.drafter, self.lookup_level) if lv is not None]
        self.chooser, self.agree = None, agree
        # the chooser prices a lookup by how long a match it drafts from, which the host finds in its
        # own copy of the text (no device read)
        self.matches = MatchIndex(self.lookup.longest) if self.lookup_level is not None and len(self.modes) > 1 else None
        self.device_rounds = cfg.rounds_on_device(self.device)
        self._new_chooser()
        self.proposers = {m: self._compose(m) for m in self.modes}
        self.gamma = self.proposers[mode][1]  # the fixed mode's proposals per full pass
        self.max_width = sizes.widest  # the most positions a full pass verifies
        # plain decoding with its next pass queued before the host reads a token (_queued_tokens): run
        # fixed, or chosen by an adaptive run's chooser (one process: a tensor-parallel group's ranks
        # agree on each choice, one pass at a time)
        plain = "autoregressive" in self.modes and (self.chooser is None or agree is None)
        self.reads = TokenReads(self.device) if plain and cfg.queues_ahead(self.device) else None
        self.context: list[int] = []  # the host's copy of seq.ids[:committed], extended once per round
        self.committed = 0  # context[:committed] is final; the last token is not yet in the full cache
        if prefilled:
            self.resume(prefilled.prompt, prefilled.queries, prefilled.first)

    # ------------------------------------------------------------------ resuming a prefilled prompt
    def snapshot(self) -> "Prefilled":
        """What another generator needs to start from this one's prefill (right after prefill()):
        the full cache (its prompt part stays valid: decoding only writes after it) and the last
        prompt token's queries, which score the retrieval chunks."""
        prompt = self.context[:-1]
        queries = [q[-1].clone() for q in self.full.cache.queries]
        return Prefilled(self.full.cache, prompt, self.context[-1], queries, self.stats.prefill_seconds)

    def resume(self, prompt: list[int], queries: list[torch.Tensor], first: int | None = None,
               learned: bool = False, logits: torch.Tensor | None = None, window: dict | None = None,
               seed: int | None = None) -> None:
        """Stand where prefill(prompt) left a generator, given a full cache that holds at least the
        prompt's K/V in its first len(prompt) slots (a snapshot's, one loaded from disk, or this
        generator's own after a conversation) and the last prompt token's rotated queries (Hq, D) per
        layer. With `first`, that sampled token follows the prompt (as after prefill); without it the
        context ends with the prompt (as after truncate(len(prompt)): a chat's user turn comes next).
        Sampling restarts from the seed (`seed`, or the config's), and statistics and an adaptive chooser's figures start
        afresh, so what follows does not depend on where the prompt's cache came from; with `learned`
        the chooser keeps what it learned (as a chat's later turns do: a benchmark of the steady state).
        With `logits` (the prompt's last position, as prefill kept them in `prompt_logits`), the first
        token is sampled from them right after the seed, so a run resumed from a saved prompt draws
        what the same run after prefill(prompt) draws. With `window` (drafter_window() after
        prefill(prompt) or an earlier resume, in this process or kept on disk) the drafter's StreamingLLM
        cache is restored from it instead of computed again (SmolLM2 drafting for itself: 0.5 s)."""
        self.stats.phase = "prefill"  # the retrieval build and the drafter's window belong to prefill
        try:
            self.full.cache.rollback(len(prompt))
            self.full.cache.queries = [q[None] for q in queries]
            self.full.queried_from = len(prompt) - 1
            self.sampling.generator.manual_seed(self.cfg.seed if seed is None else seed)
            if logits is not None:
                first = int(self.sampling.pick(logits.to(self.device))[0][0])
            context = list(prompt) + ([] if first is None else [first])
            if self.matches is not None:
                self.matches.rollback(0)  # another text, perhaps: copied afresh (128K tokens: 4 ms)
            self.context = context
            self.seq.put(0, self.context)
            self.full.adopt(len(prompt))
            self.committed = len(self.context)
            if not (learned and self.chooser is not None):
                self._new_chooser()  # an adaptive run learns afresh, as a new process would
            self.reset_stats()
            self.stats.prompt_tokens = len(prompt)
            if self.middle is not None:
                check_budget(self.cfg.budget, self.cfg.chunk_size, len(prompt))
                self._rebuild()
            if self.drafter is not None and not self.drafter.held == self.drafter.agreed == len(prompt):
                if not windows.restore(self.drafter, len(prompt), window):
                    windows.restart(self.drafter, self.seq, len(prompt))
        finally:
            self.stats.phase = "decode"

    def restored(self, tokens: list[int]) -> None:
        """The full cache's first len(tokens) slots were filled from disk with these tokens' K/V: the
        prefill that follows (extend) starts after them."""
        self.seq.put(0, tokens)
        self.full.adopt(len(tokens))

    def refer_lookups_to(self, tokens: list[int]) -> bool:
        """Have lookups search `tokens` too, beside the sequence: a book chat's book with its line wraps
        undone (lookup.py says why). Before the first round: a captured round holds what it reads.
        Whether this run looks anything up (else there is nothing to refer)."""
        if self.lookup is None or len(tokens) <= self.lookup.longest:
            return False
        self.lookup.reference = torch.tensor(tokens, dtype=torch.long, device=self.device)
        if self.matches is not None:
            self.matches.reference = np.asarray(tokens, dtype=np.int64)
        return True

    def _new_chooser(self) -> None:
        """An adaptive generator's chooser, knowing nothing yet, timing every level's passes."""
        if len(self.modes) > 1:
            looked_up = (self.lookup_level.name,) if self.lookup_level is not None else ()
            self.chooser = Chooser(self.modes, self.cfg.gamma1, self.cfg.gamma2, self.agree,
                                   device_rounds=self.device_rounds, looked_up=looked_up,
                                   lookup_gamma=self.cfg.lookup_gamma)
            for level in self.seq.levels:
                level.meter = self.chooser

    def _compose(self, mode: str):
        """(proposer under the full cache, its tokens per full pass) of `mode` from this generator's levels."""
        cfg, s, shape = self.cfg, self.sampling, SHAPE[mode]
        looked_up = self.models.lookup is not None or "lookup" in ALL_LEVELS[mode]
        if shape == "autoregressive":
            return None, 0
        if shape == "speculative":
            return self._drafts(looked_up), cfg.gamma1
        if shape == "retrieval":
            return AutoregressiveProposer(self.middle, s), cfg.gamma2
        if self.device_rounds:
            if looked_up:
                return DeviceRoundProposer(self.lookup_level, self.middle, cfg.gamma1, s, self.lookup), cfg.gamma2
            return DeviceRoundProposer(self.drafter, self.middle, cfg.gamma1, s), cfg.gamma2
        source = self._drafts(looked_up)
        return SpeculativeProposer(self.middle, source, cfg.gamma1, s, f"{source.level.name}->middle"), cfg.gamma2

    def _drafts(self, looked_up: bool):
        """The drafter's proposer: a model sampling token by token, or a lookup."""
        if looked_up:
            return LookupProposer(self.lookup, self.lookup_level, self.models.target.cfg.vocab_size, self.sampling)
        return AutoregressiveProposer(self.drafter, self.sampling)

    # ------------------------------------------------------------------ prefill
    def prefill(self, prompt: list[int], progress: Callable | None = None) -> int:
        """Process the prompt; returns the first generated token (sampled from the target)."""
        if self.context:
            raise RuntimeError("prefill() starts a session; use extend() to add turns")
        return self.extend(prompt, progress)

    def extend(self, tokens: list[int], progress: Callable | None = None) -> int:
        """Append tokens after the context (a prompt, or a chat turn after an answer) without
        re-processing what is cached; returns the next token, sampled from the target."""
        if not tokens:
            raise UserError("the prompt is empty; give some text")
        total = len(self.context) + len(tokens)
        if total + self.cfg.max_new_tokens > self.max_len:
            raise UserError(f"prompt ({total} tokens) plus {self.cfg.max_new_tokens} new tokens exceeds "
                            f"the context of {self.max_len}; shorten the prompt (Settings.context) or lower GenerationConfig.max_new_tokens")
        if self.middle is not None:
            check_budget(self.cfg.budget, self.cfg.chunk_size, total)
        start = time.perf_counter()
        self.stats.phase = "prefill"
        first_prompt = not self.context
        self.seq.put(len(self.context), list(tokens))
        self.context.extend(tokens)
        try:
            logits = self.full.run(self.seq, len(self.context), 1, progress, one_off=True)
            if first_prompt:  # what a saved prompt keeps to draw its first token again (runtime/prompt_cache.py)
                self.prompt_logits = logits.detach().clone()
            token, _ = self.sampling.pick(logits)
            self.seq.write(len(self.context), token)
            first = int(token[0])
            self.context.append(first)
            self.committed = len(self.context)
            if self.middle is not None:
                self._rebuild()  # score chunks with the newest token's query
            if self.drafter is not None:
                self.drafter.skip_from = len(self.context) - 1  # a later turn's text is fed whole
                if first_prompt:
                    windows.prefill(self.drafter, self.seq, len(self.context) - 1)
        finally:
            synchronize(self.device)
            self.stats.phase = "decode"
        self.stats.prefill_seconds += time.perf_counter() - start
        self.stats.prompt_tokens += len(tokens)
        return first

    def reset_stats(self) -> Stats:
        """Fresh statistics (e.g. per chat answer), in the phase the old ones were in; returns the old
        ones. (Fresh ones in the decode phase let resume() count the drafter's window refill as a
        decode pass: 260 tokens, compiled once, 3.5 s of a bench row's 'ms d' in a 0.19 s run.)"""
        old, self.stats = self.stats, Stats()
        self.stats.phase = old.phase
        for level in self.seq.levels:
            level.stats = self.stats
        return old

    def truncate(self, length: int) -> None:
        """Forget context[length:] and make context[:length] the committed state, as if generation had
        stopped there (chat: tokens generated past a stop token, an interrupted answer or turn).

        The full and draft levels keep what they share with the shorter context and resync lazily
        (Level.run); the retrieval cache cannot roll back below its base, so it is rebuilt."""
        if not 0 < length <= len(self.context):
            raise ValueError(f"cannot truncate a context of {len(self.context)} tokens to {length}")
        held = min(self.full.agreed, length)
        if held < length - 1:  # e.g. a turn extend() did not finish: only its start can be kept
            raise ValueError(f"the full cache holds {held} of the {length - 1} tokens to keep")
        del self.context[length:]
        if self.matches is not None:
            self.matches.rollback(length)
        self.committed = length
        self.full.rollback(held)
        if self.drafter is not None:
            try:
                self.drafter.rollback(min(self.drafter.agreed, length))
            except RuntimeError:  # further back than the StreamingLLM window: start it again
                windows.restart(self.drafter, self.seq, length - 1)
        if self.middle is not None:
            self._rebuild()

    def drafter_window(self) -> dict | None:
        """The drafter's StreamingLLM cache right after prefill() or resume(), for resume(window=...)
        (windows.taken); None without a drafter or where it has moved on."""
        return windows.taken(self.drafter)

    def _rebuild(self) -> None:
        """The retrieval cache built anew over the full cache's committed tokens, its chunks scored by
        the queries of the newest one the full cache has run (the last committed token's own come
        with the next pass)."""
        n = self.committed - 1
        queries = self.full.queries_at(n - 1)
        self.middle.cache.build(self.full.cache, n, queries)
        self.middle.adopt(n)
        self.rebuilds.reset()
        self.stats.rebuilds += 1

    # ------------------------------------------------------------------ decode
    def generate(self, max_new_tokens: int | None = None, on_tokens: Callable | None = None,
                 stop_ids: frozenset = frozenset()) -> list[int]:
        """Generate after prefill() or extend(); the token they sampled comes first and counts.
        Returns the new tokens, at most max_new_tokens, ending at the first stop id. The context may
        hold more: the rest of the last round's committed tokens, past the budget or a stop. To go on
        from exactly what was returned, truncate(length before this call - 1 + len(returned)) first,
        as chat does after each answer."""
        budget = max_new_tokens or self.cfg.max_new_tokens
        out = [self.context[-1]]
        if on_tokens:  # on_tokens(tokens, levels): levels[i] names the level that produced tokens[i]
            on_tokens([self.context[-1]], [self.full.name])
        moved = self.full.cache.bytes_moved  # an offloaded cache counts its copies
        start = time.perf_counter()
        queued = self._queued_tokens(budget - len(out)) if self.reads is not None else None
        with self._decode_threads():
            try:
                while len(out) < budget and out[-1] not in stop_ids:
                    new = next(queued) if queued is not None else self.step()
                    new = new[:budget - len(out)]
                    for i, t in enumerate(new):
                        if t in stop_ids:
                            new = new[:i + 1]
                            break
                    out += new
                    if on_tokens:
                        on_tokens(new, self.origins[:len(new)])
            finally:  # also on Ctrl-C in a chat, before it truncates: not later, whenever it is collected
                if queued is not None:
                    queued.close()  # a pass queued past the last token taken is forgotten
        # no synchronize: every round ended with its tokens on the host; upkeep queued after them
        # (a retrieval absorb) is paid by whoever next waits
        self.stats.decode_seconds += time.perf_counter() - start
        if self.chooser is not None:
            self.stats.estimates = self.chooser.summary()
        if self.full.cache.timings() is not None:  # decode bytes only: prefill's copies are left out
            self.stats.bytes_moved = (self.stats.bytes_moved or 0) + self.full.cache.bytes_moved - moved
        self.stats.new_tokens += len(out)
        self.stats.decode_tokens += len(out) - 1
        return out

    def _decode_threads(self):
        """On CPU with our kernels: the decode loop's torch ops (sampling, verification) on one thread
        and the kernels on the pool's (model/cpu_pool.py kernels_threaded)."""
        model = self.full.model
        if self.device.type == "cpu" and isinstance(model, Transformer) and model.products_ours():
            return cpu_pool.kernels_threaded()
        return nullcontext()

    def _match(self) -> int | None:
        """How long a match the lookup drafts from after the context (for the chooser), if it looks up."""
        return self.matches.length(self.context) if self.matches is not None else None

    def step(self, plan: Plan | None = None) -> list[int]:
        """One full-cache pass: propose, verify, commit. Returns the newly committed tokens, which
        come back to the host once per round (the only wait, where no middle level verifies). An
        adaptive run's `plan` may have been chosen already (_queued_tokens)."""
        mode, gamma = self.mode, self.gamma
        start = time.perf_counter()
        if self.chooser is not None:
            plan = plan or self.chooser.choose(self._match())
            mode, gamma = plan.mode, plan.gamma
            self.stats.add_mode(mode)
        proposer = self.proposers[mode][0]
        if retrieves(mode):
            self._catch_up_middle()
        c = len(self.context)
        width, draft_probs, made = self._propose(proposer, c, gamma)
        logits = self.full.run(self.seq, c + width, width + 1)
        drafts = self.seq.ids[c:c + width]
        accepted, nxt, _ = self.sampling.verify(drafts, draft_probs, logits, limit=made)
        # the round's one read: how many drafts stood, the drafts, the next token (and, after device
        # rounds, how many the middle level made and each of its rounds' acceptance)
        parts = (accepted[None], drafts, nxt[None])
        if made is not None:
            parts += (made[None], proposer.pending)
        read = torch.cat(parts).tolist()
        n_accepted = read[0]
        new = read[1:1 + n_accepted] + [read[1 + width]]
        proposed = width
        if made is not None:
            proposed = read[2 + width]
            proposer.settle(read[3 + width:], c, proposed)
        self.seq.write(c + n_accepted, nxt[None])
        for level in self.seq.levels:
            level.report()
        if width:
            edge = f"{proposing_level(mode)}->verify"
            self.stats.add_acceptance(edge, proposed, n_accepted)
            if self.full.meter is not None:  # as every level records its own verifications (the chooser)
                self.full.meter.verified(edge, proposed, n_accepted)
        self.origins = (proposer.origins[:n_accepted] if width else []) + [self.full.name]
        self.context += new
        self.committed = len(self.context)
        self.full.rollback(self.committed - 1)
        if self.middle is not None and retrieves(mode):
            self._update_middle(n_accepted, proposed)
        # else the retrieval cache takes in this round's tokens when a round next proposes from it
        # (_catch_up_middle), all at once, in the same slots: an adaptive run in plain decoding paid
        # an absorb per token (0.19 ms of SmolLM2's 11 ms at 4K on a 2-core EPYC)
        if self.chooser is not None:
            self.chooser.finished(mode, time.perf_counter() - start, len(new))
        return new

    def _queued_tokens(self, wanted: int):
        """Plain decoding with one full pass queued ahead of the host: the pass that samples token i+1
        is queued before the host waits for token i (TokenReads: that wait covers token i's pass only),
        so the host's work between passes - reading, committing, streaming, launching - overlaps the
        device's. Each pass's input is the token the last one wrote into the sequence on the device.
        Yields each token as [token]: what step() returns in plain decoding, token for token (the same
        passes, the same draws in the same order).

        Closed after its last token (a stop id, the budget), a pass queued past it is forgotten: the
        full cache is left as step() leaves it (its last token not yet held) and the sampler's
        generator as it was before that pass drew. Its K/V write lands past the committed length.

        In an adaptive run the chooser picks each pass's plan before the host reads the last pass's
        token (choose's `ahead`): a choice one token staler than step()'s, which moves the speed, never
        the output distribution. Plain passes are queued so while it picks them; a round of another
        mode runs once nothing is in flight (step). The retrieval cache takes in the plain passes'
        tokens when a round next proposes from it (step), all at once: an absorb after each read
        would wait for the pass in flight, whose write it reads around."""
        queued: deque = deque()  # (token slot, the generator's state before the pass drew) per queued pass
        chooser, plan, made = self.chooser, None, 0
        resumed = time.perf_counter()
        try:
            while made < wanted:
                while len(queued) < 2 and made + len(queued) < wanted:
                    if chooser is not None:
                        plan = plan or chooser.choose(self._match(), ahead=bool(queued))
                        if plan.mode != "autoregressive":
                            break
                        plan = None
                    queued.append(self._queue_pass(len(self.context) + len(queued)))
                if not queued:  # another mode's round, with nothing in flight
                    new, plan = self.step(plan), None
                    made += len(new)
                    yield new
                    resumed = time.perf_counter()
                    continue
                slot, _ = queued.popleft()
                token = self.reads.read(slot)
                made += 1
                self.context.append(token)
                self.committed = len(self.context)
                self.full.report(in_flight=len(queued))
                self.origins = [self.full.name]
                if chooser is not None:  # a queued pass's round: from the last token's hand-over to this one's
                    self.stats.add_mode("autoregressive")  # counted as read: a pass queued past a stop is not
                    chooser.finished("autoregressive", time.perf_counter() - resumed, 1)
                yield [token]
                resumed = time.perf_counter()
        finally:
            if queued:
                if queued[0][1] is not None:
                    self.sampling.generator.set_state(queued[0][1])
                self.full.rollback(self.committed - 1)
                del self.full.timings[len(self.full.timings) - len(queued):]

    def _queue_pass(self, c: int) -> tuple[int, torch.Tensor | None]:
        """Queue the full pass over the sequence's first c tokens, the sampling of token c and its copy
        to the host, without waiting for anything."""
        state = None if self.sampling.sampler.greedy else self.sampling.generator.get_state()
        logits = self.full.run(self.seq, c, 1)
        token, _ = self.sampling.pick(logits)
        self.seq.write(c, token)
        return self.reads.send(token), state

    def _propose(self, proposer, c: int, gamma: int):
        """(positions the full pass verifies, their proposers' distributions or None, and the device
        count of real proposals among them, None when all are)."""
        if proposer is None:
            return 0, None, None
        if isinstance(proposer, DeviceRoundProposer):
            return proposer.propose(self.seq, c, gamma)
        return gamma, proposer.propose(self.seq, c, gamma), None

    def _catch_up_middle(self) -> None:
        """The retrieval cache up to the committed tokens, after rounds without it (plain, speculative,
        lookup; queued plain passes) left it behind (a truncate, a turn's extend or a resume rebuild it
        anyway)."""
        if self.middle is not None and self.middle.held < self.committed - 1:
            self._update_middle(0, 0)

    def _update_middle(self, accepted: int, proposed: int) -> None:
        """Copy exact KV of committed tokens into the retrieval cache, or rebuild it."""
        n = self.committed - 1
        if proposed:  # a pass the middle level proposed for tells how well its retrieval still serves
            self.rebuilds.record(accepted, proposed)
        if self.rebuilds.due(self.middle.cache, n):
            self._rebuild()
        else:
            self.middle.cache.absorb(self.full.cache, n)
            self.middle.adopt(n)
