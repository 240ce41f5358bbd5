"""Retrieval KV cache for the middle level: a fixed token budget of the most relevant KV chunks.

Layout per layer and KV head: `budget` persistent slots, then a scratch area for the speculative
tokens of the current round. Building it splits the full cache into chunks of `chunk_size`
tokens, scores each chunk's mean key against the rotated query of the newest token, and keeps,
per layer and KV head, the sink chunk, the most recent tokens and the top-scoring chunks.
With grouped-query attention a chunk's score for a KV head is the attention mass its query heads
would give it (softmax over chunks per query head, summed over the group).

Tokens the top level accepts are copied in exactly (from the full cache) over the lowest-scoring
slots. When no replaceable slot is left, or the engine sees acceptance drop, the cache is rebuilt.
"""
from __future__ import annotations

import torch

from triforce.model.errors import UserError
from triforce.model.kv import KVShape

from .caches import FullCache, SlotCache
from .modes import WITHOUT_RETRIEVAL as FALLBACK  # the same levels, less the middle one


MIN_CHUNKS = 4  # sink + one retrieved + the recent tail, which spans two chunks when the length is not a multiple


def check_budget_shape(budget: int, chunk_size: int) -> None:
    """The one rule for a budget on its own (GenerationConfig applies it too): a positive multiple of
    the chunk size holding at least MIN_CHUNKS chunks, so at least one chunk is always retrieved."""
    if chunk_size <= 0:
        raise UserError(f"chunk size must be > 0 (got {chunk_size})")
    if budget <= 0:
        raise UserError(f"budget must be > 0 tokens (got {budget})")
    if budget % chunk_size:
        raise UserError(f"budget {budget} is not a multiple of the chunk size {chunk_size}; "
                        f"use GenerationConfig.budget {max(MIN_CHUNKS * chunk_size, budget - budget % chunk_size)}")
    if budget < MIN_CHUNKS * chunk_size:
        raise UserError(f"budget {budget} holds fewer than {MIN_CHUNKS} chunks of {chunk_size} (sink, recent tail, "
                        f"one retrieved); use GenerationConfig.budget {MIN_CHUNKS * chunk_size} or more, or a smaller GenerationConfig.chunk_size")


def check_budget(budget: int, chunk_size: int, prompt_len: int) -> None:
    """The budget rule, and a prompt long enough for retrieval to choose from."""
    check_budget_shape(budget, chunk_size)
    if budget >= prompt_len:
        raise UserError(f"budget {budget} is not smaller than the prompt ({prompt_len} tokens), so "
                        f"retrieval has nothing to choose; lower GenerationConfig.budget or give a longer prompt")




def mode_for_prompt(mode: str, budget: int, chunk_size: int, prompt_len: int) -> tuple[str, str | None]:
    """`mode`, or the mode without the retrieval level when the prompt is too short to retrieve from
    (not longer than the budget), with a one-line note saying so."""
    if mode not in FALLBACK or budget < prompt_len:
        return mode, None
    return FALLBACK[mode], (f"the prompt ({prompt_len} tokens) is not longer than the retrieval budget ({budget}): "
                            f"nothing to retrieve, so {mode} runs as {FALLBACK[mode]}")


class RebuildPolicy:
    """When the retrieval cache is rebuilt rather than absorbing the newly committed tokens: when
    no replaceable slot is left for them, or (threshold > 0) when the middle level's acceptance,
    averaged over the last WINDOW full-cache passes, drops below the threshold - the context the
    generation needs has moved away from what was retrieved."""

    WINDOW = 4

    def __init__(self, threshold: float):
        self.threshold = threshold
        self.recent: list[float] = []

    def record(self, accepted: int, proposed: int) -> None:
        self.recent = (self.recent + [accepted / max(proposed, 1)])[-self.WINDOW:]

    def due(self, cache: "RetrievalCache", n_tokens: int) -> bool:
        low = (self.threshold > 0 and len(self.recent) == self.WINDOW
               and sum(self.recent) / self.WINDOW < self.threshold)
        return low or n_tokens - cache.base > cache.room()

    def reset(self) -> None:
        self.recent = []


