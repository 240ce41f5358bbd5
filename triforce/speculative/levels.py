"""The pieces every engine is made of: the token sequence on the device, a level (a model running
against one cache, timed without host waits), sampling and verification on the device, and the
proposers that write a round's tokens into the sequence (engine.py composes them into modes).

A `Level` is a model plus a cache holding a prefix of the sequence; `Level.run(seq, end, n)` brings
the cache in line with seq[:end] (rolling back what changed, feeding what is missing) and returns the
logits of the last n positions. Proposers write n tokens into the sequence and return the
distributions they drew them from:

    autoregressive proposer   one level sampling token by token (the drafter, or the middle level)
    lookup proposer           drafts looked up in the sequence (lookup.py): no model, no cache
    speculative proposer      a source proposer drafts gamma tokens, this level verifies them in one
                              pass; what it returns is distributed exactly as this level's model
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

import torch

from triforce.model.transformer import Transformer

from .config import GenerationConfig
from .lookup import point_masses
from .sampling import Sampler, draw_rows, verify_greedy, verify_sampled
from .stats import Stats

if TYPE_CHECKING:
    from .adaptive import Chooser


class Sequence:
    """The token sequence on the model's device: a preallocated tensor of ids. Positions up to the
    generator's committed length are final; later ones hold the current round's proposals.

    Levels hold a prefix of it in their caches. Every write tells them the first position that
    changed, so a level knows how much of what it holds is still the sequence without comparing
    tokens on the host."""

    def __init__(self, capacity: int, device: torch.device):
        self.ids = torch.zeros(capacity, dtype=torch.long, device=device)
        self.levels: list[Level] = []

    def write(self, start: int, tokens: torch.Tensor) -> None:
        """Device tokens (n,) at positions [start, start + n): no host read, no host copy."""
        self.ids[start:start + tokens.shape[0]] = tokens
        self._changed_from(start)

    def put(self, start: int, tokens: list[int]) -> None:
        """Host tokens (a prompt, a chat turn) at `start`. Off the hot path, so it may read: levels
        keep what they hold where the new tokens equal the old ones (a resumed prompt, a re-sent turn)."""
        new = torch.tensor(tokens, dtype=torch.long, device=self.ids.device)
        end = start + new.shape[0]
        if end > self.ids.shape[0]:
            raise ValueError(f"{end} tokens exceed the sequence's {self.ids.shape[0]}")
        differs = (self.ids[start:end] != new).nonzero()
        if differs.numel():
            self.ids[start:end] = new
            self._changed_from(start + int(differs[0, 0]))

    def _changed_from(self, position: int) -> None:
        for level in self.levels:
            level.changed_from(position)


class PassClock:
    """Times passes without making the host wait: CUDA events, read once the round's tokens have come
    back (the events are complete by then); on CPU a pass is done when its call returns."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start


class TokenReads:
    """Device tokens brought to the host one at a time, each without waiting for what was queued
    after it: a token is copied into a pinned slot of its own behind an event, and the host waits on
    that event alone (tolist() would wait for every pass queued since). On CPU the copy is done when
    it returns."""

    def __init__(self, device: torch.device, slots: int = 2):
        cuda = device.type == "cuda"
        self.host = torch.zeros(slots, dtype=torch.long, pin_memory=cuda)
        self.events = [torch.cuda.Event() if cuda else None for _ in range(slots)]
        self.next = 0

    def send(self, token: torch.Tensor) -> int:
        """Queue the copy of a one-token tensor; returns the slot to read it from. A slot is reused
        `slots` sends later, so at most that many may wait to be read."""
        slot, self.next = self.next, (self.next + 1) % len(self.events)
        self.host[slot:slot + 1].copy_(token.reshape(1), non_blocking=True)
        if self.events[slot] is not None:
            self.events[slot].record()
        return slot

    def read(self, slot: int) -> int:
        """The token sent to `slot`, once its copy has landed (the round's one wait)."""
        if self.events[slot] is not None:
            self.events[slot].synchronize()
        return int(self.host[slot])


