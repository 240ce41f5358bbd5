"""The engines: autoregressive, single-level speculative, retrieval self-speculation, hierarchical.

All four are one loop over levels. A `Level` is a model plus a cache plus the list of tokens the
cache holds; `Level.run(context, n)` brings the cache in line with `context` (rolling back what
differs, feeding what is missing) and returns the logits of the last n positions. Proposers
extend a context by n tokens and return the distributions they drew them from:

    autoregressive proposer   one level sampling token by token (the drafter, or the middle level)
    speculative proposer      a source proposer drafts gamma tokens, this level verifies them in one
                              pass; what it returns is distributed exactly as this level's model

The top level verifies gamma proposals per pass against the full cache and commits.

    mode            proposer under the full cache
    autoregressive  none (one token per full pass)
    speculative     drafter + StreamingLLM cache
    retrieval       target + retrieval cache
    triforce        target + retrieval cache, fed by drafter + StreamingLLM cache

With `adaptive`, a generator builds the mode's levels and before each full pass picks whichever of
the modes those levels make (and its gamma) its measurements predict cheapest (adaptive.py).
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from triforce.model.errors import UserError
from triforce.model.transformer import Transformer

from .adaptive import SUB_MODES, Chooser
from .caches import FullCache, StreamingCache
from .config import GenerationConfig
from .models import CacheSizes, Models, Prefilled, self_drafter
from .retrieval import RebuildPolicy, RetrievalCache, check_budget
from .sampling import Sampler, draw, verify_greedy, verify_sampled
from .stats import Stats

from .modes import MODES, retrieves


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Level:
    """A model running against one cache; `tokens` are the sequence tokens the cache holds."""

    def __init__(self, name: str, model: Transformer, cache, stats: Stats):
        self.name, self.model, self.cache, self.stats = name, model, cache, stats
        self.tokens: list[int] = []
        self.meter: Chooser | None = None  # an adaptive generator's chooser, which times decode passes

    def common_prefix(self, context: list[int], stable: int) -> int:
        """Length of the shared prefix of self.tokens and context; both agree below `stable`."""
        n = min(stable, len(self.tokens), len(context))
        limit = min(len(self.tokens), len(context))
        while n < limit and self.tokens[n] == context[n]:
            n += 1
        return n

    def run(self, context: list[int], n_out: int, stable: int, progress: Callable | None = None) -> torch.Tensor:
        """Logits (n_out, V) predicting the tokens after each of the last n_out positions of context."""
        keep = min(self.common_prefix(context, stable), len(context) - n_out)
        self.rollback(keep)
        device = self.model.embed.weight.device
        synchronize(device)
        captures = getattr(self.model, "captures", 0)
        start = time.perf_counter()
        feed = context[keep:]
        logits = []
        try:
            for i in range(0, len(feed), self.cache.max_feed):
                piece = feed[i:i + self.cache.max_feed]
                out_needed = n_out - (len(feed) - i - len(piece))  # outputs this piece must return
                ids = torch.tensor(piece, dtype=torch.long, device=device)
                # a piece whose logits nobody reads computes only its last row: the output head over
                # every position of a 4,096-token piece is 0.2 TFLOP for SmolLM2, 1.1 for Qwen2.5
                out = self.model(ids, self.cache, last_only=out_needed <= 1)
                if out_needed > 0:
                    logits.append(out[-out_needed:])
                self.tokens.extend(piece)
                if progress is not None:
                    progress(len(piece))
        except BaseException:
            self.cache.rollback(len(self.tokens))  # a half-done forward (e.g. Ctrl-C) leaves no trace
            raise
        synchronize(device)
        seconds = time.perf_counter() - start
        self.stats.add_pass(self.name, seconds)
        if self.meter is not None and self.stats.phase != "prefill":
            # a pass that captured a CUDA graph paid a one-time cost, not what the next one will
            self.meter.passed(self.name, len(feed), seconds, typical=getattr(self.model, "captures", 0) == captures)
        return torch.cat(logits)[-n_out:]

    def rollback(self, length: int) -> None:
        if length < len(self.tokens):
            self.cache.rollback(length)
            del self.tokens[length:]


class Sampling:
    """The sampler plus its generator, shared by every level so runs are reproducible by seed."""

    def __init__(self, cfg: GenerationConfig, device: torch.device):
        self.sampler = Sampler(cfg.temperature, cfg.top_p, cfg.top_k)
        self.generator = torch.Generator(device="cpu").manual_seed(cfg.seed)

    def pick(self, logits: torch.Tensor) -> tuple[list[int], torch.Tensor | None]:
        """Tokens sampled from each row, and the rows' distributions (None when greedy)."""
        if self.sampler.greedy:
            return logits.argmax(dim=-1).tolist(), None
        probs = self.sampler.probs(logits).cpu()
        return [draw(p, self.generator) for p in probs], probs

    def verify(self, drafts: list[int], draft_probs, logits: torch.Tensor) -> tuple[int, int, torch.Tensor | None]:
        """(accepted, next token, this level's distributions (g+1, V) or None when greedy)."""
        if self.sampler.greedy:
            n, nxt = verify_greedy(drafts, logits.argmax(dim=-1).tolist())
            return n, nxt, None
        probs = self.sampler.probs(logits).cpu()
        n, nxt = verify_sampled(drafts, draft_probs, probs, self.generator)
        return n, nxt, probs


