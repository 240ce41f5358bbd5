"""What a KV cache is to the model: its per-token layout, and the protocol the model calls.

The model never owns its cache. Each forward pass speaks to one object through `Cache`:

    positions = cache.begin(T)           # RoPE positions of the T new tokens (may evict first)
    out = cache.attend(layer, q, k, v)   # store k, v of the new tokens, attend, per layer
    cache.end(T)                         # the forward completed: the tokens are now cached
    cache.rollback(length)               # forget everything after `length` tokens of the sequence

A cache that holds every token of the sequence (on the device, or in host memory streamed per pass)
is a `FullKV`: besides the protocol it offers what the retrieval level reads (chunk-mean keys,
gathers, slices, the rotated queries of the last forward) and what the engine reports (bytes moved
between host and device, transfer timings; zero and None where nothing moves).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .config import kv_bytes_per_token


@dataclass(frozen=True)
class KVShape:
    """What a cache must hold per token: the (possibly tensor-parallel, local) KV layout."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    tiled_keys: bool = False  # a full cache stores its keys in tiles, its values in pairs (model/key_tiles.py)

    def buffer(self, slots: int) -> torch.Tensor:
        return torch.zeros(self.num_layers, self.num_kv_heads, slots, self.head_dim,
                           dtype=self.dtype, device=self.device)

    @property
    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, torch.finfo(self.dtype).bits // 8)


class Cache(Protocol):
    """The model protocol (above). `capacity` is the most tokens it can hold at once (slots), and
    `max_feed` the most tokens one forward may add. A cache may also offer `run_stack(stack, x, cos,
    sin) -> x | None`, every layer of an eager CPU pass in one call (model/fused_layers.py), attending
    exactly as `attend` would; the model then calls `attend` for no layer of that pass."""

    length: int
    max_feed: int

    @property
    def capacity(self) -> int: ...

    def begin(self, T: int) -> torch.Tensor: ...

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...

    def end(self, T: int) -> None: ...

    def rollback(self, length: int) -> None: ...


class FullKV(Cache, Protocol):
    """Every token of the sequence, slot i = token i."""

    queries: list[torch.Tensor | None]  # per layer, (T, Hq, D) rotated queries of the last forward

    @property
    def bytes_moved(self) -> int:
        """Host<->device bytes so far (0 for a cache that lives where the model computes)."""
        ...

    def timings(self) -> dict | None:
        """Transfer timings of an offloaded cache; None for a resident one."""
        ...

    def chunk_key_means(self, layer: int, chunk: int, n_chunks: int) -> torch.Tensor: ...

    def gather(self, layer: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def slice(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    # persistence: a prefilled prompt saved to disk and restored (speculative/kvfile.py)
    def read(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V (Hkv, end-start, D) of one layer's tokens, where they live (host or device, no copy)."""
        ...

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """K, V (Hkv, n, D) into one layer's slots [start, start + n), the length unchanged."""
        ...

    def fill(self, length: int) -> None:
        """The first `length` slots now hold the sequence (as written)."""
        ...