class Level:
    """A model running against one cache, which holds the K/V of the sequence's first `held` positions;
    the first `agreed` of them still hold the sequence's current tokens. `catch_up`: the most tokens
    a run feeds to come back in line, skipping older ones (a StreamingLLM drafter's cache); None: all."""

    def __init__(self, name: str, model: Transformer, cache, stats: Stats, clock: PassClock,
                 catch_up: int | None = None):
        self.name, self.model, self.cache, self.stats, self.clock = name, model, cache, stats, clock
        self.catch_up = catch_up
        self.skip_from = 0  # never skip tokens before this position (the prompts' ends: their text matters)
        self.held = self.agreed = 0
        self.queried_from = 0  # the position of the first token the cache's last forward kept queries of
        self.meter: Chooser | None = None  # an adaptive generator's chooser, which times decode passes
        self.timings: list[tuple] = []  # decode passes not yet reported: (name, tokens, start, end, typical, count)

    def changed_from(self, position: int) -> None:
        """The sequence changed at `position`: what this level holds from there on is stale."""
        self.agreed = min(self.agreed, position)

    def adopt(self, length: int) -> None:
        """The cache was rewritten outside a pass (a retrieval rebuild or absorb, a restored prompt) and
        now stands for the sequence's first `length` positions."""
        self.held = self.agreed = length

    def run(self, seq: Sequence, end: int, n_out: int, progress: Callable | None = None,
            one_off: bool = False) -> torch.Tensor:
        """Logits (n_out, V) predicting the tokens after each of positions [end - n_out, end).
        `one_off`: a feed whose width seldom recurs (a prompt, a chat turn, a window's refill)."""
        keep = min(self.agreed, end - n_out)
        self.rollback(keep)
        if self.catch_up is not None and keep >= self.skip_from and end - keep > max(self.catch_up, n_out):
            keep = end - max(self.catch_up, n_out)
            self.cache.skipped_to(keep)  # the cache now stands for the tokens before these, not 1:1
            self.held = self.agreed = keep
        logits = self.feed(seq.ids[keep:end], n_out, progress, one_off)
        self.held = self.agreed = end
        return logits

    def feed(self, ids: torch.Tensor, n_out: int, progress: Callable | None = None,
             one_off: bool = False, piece: int | None = None) -> torch.Tensor:
        """Run the model over device tokens appended to the cache, in pieces of `piece` tokens (the
        cache's max_feed by default); `one_off` pieces never become graphs (graphs.GraphedModel.once)."""
        captures = getattr(self.model, "captures", 0)
        model = getattr(self.model, "once", self.model) if one_off else self.model
        start = self.clock.now()
        logits, fed = [], 0
        try:
            step = piece or self.cache.max_feed
            for i in range(0, ids.shape[0], step):
                part = ids[i:i + step]
                out_needed = n_out - (ids.shape[0] - i - part.shape[0])  # outputs this part must return
                # a piece whose logits nobody reads computes only its last row: the output head over
                # every position of a 4,096-token piece is 0.2 TFLOP for SmolLM2, 1.1 for Qwen2.5
                out = model(part, self.cache, last_only=out_needed <= 1)
                self.queried_from = self.held + i
                if out_needed > 0:
                    logits.append(out[-out_needed:])
                fed += part.shape[0]
                if progress is not None:
                    progress(part.shape[0])
        except BaseException:
            self.held += fed
            self.cache.rollback(self.held)  # a half-done forward (e.g. Ctrl-C) leaves no trace
            raise
        # a pass that captured a CUDA graph paid a one-time cost, not what the next one will
        self.timed(ids.shape[0], start, typical=getattr(self.model, "captures", 0) == captures)
        return (logits[0] if len(logits) == 1 else torch.cat(logits))[-n_out:]  # one piece: no copy

    def queries_at(self, position: int) -> list[torch.Tensor]:
        """Each layer's rotated queries (Hq, D) of the token at `position`, kept by the cache's last
        forward; the nearest token's where that forward did not cover it: a pass wider than the cache's
        max_feed keeps only its last piece's, and a pass queued past a stop ran past the committed
        tokens. They only choose what the retrieval cache holds: acceptance, never the output."""
        queries = self.cache.queries
        i = min(max(position - self.queried_from, 0), queries[0].shape[0] - 1)
        return [q[i] for q in queries]

    def timed(self, tokens: int, start, typical: bool = True, name: str | None = None, count: int = 1) -> None:
        """A decode pass of `tokens` tokens began at `start` (PassClock.now()) and was just queued;
        `name` times it as something other than this level's pass (a whole drafter->middle round);
        `count`: it stands for that many equal passes (a lookup's drafts, one call for all of them)."""
        if self.stats.phase != "prefill":
            self.timings.append((name or self.name, tokens, start, self.clock.now(), typical, count))

    def report(self, in_flight: int = 0) -> None:
        """Hand the passes' times to the statistics and the chooser, once the host has waited anyway;
        the last `in_flight` passes were queued after what the host waited for and are kept."""
        done = len(self.timings) - in_flight
        for name, tokens, start, end, typical, count in self.timings[:done]:
            seconds = self.clock.seconds(start, end)
            self.stats.add_pass(name, seconds, count)
            if self.meter is not None:
                for _ in range(count):
                    self.meter.passed(name, tokens, seconds / count, typical=typical)
        del self.timings[:done]

    def rollback(self, length: int) -> None:
        if length < self.held:
            self.cache.rollback(length)
            self.held = length
            self.agreed = min(self.agreed, length)


