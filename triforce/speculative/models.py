"""What a Generator is built from: the models, the sizes of its caches, and a prefilled prompt to
start from (shared between generators, or restored from disk)."""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from triforce.model.kv import KVShape
from triforce.model.transformer import Transformer

from .config import GenerationConfig
from .lookup import LookupDrafter
from .modes import drafts as modes_draft, retrieves


@dataclass
class Prefilled:
    """A processed prompt that several generators (one at a time) can decode from."""

    cache: object
    prompt: list[int]
    first: int
    queries: list[torch.Tensor]
    prefill_seconds: float


def self_drafter(target: Transformer, rotary) -> Transformer:
    """The target's weights drafting for themselves: the target itself, or (with `rotary`) a shallow
    twin that shares every parameter and the all-reduce hook but computes its own RoPE."""
    if rotary is None:
        return target
    twin = copy.copy(target)
    twin.rotary = rotary
    return twin


@dataclass
class Models:
    target: Transformer
    # None: the target's own weights ("self"); a LookupDrafter: drafts looked up in the sequence, no model
    drafter: Transformer | LookupDrafter | None
    # RoPE for the target drafting for itself when this run scaled the target's RoPE for a long
    # context: the drafter's positions are StreamingLLM slots (sinks + window), always inside the
    # trained range, where a scaling such as YaRN (new frequencies, attention temperature) only hurts
    self_draft_rotary: object | None = None
    # The target's weights as the proposing levels read them (the retrieval middle, a self drafter):
    # None for the exact weights, or an approximation (quant.int8_twin) that is cheaper to read. Only
    # acceptance depends on it; the full-cache level verifies with `target`.
    proposing_target: Transformer | None = None

    def proposers(self, modes) -> tuple[bool, bool]:
        """Whether any of `modes` proposes with the target's weights (the retrieval middle, or a self
        drafter), and whether any runs the separate drafter: the levels worth a cheaper copy."""
        drafts = any(map(modes_draft, modes))
        middle = any(map(retrieves, modes))
        return middle or (drafts and self.drafter is None), drafts and isinstance(self.drafter, Transformer)

    @property
    def lookup(self) -> LookupDrafter | None:
        """The drafter when it is a lookup (no model, no cache)."""
        return self.drafter if isinstance(self.drafter, LookupDrafter) else None


# a full pass's width rounded up to one of these, the positions past it fed copies of the last token and
# dropped: one captured graph serves a bucket of widths. Each new width costs a capture (an eager pass
# or two, then the capture), and the adaptive default's first tokens verify many: on the H200 (session
# 35) its fresh 64 tokens at 4K spent 400 of 600 ms in 17 full passes, where a captured one costs 3.6
WIDTHS = (1, 2, 4, 8, 16, 32, 64, 128)


def padded_width(T: int, room: int) -> int:
    """T rounded up to the next of WIDTHS where the cache has the room (`room` free slots from the
    pass's first), else T."""
    wide = next((w for w in WIDTHS if w >= T), T)
    return wide if wide <= room else T


@dataclass(frozen=True)
class CacheSizes:
    """Slots of every cache a Generator allocates, decided here once. The offload planner reads
    `after_full_bytes` to keep device memory for the caches made after the full one."""

    margin: int  # positions one round can write past the committed ones
    widest: int  # the most positions one full pass verifies
    full: int  # every token: the longest sequence plus one round's proposals
    budget: int | None  # the retrieval cache's persistent slots (None: no middle level)
    scratch: int  # the retrieval cache's slots for one round's proposals
    streaming_slack: int | None  # the drafter's eviction slack (None: no drafter)
    sinks: int
    window: int

    @classmethod
    def of(cls, cfg: GenerationConfig, mode: str, max_len: int, model_drafter: bool = True,
           lookups: bool = False) -> "CacheSizes":
        """`model_drafter`: the drafter is a model with a StreamingLLM cache (not a lookup);
        `lookups`: an adaptive run weighs lookups alone, up to cfg.lookup_gamma a full pass."""
        # a device round (rounds.py) verifies up to gamma2 rounds of gamma1 + 1 positions
        widest = cfg.gamma2 * (cfg.gamma1 + 1) if mode == "triforce" else max(cfg.gamma1, cfg.gamma2)
        widest = max(widest, cfg.lookup_gamma) if lookups else widest
        margin = max(cfg.gamma1 + cfg.gamma2, widest) + 2  # tokens one round can add beyond the committed ones
        # room for the widest verification rounded up to a bucket (graphs.GraphedModel.pad_widths)
        padding = padded_width(widest + 1, room=1 << 30) - (widest + 1)
        return cls(margin=margin, widest=widest, full=max_len + margin + padding,
                   budget=cfg.budget if retrieves(mode) else None, scratch=margin + 1,
                   streaming_slack=max(64, margin + 4) if modes_draft(mode) and model_drafter else None,
                   # a window shorter than one round's drafts would be evicted from under them, and
                   # the drafter could not roll back to the tokens the full pass kept
                   sinks=cfg.sink_tokens, window=max(cfg.draft_window, margin))

    def after_full_bytes(self, target: KVShape, drafter: KVShape | None) -> int:
        """Bytes of the retrieval and StreamingLLM caches."""
        total = 0
        if self.budget is not None:
            total += target.bytes_per_token * (self.budget + self.scratch)
        if self.streaming_slack is not None:
            total += (drafter or target).bytes_per_token * (self.sinks + self.window + self.streaming_slack)
        return total