class AutoregressiveProposer:
    def __init__(self, level: Level, sampling: Sampling):
        self.level, self.sampling = level, sampling

    def propose(self, context: list[int], n: int, stable: int):
        tokens, dists = [], []
        for _ in range(n):
            logits = self.level.run(context + tokens, 1, stable)
            picked, probs = self.sampling.pick(logits)
            tokens.append(picked[0])
            dists.append(None if probs is None else probs[0])
        self.origins = [self.level.name] * n  # the level that produced each token (for display)
        return tokens, None if dists[0] is None else torch.stack(dists)


class SpeculativeProposer:
    """This level verifies `gamma` drafts of its source proposer per pass; returns n tokens drawn
    exactly from this level's model, with this level's distribution for each (passed upward)."""

    def __init__(self, level: Level, source, gamma: int, sampling: Sampling, stats_key: str):
        self.level, self.source, self.gamma, self.sampling, self.key = level, source, gamma, sampling, stats_key

    def propose(self, context: list[int], n: int, stable: int):
        tokens, dists, origins = [], [], []
        while len(tokens) < n:
            drafts, draft_probs = self.source.propose(context + tokens, min(self.gamma, n - len(tokens)), stable)
            logits = self.level.run(context + tokens + drafts, len(drafts) + 1, stable)
            accepted, nxt, probs = self.sampling.verify(drafts, draft_probs, logits)
            self.level.stats.add_acceptance(self.key, len(drafts), accepted)
            if self.level.meter is not None:
                self.level.meter.acceptance.record(self.key, len(drafts), accepted)
            tokens += drafts[:accepted] + [nxt]
            origins += self.source.origins[:accepted] + [self.level.name]
            if probs is not None:
                dists += list(probs[:accepted + 1])
        self.origins = origins[:n]
        return tokens[:n], torch.stack(dists[:n]) if dists else None


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
        self.sizes = sizes = CacheSizes.of(cfg, mode, max_len)
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
        self.full = Level("verify", target, full_cache, self.stats)
        self.middle = self.drafter = self.rebuilds = None
        if sizes.budget is not None:
            cache = RetrievalCache(target.kv_shape(), sizes.budget, cfg.chunk_size, scratch=sizes.scratch)
            self.middle = Level("middle", proposing, cache, self.stats)
            self.rebuilds = RebuildPolicy(cfg.rebuild_threshold)
        if drafter is not None:
            cache = StreamingCache(drafter.kv_shape(), drafter.rotary, sizes.sinks, sizes.window,
                                   slack=sizes.streaming_slack)
            self.drafter = Level("draft", drafter, cache, self.stats)
        self.chooser, self.agree = None, agree
        self._new_chooser()
        self.proposers = {m: self._compose(m) for m in SUB_MODES[mode]}
        self.gamma = self.proposers[mode][1]  # the fixed mode's proposals per full pass
        self.context: list[int] = []
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

    def resume(self, prompt: list[int], queries: list[torch.Tensor], first: int | None = None) -> None:
        """Stand where prefill(prompt) left a generator, given a full cache that holds at least the
        prompt's K/V in its first len(prompt) slots (a snapshot's, one loaded from disk, or this
        generator's own after a conversation) and the last prompt token's rotated queries (Hq, D) per
        layer. With `first`, that sampled token follows the prompt (as after prefill); without it the
        context ends with the prompt (as after truncate(len(prompt)): a chat's user turn comes next).
        Sampling restarts from the seed, and statistics and an adaptive chooser's figures start
        afresh, so what follows does not depend on where the prompt's cache came from."""
        self.stats.phase = "prefill"  # the retrieval build and the drafter's window belong to prefill
        try:
            self.full.cache.rollback(len(prompt))
            self.full.cache.queries = [q[None] for q in queries]
            self.full.tokens = list(prompt)
            self.context = list(prompt) + ([] if first is None else [first])
            self.committed = len(self.context)
            self.sampling.generator.manual_seed(self.cfg.seed)
            self._new_chooser()  # an adaptive run learns afresh, as a new process would
            self.reset_stats()
            self.stats.prompt_tokens = len(prompt)
            if self.middle is not None:
                check_budget(self.cfg.budget, self.cfg.chunk_size, len(prompt))
                self._rebuild(query_index=-1)
            if self.drafter is not None and self.drafter.tokens != list(prompt):
                self._restart_drafter(list(prompt))
        finally:
            self.stats.phase = "decode"

    def _new_chooser(self) -> None:
        """An adaptive generator's chooser, knowing nothing yet, timing every level's passes."""
        if self.cfg.adaptive and len(SUB_MODES[self.mode]) > 1:
            self.chooser = Chooser(SUB_MODES[self.mode], self.cfg.gamma1, self.cfg.gamma2, self.agree)
            for level in (self.full, self.middle, self.drafter):
                if level is not None:
                    level.meter = self.chooser

    def _compose(self, mode: str):
        """(proposer under the full cache, its tokens per full pass) of `mode` from this generator's levels."""
        cfg, s = self.cfg, self.sampling
        if mode == "autoregressive":
            return None, 0
        if mode == "speculative":
            return AutoregressiveProposer(self.drafter, s), cfg.gamma1
        if mode == "retrieval":
            return AutoregressiveProposer(self.middle, s), cfg.gamma2
        drafts = AutoregressiveProposer(self.drafter, s)
        return SpeculativeProposer(self.middle, drafts, cfg.gamma1, s, "draft->middle"), cfg.gamma2

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
        self.context = self.context + list(tokens)
        try:
            logits = self.full.run(self.context, 1, self.committed, progress)
            first, _ = self.sampling.pick(logits)
            self.context.append(first[0])
            self.committed = len(self.context)
            if self.middle is not None:
                self._rebuild(query_index=-1)  # score chunks with the newest token's query
            if self.drafter is not None and first_prompt:
                self._prefill_drafter(self.context[:-1])
        finally:
            synchronize(self.device)
            self.stats.phase = "decode"
        self.stats.prefill_seconds += time.perf_counter() - start
        self.stats.prompt_tokens += len(tokens)
        return first[0]

    def reset_stats(self) -> Stats:
        """Fresh statistics (e.g. per chat answer); returns the old ones."""
        old, self.stats = self.stats, Stats()
        for level in (self.full, self.middle, self.drafter):
            if level is not None:
                level.stats = self.stats
        return old

    def _prefill_drafter(self, prompt: list[int]) -> None:
        """StreamingLLM state after a prompt: the sinks and the last window tokens, nothing between.

        Running the drafter over just those tokens costs a window, not the whole prompt."""
        level, cache = self.drafter, self.drafter.cache
        sinks, window = cache.sinks, cache.window
        if len(prompt) <= sinks + window:
            level.run(prompt, 1, 0)
            return
        visible = prompt[:sinks] + prompt[-window:]
        level.run(visible, 1, 0)
        cache.length = len(prompt)  # the sequence the slots stand for
        cache.evictions += 1  # tokens between sinks and window were dropped: slots no longer map 1:1
        level.tokens = list(prompt)

    def truncate(self, length: int) -> None:
        """Forget context[length:] and make context[:length] the committed state, as if generation had
        stopped there (chat: tokens generated past a stop token, an interrupted answer or turn).

        The full and draft levels keep what they share with the shorter context and resync lazily
        (Level.run); the retrieval cache cannot roll back below its base, so it is rebuilt."""
        if not 0 < length <= len(self.context):
            raise ValueError(f"cannot truncate a context of {len(self.context)} tokens to {length}")
        stable = min(length, self.committed) - 1  # below this every level agrees with the context
        held = self.full.common_prefix(self.context[:length], stable)
        if held < length - 1:  # e.g. a turn extend() did not finish: only its start can be kept
            raise ValueError(f"the full cache holds {held} of the {length - 1} tokens to keep")
        del self.context[length:]
        self.committed = length
        self.full.rollback(held)
        if self.drafter is not None:
            try:
                self.drafter.rollback(self.drafter.common_prefix(self.context, stable))
            except RuntimeError:  # further back than the StreamingLLM window: start it again
                self._restart_drafter(self.context[:-1])
        if self.middle is not None:
            self._rebuild(query_index=-1)

    def _restart_drafter(self, prompt: list[int]) -> None:
        """Empty the drafter's StreamingLLM cache and prefill it cheaply for `prompt`."""
        cache = self.drafter.cache
        cache.used = cache.length = cache.evictions = 0  # as freshly built
        self.drafter.tokens = []
        self._prefill_drafter(prompt)

    def _rebuild(self, query_index: int) -> None:
        n = self.committed - 1
        queries = [q[query_index] for q in self.full.cache.queries]
        self.middle.cache.build(self.full.cache, n, queries)
        self.middle.tokens = self.context[:n]
        self.rebuilds.reset()
        self.stats.rebuilds += 1

    # ------------------------------------------------------------------ decode
    def generate(self, max_new_tokens: int | None = None, on_tokens: Callable | None = None,
                 stop_ids: frozenset = frozenset()) -> list[int]:
        """Generate after prefill; the first token (from prefill) counts. Returns new tokens."""
        budget = max_new_tokens or self.cfg.max_new_tokens
        out = [self.context[-1]]
        if on_tokens:  # on_tokens(tokens, levels): levels[i] names the level that produced tokens[i]
            on_tokens([self.context[-1]], [self.full.name])
        moved = self.full.cache.bytes_moved  # an offloaded cache counts its copies
        start = time.perf_counter()
        while len(out) < budget and out[-1] not in stop_ids:
            new = self.step()
            new = new[:budget - len(out)]
            for i, t in enumerate(new):
                if t in stop_ids:
                    new = new[:i + 1]
                    break
            out += new
            if on_tokens:
                on_tokens(new, self.origins[:len(new)])
        synchronize(self.device)
        self.stats.decode_seconds += time.perf_counter() - start
        if self.chooser is not None:
            self.stats.estimates = self.chooser.summary()
        if self.full.cache.timings() is not None:  # decode bytes only: prefill's copies are left out
            self.stats.bytes_moved = (self.stats.bytes_moved or 0) + self.full.cache.bytes_moved - moved
        self.stats.new_tokens += len(out)
        self.stats.decode_tokens += len(out) - 1
        return out

    def step(self) -> list[int]:
        """One full-cache pass: propose, verify, commit. Returns the newly committed tokens."""
        stable = self.committed - 1
        mode, gamma = self.mode, self.gamma
        start = time.perf_counter()
        if self.chooser is not None:
            plan = self.chooser.choose()
            mode, gamma = plan.mode, plan.gamma
            self.stats.add_mode(mode)
        proposer = self.proposers[mode][0]
        if proposer is None:
            drafts, draft_probs = [], None
        else:
            drafts, draft_probs = proposer.propose(self.context, gamma, stable)
        logits = self.full.run(self.context + drafts, len(drafts) + 1, stable)
        accepted, nxt, _ = self.sampling.verify(drafts, draft_probs, logits)
        if drafts:
            edge = ("draft" if mode == "speculative" else "middle") + "->verify"
            self.stats.add_acceptance(edge, len(drafts), accepted)
            if self.chooser is not None:
                self.chooser.acceptance.record(edge, len(drafts), accepted)
        new = drafts[:accepted] + [nxt]
        self.origins = (proposer.origins[:accepted] if drafts else []) + [self.full.name]
        self.context += new
        self.committed = len(self.context)
        self.full.rollback(self.committed - 1)
        if self.middle is not None:
            self._update_middle(accepted, len(drafts) if retrieves(mode) else 0)
        if self.chooser is not None:
            self.chooser.finished(mode, time.perf_counter() - start)
        return new

    def _update_middle(self, accepted: int, proposed: int) -> None:
        """Copy exact KV of committed tokens into the retrieval cache, or rebuild it."""
        n = self.committed - 1
        if proposed:  # a pass the middle level proposed for tells how well its retrieval still serves
            self.rebuilds.record(accepted, proposed)
        if self.rebuilds.due(self.middle.cache, n):
            self._rebuild(query_index=accepted)  # the query of the last committed token
        else:
            self.middle.cache.absorb(self.full.cache, n)
            self.middle.tokens = self.context[:n]