class Sampling:
    """The sampler plus its generator on the model's device, shared by every level so runs are
    reproducible by seed. Tokens, distributions and acceptance stay on the device."""

    def __init__(self, cfg: GenerationConfig, device: torch.device):
        self.sampler = Sampler(cfg.temperature, cfg.top_p, cfg.top_k)
        self.rule = cfg.verification
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(cfg.seed)

    def uniforms(self, n: int) -> torch.Tensor:
        return torch.rand(n, generator=self.generator, device=self.device, dtype=torch.float64)

    def pick(self, logits: torch.Tensor, uniforms: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens (N,) sampled from each row, and the rows' distributions (None when greedy).
        `uniforms` (N,): drawn beforehand (a graph cannot draw from the generator), else drawn now."""
        if self.sampler.greedy:
            return logits.argmax(dim=-1), None
        probs = self.sampler.probs(logits)
        return draw_rows(probs, self.uniforms(probs.shape[0]) if uniforms is None else uniforms), probs

    def verify(self, drafts: torch.Tensor, draft_probs, logits: torch.Tensor, limit: torch.Tensor | None = None,
               uniforms: torch.Tensor | None = None):
        """(accepted, next token) as 0-dim device tensors, and this level's distributions (g+1, V)
        or None when greedy. With `limit`, only the first `limit` drafts were proposed; `uniforms`
        (g + 1,) as in pick."""
        if self.sampler.greedy:
            accepted, nxt = verify_greedy(drafts, logits.argmax(dim=-1), limit)
            return accepted, nxt, None
        probs = self.sampler.probs(logits)
        if uniforms is None:
            uniforms = self.uniforms(drafts.shape[0] + 1)
        if drafts.shape[0] == 0:  # nothing to verify: a plain draw
            return torch.zeros((), dtype=torch.long, device=self.device), draw_rows(probs, uniforms)[0], probs
        accepted, nxt = verify_sampled(drafts, draft_probs, probs, uniforms, limit=limit, rule=self.rule)
        return accepted, nxt, probs


class AutoregressiveProposer:
    def __init__(self, level: Level, sampling: Sampling):
        self.level, self.sampling = level, sampling

    def propose(self, seq: Sequence, start: int, n: int):
        """Write n tokens at positions [start, start + n) of seq; returns their distributions (n, V)
        (None when greedy). Each token goes from the sampler to the next pass on the device."""
        dists = []
        for k in range(n):
            logits = self.level.run(seq, start + k, 1)
            token, probs = self.sampling.pick(logits)
            seq.write(start + k, token)
            dists.append(probs)
        self.origins = [self.level.name] * n  # the level that produced each token (for display)
        return None if dists[0] is None else torch.cat(dists)


class LookupProposer:
    """Drafts looked up in the sequence (lookup.py), timed as the drafter level's passes (one per
    draft, so the adaptive chooser prices them as it prices a model drafter's)."""

    def __init__(self, lookup, level: Level, vocab: int, sampling: Sampling):
        self.lookup, self.level, self.vocab, self.sampling = lookup, level, vocab, sampling

    def propose(self, seq: Sequence, start: int, n: int):
        begun = self.level.clock.now()
        tokens = self.lookup.drafts(seq.ids[:start], start, n)  # the committed prefix and proposals so far
        seq.write(start, tokens)
        self.level.timed(1, begun, count=n)
        self.origins = [self.level.name] * n
        return None if self.sampling.sampler.greedy else point_masses(tokens, self.vocab, torch.float32)


class SpeculativeProposer:
    """This level verifies `gamma` drafts of its source proposer per pass; writes n tokens drawn
    exactly from this level's model, with this level's distribution for each (passed upward)."""

    def __init__(self, level: Level, source, gamma: int, sampling: Sampling, stats_key: str):
        self.level, self.source, self.gamma, self.sampling, self.key = level, source, gamma, sampling, stats_key

    def propose(self, seq: Sequence, start: int, n: int):
        done, dists, origins = 0, [], []
        while done < n:
            at = start + done
            g = min(self.gamma, n - done)
            draft_probs = self.source.propose(seq, at, g)
            logits = self.level.run(seq, at + g, g + 1)
            accepted, nxt, probs = self.sampling.verify(seq.ids[at:at + g], draft_probs, logits)
            # where the next drafts go depends on how many stood: this level's one wait per pass
            n_accepted = int(accepted)
            seq.write(at + n_accepted, nxt[None])
            self.level.stats.add_acceptance(self.key, g, n_accepted)
            if self.level.meter is not None:
                self.level.meter.verified(self.key, g, n_accepted)
            origins += self.source.origins[:n_accepted] + [self.level.name]
            if probs is not None:
                dists.append(probs[:n_accepted + 1])
            done += n_accepted + 1
        self.origins = origins[:n]
        return torch.cat(dists)[:n] if dists else None
