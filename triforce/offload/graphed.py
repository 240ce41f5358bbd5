"""A pass over the offloaded full cache as one CUDA graph, copies included.

Eager, such a pass costs the host about 0.8 ms a layer on a GPU: the streamer's copies and events
and the layer's kernels are launched one by one, and a token's step waits for all of them (issue
22's first H200 run: a SmolLM2 pass with its 4K tokens of KV in host memory took 23 ms against a
1.7 ms link floor). `OffloadedView` is the model protocol over the same host store and staging
slots with static shapes, so `GraphedModel` (speculative/graphs.py) captures the whole pass:

    copy stream:    layers 0 and 1 at once, layer j+2 once layer j's attention is done:
                    store[j][:span] -> slot j % 2, then record copied[j]
    compute stream: wait copied[j] -> the new tokens into the slot (and a fixed device buffer)
                    -> attention over the slot's [:span] under the causal mask -> record freed[j]

`span` is the pass's end rounded up to a bucket of BUCKET tokens: one capture serves a bucket of
lengths, for at most a bucket of extra tokens a layer on the link. The new tokens' K/V go to the
store from inside the graph: a copy node has fixed addresses, but a kernel writes where the view's
slots say, through the store mapped into the device's address space (OffloadedCache.mapped). So a
pass leaves the host nothing to do before the next one, which plain decoding queues before reading
a token (engine.Generator._queued_tokens). Where the store cannot be mapped they go back after the
replay (OffloadedCache.graph_end: one device->host copy into pinned staging, which the host places
in the store before the next pass, waiting for this one).
On CPU (`eager_static`, the tests) the same view runs eagerly with synchronous copies.
"""
from __future__ import annotations

import torch

from triforce.model.attention import aligned_mask, attend_shared_heads
from triforce.speculative.graphs import StaticView, pad_tokens

BUCKET = 1024  # tokens: a graph per bucket of lengths; an extra 64-256 KiB a layer at SmolLM2..Llama-2-7B


class OffloadedView(StaticView):
    """The model protocol over an OffloadedCache's store and slots for passes of T tokens that end
    within `span` slots."""

    compilable = False  # its streams and events are captured, not traced

    def __init__(self, cache, T: int, span: int):
        self.cache, self.T, self.span = cache, T, span
        device, shape = cache.device, cache.shape
        self.queries: list[torch.Tensor | None] = [None] * shape.num_layers
        self.positions = torch.zeros(T, dtype=torch.long, device=device)
        self.slots = torch.zeros(T, dtype=torch.long, device=device)
        self.offsets = torch.arange(T, device=device)
        self.key_slots = torch.arange(span, device=device)
        self.tiled = False
        self.mask = aligned_mask(T, span, shape.dtype, device)
        self.limits = torch.zeros(T, dtype=torch.long, device=device)
        self.onchip, self.offloaded = cache.onchip, shape.num_layers - cache.onchip
        # the new tokens' K/V of each offloaded layer, where graph_end copies them back from
        self.fresh_k = torch.zeros(self.offloaded, T, shape.num_kv_heads, shape.head_dim, dtype=shape.dtype,
                                   device=device)
        self.fresh_v = torch.zeros_like(self.fresh_k)
        self.copies = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.copied: list = []
        self.freed: list = []

    def begin(self, T: int) -> torch.Tensor:
        positions = super().begin(T)  # the mask, once per pass
        self.copied, self.freed = [None] * self.offloaded, [None] * self.offloaded
        if self.copies is not None:  # fork: the copies start once the pass does
            self.copies.wait_stream(torch.cuda.current_stream(self.copies.device))
        for j in range(min(2, self.offloaded)):  # both slots are free at the start of a pass
            self._fetch(j)
        return positions

    def _fetch(self, j: int) -> None:
        keys, values = self.cache.streamer.slot(j % 2)
        src_k, src_v = self.cache.store.k[j], self.cache.store.v[j]
        if self.copies is None:
            keys[:self.span].copy_(src_k[:self.span])
            values[:self.span].copy_(src_v[:self.span])
            return
        with torch.cuda.stream(self.copies):
            if j >= 2:
                self.copies.wait_event(self.freed[j - 2])  # layer j-2's attention is done with the slot
            keys[:self.span].copy_(src_k[:self.span], non_blocking=True)
            values[:self.span].copy_(src_v[:self.span], non_blocking=True)
            self.copied[j] = torch.cuda.Event()
            self.copied[j].record(self.copies)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.queries[layer] is None:  # allocated by the eager warm-up, before any capture
            self.queries[layer] = torch.empty_like(q)
        self.queries[layer].copy_(q)
        j = layer - self.onchip
        compute = torch.cuda.current_stream(q.device) if self.copies is not None else None
        if j < 0:
            keys, values = self.cache.resident_k[layer], self.cache.resident_v[layer]
        else:
            if compute is not None:
                compute.wait_event(self.copied[j])
            keys, values = self.cache.streamer.slot(j % 2)
            self.fresh_k[j].copy_(k)
            self.fresh_v[j].copy_(v)
        keys.index_copy_(0, self.slots, k.to(keys.dtype))
        values.index_copy_(0, self.slots, v.to(values.dtype))
        out = attend_shared_heads(q, keys[:self.span].transpose(0, 1).to(q.dtype),
                                  values[:self.span].transpose(0, 1).to(q.dtype), self.mask.to(q.dtype))
        if j >= 0 and j + 2 < self.offloaded:
            if compute is not None:
                self.freed[j] = torch.cuda.Event()
                self.freed[j].record(compute)
            self._fetch(j + 2)
        return out

    def end(self, T: int) -> None:
        if self.cache.mapped is not None and self.offloaded:
            # the new tokens' K/V into the store itself (OffloadedCache.mapped): one write for every
            # layer, after the last layer's copy has landed, so no copy of this pass reads a row it
            # changes; padded positions' rows land past the pass's tokens, where nothing reads them
            keys, values = self.cache.mapped
            keys.index_copy_(1, self.slots, self.fresh_k)
            values.index_copy_(1, self.slots, self.fresh_v)
        if self.copies is not None:  # join: a capture ends with every forked stream back
            torch.cuda.current_stream(self.copies.device).wait_stream(self.copies)


def graphed_pass(graphed, tokens: torch.Tensor, cache, last_only: bool) -> torch.Tensor:
    """One pass of `graphed` (a GraphedModel) over an OffloadedCache through its view for this
    width and span: a replay on CUDA, the view's eager pass otherwise."""
    T = tokens.shape[0]
    start = cache.graph_begin(T)
    # with pad_widths the pass runs at a bucket's width; the padded positions' K/V stay in the slots
    # (never in the store) and their outputs are dropped
    width = graphed.width(T, cache, cache.capacity - start, last_only)
    span = cache.graph_span(start + width, BUCKET)
    key = (id(cache), width, span)
    if key not in graphed.views:
        # a sequence grows into new buckets and rarely goes back more than one, while each view's
        # mask and each graph's memory would pile up (a 128K chat: ~128 buckets times every width)
        graphed.drop_views(lambda k, v: isinstance(v, OffloadedView) and k[0] == id(cache) and v.span < span - BUCKET)
    view = graphed.view(key, lambda: OffloadedView(cache, width, span))
    view.set(torch.arange(start, start + width, device=view.positions.device), start)
    logits = graphed.run_view(view, pad_tokens(tokens, width), last_only)
    cache.queries = list(view.queries) if T == view.T else [q[:T] for q in view.queries]  # views either way
    cache.graph_end(T, view.fresh_k[:, :T], view.fresh_v[:, :T])
    return logits[:T]

