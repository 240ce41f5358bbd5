"""The memory tier of the full KV cache: a host store streamed to the device layer by layer.

    factory = full_cache_factory(device="cuda", prefill_chunk=2048, onchip_layers="auto")
    Generator(models, cfg, mode, max_len, full_cache_factory=factory)

On CUDA the planner sizes the device side from measured free memory before anything is
allocated; on CPU the same code path runs with the CPU as the "device".
"""
from __future__ import annotations

import torch

from triforce.model.kv import KVShape

from .counters import Counters
from .planner import Plan, Request, free_device_memory, plan, shape_request
from .store import HostStore, OffloadedCache

DEFAULT_CHUNK_TOKENS = 4096


def full_cache_factory(device, prefill_chunk: int, onchip_layers: int | str = 0,
                       chunk_tokens: int = DEFAULT_CHUNK_TOKENS, free_bytes: int | None = None,
                       prefetch_next: bool | None = None, on_plan=None):
    """A `(shape, max_len, reserve_bytes=0) -> OffloadedCache` callable for
    `Generator(full_cache_factory=...)`, which passes as reserve_bytes the device memory its other
    caches take after this one (speculative.engine.CacheSizes).

    onchip_layers: layers kept resident on the device, or "auto" for as many as fit (planned on
    CUDA or with free_bytes; on CPU without free_bytes "auto" means 0, so everything streams).
    free_bytes: override the measured free memory (tests). on_plan: called with the Plan, e.g. to print it.
    """
    device = torch.device(device)
    if onchip_layers not in ("auto", None) and not isinstance(onchip_layers, int):
        raise ValueError(f"onchip_layers must be an int or 'auto', got {onchip_layers!r}")

    def make(shape: KVShape, max_len: int, reserve_bytes: int = 0) -> OffloadedCache:
        onchip = None if onchip_layers in ("auto", None) else onchip_layers
        if device.type == "cuda" or free_bytes is not None:
            free = free_bytes if free_bytes is not None else free_device_memory(device)
            decided = plan(shape_request(shape, max_len, onchip, reserve_bytes), free)
            if on_plan:
                on_plan(decided)
            onchip = decided.onchip_layers
        return OffloadedCache(shape, max_len, prefill_chunk, onchip_layers=onchip or 0,
                              chunk_tokens=chunk_tokens, prefetch_next=prefetch_next)

    return make


__all__ = ["full_cache_factory", "OffloadedCache", "HostStore", "Counters", "Plan", "Request", "plan",
           "free_device_memory", "shape_request"]