def chunk_scores(query: torch.Tensor, means: torch.Tensor) -> torch.Tensor:
    """Estimated attention mass per (KV head, chunk).

    query: (Hq, D) rotated query of the newest token; means: (Hkv, C, D) chunk-mean keys.
    """
    Hq, D = query.shape
    Hkv = means.shape[0]
    grouped = query.float().view(Hkv, Hq // Hkv, D)
    logits = torch.matmul(grouped, means.float().transpose(1, 2)) * D ** -0.5  # (Hkv, rep, C)
    return torch.softmax(logits, dim=-1).sum(dim=1)


def plan_selection(n_tokens: int, budget: int, chunk: int, scores: torch.Tensor):
    """Which token positions fill the budget, per KV head, and each slot's score.

    scores: (Hkv, C) for the complete chunks. Returns (index (Hkv, budget) of token positions,
    slot_scores (Hkv, budget), replaceable slots count). Sink chunk and the recent tail get +inf.
    """
    Hkv = scores.shape[0]
    partial = n_tokens % chunk
    recent = chunk + partial + (-partial) % chunk  # last full chunk, the partial one, and padding
    picks = (budget - chunk - recent) // chunk
    recent = budget - chunk - picks * chunk
    tail_start = n_tokens - recent
    candidates = tail_start // chunk - 1  # complete chunks strictly between the sink and the tail
    top = torch.topk(scores[:, 1:1 + candidates], picks, dim=-1)
    chosen = top.indices + 1  # (Hkv, picks) chunk ids
    offsets = torch.arange(chunk, device=scores.device)
    chunk_tokens = (chosen[:, :, None] * chunk + offsets).reshape(Hkv, picks * chunk)
    sink = offsets.expand(Hkv, chunk)
    tail = torch.arange(tail_start, n_tokens, device=scores.device).expand(Hkv, recent)
    index = torch.cat((sink, chunk_tokens, tail), dim=1)
    inf = torch.full((Hkv, chunk), float("inf"), device=scores.device)
    slot_scores = torch.cat((inf, top.values.repeat_interleave(chunk, dim=1),
                             torch.full((Hkv, recent), float("inf"), device=scores.device)), dim=1)
    return index, slot_scores, picks * chunk


class RetrievalCache(SlotCache):
    def __init__(self, shape: KVShape, budget: int, chunk_size: int, scratch: int):
        super().__init__(shape, budget + scratch)
        self.budget, self.chunk = budget, chunk_size
        self.max_feed = scratch
        self.base = 0  # sequence tokens represented by the persistent slots
        self.builds = 0
        # per layer and KV head: persistent slots in the order they get replaced (lowest score first)
        self.victims = torch.zeros(shape.num_layers, shape.num_kv_heads, budget, dtype=torch.long,
                                   device=shape.device)
        self.replaceable = 0
        self.replaced = 0

    def begin(self, T: int) -> torch.Tensor:
        if self.used + T > self.capacity:
            raise RuntimeError(f"retrieval scratch overflow: {self.used + T} > {self.capacity}")
        return torch.arange(self.length, self.length + T, device=self.shape.device)

    def rollback(self, length: int) -> None:
        if length < self.base:
            raise RuntimeError(f"cannot roll back below the committed base ({length} < {self.base})")
        self.length = length
        self.used = self.budget + (length - self.base)

    def build(self, full: FullCache, n_tokens: int, queries: list[torch.Tensor]) -> None:
        """Select from the first n_tokens of `full`, scoring with per-layer queries (Hq, D)."""
        check_budget(self.budget, self.chunk, n_tokens)
        n_chunks = n_tokens // self.chunk
        for layer in range(self.shape.num_layers):
            scores = chunk_scores(queries[layer], full.chunk_key_means(layer, self.chunk, n_chunks))
            index, slot_scores, self.replaceable = plan_selection(n_tokens, self.budget, self.chunk, scores)
            k, v = full.gather(layer, index.to(self.k.device))
            self.k[layer, :, :self.budget] = k
            self.v[layer, :, :self.budget] = v
            self.victims[layer] = torch.argsort(slot_scores, dim=-1, stable=True)
        self.base = self.length = n_tokens
        self.used = self.budget
        self.replaced = 0
        self.builds += 1

    def room(self) -> int:
        """Committed tokens that can still be absorbed before a rebuild is needed."""
        return self.replaceable - self.replaced

    def absorb(self, full: FullCache, n_tokens: int) -> None:
        """Copy the exact KV of newly committed tokens [base, n_tokens) over the lowest-scoring slots."""
        new = n_tokens - self.base
        if new > self.room():
            raise RuntimeError("retrieval cache is out of room; rebuild instead")
        if new > 0:
            k, v = full.slice(self.base, n_tokens)  # (L, Hkv, new, D)
            slots = self.victims[:, :, self.replaced:self.replaced + new]  # (L, Hkv, new), all < budget
            layers = torch.arange(slots.shape[0], device=slots.device)[:, None, None]
            heads = torch.arange(slots.shape[1], device=slots.device)[None, :, None]
            # an indexed write, not scatter_: torch's CPU scatter_ on bfloat16 took 144 ms for 3 tokens
            # of SmolLM2's 8K-slot cache (0.03 ms this way, and in float32 either way), a quarter of
            # a full pass at 115K tokens
            self.k[layers, heads, slots] = k.to(self.k.device)
            self.v[layers, heads, slots] = v.to(self.v.device)
            self.replaced += new
        self.base = self.length = n_tokens
        self.used = self.budget
