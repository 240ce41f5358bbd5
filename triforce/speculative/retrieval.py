"""Retrieval KV cache for the middle level: a fixed token budget of the most relevant KV chunks.

Layout per layer and KV head: `budget` persistent slots, then a scratch area for the speculative
tokens of the current round. Building it keeps, per layer and KV head, the sink chunk, the latest
tokens (half the budget) and the chunks of `chunk_size` tokens between them that the newest token's
query attends to most: its exact attention, summed over each chunk and over the query heads that
share the KV head (grouped-query attention). TriForce ranked chunks by their mean key instead, and
kept only the last two chunks beside them; bench/retrieval_rules.py measures both.

Tokens the top level accepts are copied in exactly (from the full cache) over the oldest of the
latest tokens, so the window slides and the retrieved chunks stay. When the window has slid its
length (no replaceable slot is left), or the engine sees acceptance drop, the cache is rebuilt.
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


def attention_mass(full: FullCache, layer: int, queries: torch.Tensor, n_chunks: int, chunk: int) -> torch.Tensor:
    """(Hkv, n_chunks): the attention the queries (k, Hq, D) give each chunk, summed over the queries and
    the query heads that share a KV head: softmax over the chunks' tokens (the recent tail is held
    whatever it scores). Computed where the keys are, a KV head at a time so that only one head's keys
    are widened to float32 at once: for a layer in host memory the query goes to the host (a rebuild
    waits for the store's write-backs anyway) and the scores come back."""
    keys, _ = full.read(layer, 0, n_chunks * chunk)
    Hkv, n, D = keys.shape
    grouped = queries.to(keys.device, torch.float32).reshape(queries.shape[0], Hkv, -1, D)
    mass = torch.empty(Hkv, n_chunks, device=keys.device)
    for head in range(Hkv):
        weights = torch.softmax(grouped[:, head].reshape(-1, D) @ keys[head].float().T * D ** -0.5, dim=-1)
        mass[head] = weights.view(-1, n_chunks, chunk).sum(dim=(0, 2))
    return mass.to(queries.device)


def plan_selection(n_tokens: int, budget: int, chunk: int, scores: torch.Tensor, recent: int = 0):
    """Which token positions fill the budget, per KV head, and each slot's score.

    scores: (Hkv, C) for the complete chunks. The sink chunk and a tail of the latest tokens are
    always held: at least `recent` of them (and at least the last complete chunk with the partial
    one after it), from a chunk boundary, so that every position between the sink and the tail
    belongs to a whole candidate chunk (no position falls between the retrieved and the recent).
    The rest of the budget holds the best-scoring candidates, the last of them cut to its last tokens
    to fit (so a rule that ranks the latest chunks first holds one unbroken window).
    Returns (index (Hkv, budget) of token positions, slot_scores (Hkv, budget): +inf for the sink, -inf
    for the latest tokens, and the replaceable slots count: the latest tokens')."""
    Hkv = scores.shape[0]
    least = chunk + n_tokens % chunk
    latest = max(least, min(recent, budget - 3 * chunk + 1))  # leaves room for at least one chunk
    tail_start = (n_tokens - latest) // chunk * chunk
    room = budget - chunk - (n_tokens - tail_start)
    picks = -(-room // chunk)  # the last one cut to fit
    candidates = tail_start // chunk - 1  # complete chunks strictly between the sink and the tail
    top = torch.topk(scores[:, 1:1 + candidates], picks, dim=-1)
    chosen = top.indices + 1  # (Hkv, picks) chunk ids
    offsets = torch.arange(chunk, device=scores.device)
    last = (picks - 1) * chunk  # where the last pick starts; it keeps its last chunk - cut tokens

    def cut_to_fit(slots: torch.Tensor) -> torch.Tensor:  # (Hkv, picks * chunk) -> (Hkv, room)
        return torch.cat((slots[:, :last], slots[:, last + picks * chunk - room:]), dim=1)

    chunk_tokens = cut_to_fit((chosen[:, :, None] * chunk + offsets).reshape(Hkv, picks * chunk))
    sink = offsets.expand(Hkv, chunk)
    tail = torch.arange(tail_start, n_tokens, device=scores.device).expand(Hkv, n_tokens - tail_start)
    index = torch.cat((sink, chunk_tokens, tail), dim=1)
    inf = torch.full((Hkv, chunk), float("inf"), device=scores.device)
    # the latest tokens slide: committed tokens replace the oldest of them (-inf, in position order
    # under a stable sort), and once the window has slid its length the cache is built anew; the
    # retrieved chunks stay until then (a needle is never dropped between builds)
    slot_scores = torch.cat((inf, cut_to_fit(top.values.repeat_interleave(chunk, dim=1)),
                             torch.full((Hkv, n_tokens - tail_start), -float("inf"), device=scores.device)), dim=1)
    return index, slot_scores, n_tokens - tail_start


class RetrievalCache(SlotCache):
    # Half the budget always holds the latest tokens, half the chunks the last query attends to most
    # (a recent window beside heavy hitters, as H2O splits its cache). TriForce's rule (every chunk
    # ranked by its mean key) was measured beside others, teacher-forced on SmolLM2 at 8K
    # (bench/retrieval_rules.py, docs/results/2026-11-29-cpu-retrieval-rules.md): greedy agreement
    # with the full cache 0.858 -> 0.895 and sampled acceptance 0.895 -> 0.918 at a 1,024 budget.
    RECENT_SHARE = 0.5

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
            scores = self.chunk_scores(full, layer, queries[layer], n_chunks)
            index, slot_scores, self.replaceable = plan_selection(n_tokens, self.budget, self.chunk, scores,
                                                                  int(self.budget * self.RECENT_SHARE))
            k, v = full.gather(layer, index.to(self.k.device))
            self.k[layer, :, :self.budget] = k
            self.v[layer, :, :self.budget] = v
            self.victims[layer] = torch.argsort(slot_scores, dim=-1, stable=True)
        self.base = self.length = n_tokens
        self.used = self.budget
        self.replaced = 0
        self.builds += 1

    def chunk_scores(self, full: FullCache, layer: int, query: torch.Tensor, n_chunks: int) -> torch.Tensor:
        """(Hkv, n_chunks) how much each chunk matters to the query (Hq, D)."""
        return attention_mass(full, layer, query[None], n_chunks, self.chunk)

    def room(self) -> int:
        """Committed tokens that can still be absorbed before a rebuild is needed."""
        return self.replaceable - self.replaced

    def absorb(self, full: FullCache, n_tokens: int) -> None:
        """Copy the exact KV of newly committed tokens [base, n_tokens) over the oldest of the latest tokens."""
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
