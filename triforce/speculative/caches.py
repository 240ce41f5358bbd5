"""KV caches: preallocated static-shape buffers, written in place, rolled back by a length pointer.

Each implements `model.kv.Cache` (the full cache also `model.kv.FullKV`). `length` counts tokens of
the sequence the cache represents (not slots), so engines reason in sequence positions whatever the
cache keeps.
"""
from __future__ import annotations

import torch

from triforce.model import fused_layers, key_tiles
from triforce.model.attention import store_and_attend
from triforce.model.errors import UserError
from triforce.model.kv import KVShape


class SlotCache:
    """Shared mechanics: K and V buffers (layers, kv_heads, slots, head_dim) with `used` slots live."""

    max_feed: int  # most tokens one forward may add
    tiled = False  # keys in tiles, values in pairs (model/key_tiles.py): only a full cache, where the shape says so

    def __init__(self, shape: KVShape, slots: int):
        self.shape = shape
        self.k = shape.buffer(slots)
        self.v = shape.buffer(slots)
        self.used = 0
        self.length = 0
        self._pending = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return store_and_attend(q, k, v, self.k, self.v, layer, self.used, self.tiled)

    def run_stack(self, stack, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
        """x through every layer in one call (model/fused_layers.py's stack), attending as `attend`
        would, or None where `attend` takes another route for these rows."""
        if not fused_layers.runs_stack(self.k, self.tiled):
            return None
        x, queries = fused_layers.run_stack(stack, x, cos, sin, self.k, self.v, self.used)
        self._attended(queries)
        return x

    def _attended(self, queries: list[torch.Tensor]) -> None:
        """Each layer's queries of a pass through run_stack (a full cache keeps them)."""

    def end(self, T: int) -> None:
        self.used += T
        self.length += T

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


class FullCache(SlotCache):
    """Every token of the sequence, in order, on the model's device: slot i holds token i
    (`model.kv.FullKV`; offload.OffloadedCache is the same protocol over host memory)."""

    bytes_moved = 0  # nothing crosses a link: the cache lives where the model computes

    def __init__(self, shape: KVShape, max_len: int, prefill_chunk: int = 512):
        # keys in tiles and values in pairs where the CPU bf16 kernels read them (a decode step's
        # scores at 0.7x the time, its values' product at 0.8x)
        self.tiled = shape.tiled_keys
        super().__init__(shape, key_tiles.slots_for(max_len) if self.tiled else max_len)
        self.max_feed = prefill_chunk
        self.queries: list[torch.Tensor | None] = [None] * shape.num_layers

    def begin(self, T: int) -> torch.Tensor:
        if self.length + T > self.capacity:
            raise UserError(f"sequence of {self.length + T} tokens exceeds the cache's {self.capacity}; "
                            f"lower GenerationConfig.max_new_tokens or raise Settings.context")
        return torch.arange(self.length, self.length + T, device=self.shape.device)

    def attend(self, layer, q, k, v):
        self.queries[layer] = q  # kept for retrieval scoring; (T, Hq, D), rotated
        return super().attend(layer, q, k, v)

    def _attended(self, queries):
        self.queries = list(queries)

    def rollback(self, length: int) -> None:
        assert 0 <= length <= self.length, (length, self.length)
        self.used = self.length = length

    def timings(self) -> None:
        return None  # no transfers to time

    # --- persistence (speculative/kvfile.py) ---
    def read(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V (Hkv, end-start, D) of one layer's tokens [start, end), where they live (a view; a tiled
        cache's, a plain copy)."""
        return self._keys(self.k[layer], start, end), self._values(self.v[layer], start, end)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Put K, V (Hkv, n, D) into one layer's slots [start, start + n); the length is unchanged."""
        if self.tiled:
            slots = torch.arange(start, start + k.shape[1], device=self.k.device)
            key_tiles.write(self.k[layer], slots, k)
            key_tiles.write_values(self.v[layer], slots, v)
        else:
            self.k[layer, :, start:start + k.shape[1]] = k
            self.v[layer, :, start:start + v.shape[1]] = v

    def _keys(self, buffer: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Keys [start, end) of a buffer (..., slots, D), plainly laid out."""
        return key_tiles.read(buffer, start, end) if self.tiled else buffer[..., start:end, :]

    def _values(self, buffer: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Values [start, end) of a buffer (..., slots, D), plainly laid out."""
        return key_tiles.read_values(buffer, start, end) if self.tiled else buffer[..., start:end, :]

    def fill(self, length: int) -> None:
        """The first `length` slots now hold the sequence (written with `write`)."""
        if length > self.capacity:
            raise ValueError(f"{length} tokens do not fit the cache's {self.capacity}")
        self.used = self.length = length

    # --- what the retrieval cache reads ---
    def chunk_key_means(self, layer: int, chunk: int, n_chunks: int) -> torch.Tensor:
        """(Hkv, n_chunks, D) mean key of each of the first n_chunks complete chunks."""
        keys = self._keys(self.k[layer], 0, n_chunks * chunk)
        return keys.view(keys.shape[0], n_chunks, chunk, -1).float().mean(dim=2)

    def gather(self, layer: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V (Hkv, n, D) of token positions `index` (Hkv, n), chosen per KV head."""
        heads = torch.arange(index.shape[0], device=index.device)[:, None]
        if self.tiled:
            return key_tiles.gather(self.k[layer], index), key_tiles.gather_values(self.v[layer], index)
        return self.k[layer][heads, index], self.v[layer][heads, index]  # indexing: 2x gather in bf16

    def slice(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V (layers, Hkv, end-start, D) of tokens [start, end)."""
        return self._keys(self.k, start, end), self._values(self.v, start, end)


class StreamingCache(SlotCache):
    """StreamingLLM: the first `sinks` tokens plus a recent window, for the drafter.

    Positions are slot indices, not sequence positions, so a model trained on short contexts
    sees positions it knows however long the sequence grows. Eviction moves the recent window
    down next to the sinks and rotates its keys back by the distance moved, which keeps queries
    and keys aligned. Evicting happens in blocks (the slack) so the move is amortised.
    """

    def __init__(self, shape: KVShape, rotary, sinks: int, window: int, slack: int = 64):
        super().__init__(shape, sinks + window + slack)
        self.rotary, self.sinks, self.window = rotary, sinks, window
        self.max_feed = slack
        self.evictions = 0

    def begin(self, T: int) -> torch.Tensor:
        self.make_room(T)
        return torch.arange(self.used, self.used + T, device=self.shape.device)

    def make_room(self, T: int) -> None:
        """Evict now if T more slots would not fit (a device round evicts before it starts, so that
        slots map to positions by one shift throughout)."""
        if self.used + T > self.capacity:
            if T > self.capacity - self.sinks:
                raise RuntimeError(f"{T} tokens do not fit the StreamingLLM cache's {self.capacity - self.sinks} window slots")
            # down to the window, not just enough for T: the next `slack` slots then need no move
            # (keeping all that fits moved the whole window on every pass once it was full, which
            # doubled a SmolLM2 draft pass on CPU, 5.5 -> 11 ms)
            self._evict(keep=min(self.used - self.sinks, self.window, self.capacity - self.sinks - T))

    def wrote_to(self, length: int) -> None:
        """Slots up to sequence position `length` were written through a view (rounds.CursorView),
        at the current shift between positions and slots."""
        self.used += length - self.length
        self.length = length

    def reset(self) -> None:
        """Empty, as freshly built."""
        self.used = self.length = self.evictions = 0

    def snapshot(self) -> dict[str, torch.Tensor]:
        """The live slots and where they stand (a prompt's window, kept to restore it without a pass)."""
        return {"k": self.k[:, :, :self.used].clone(), "v": self.v[:, :, :self.used].clone(),
                "state": torch.tensor([self.used, self.length, self.evictions])}

    def restore(self, snap: dict[str, torch.Tensor]) -> None:
        """Stand as when `snap` was taken; ValueError (nothing changed) where it does not fit this cache."""
        k, v = snap["k"], snap["v"]
        used, length, evictions = (int(x) for x in snap["state"])
        expected = (*self.k.shape[:2], used, self.k.shape[3])
        if tuple(k.shape) != expected or tuple(v.shape) != expected or k.dtype != self.k.dtype or used > self.capacity:
            raise ValueError(f"a window of {tuple(k.shape)} {k.dtype} does not fit a cache of {tuple(self.k.shape)} {self.k.dtype}")
        self.k[:, :, :used].copy_(k)
        self.v[:, :, :used].copy_(v)
        self.used, self.length, self.evictions = used, length, evictions

    def skipped_to(self, length: int) -> None:
        """The slots hold the sinks and the window ending at `length` (fed as one piece, the tokens
        between dropped): they stand for the sequence's first `length` tokens, no longer 1:1."""
        self.length = length
        self.evictions += 1

    def _evict(self, keep: int) -> None:
        src = self.used - keep
        shift = src - self.sinks
        if shift <= 0:
            return
        for buf, rotate in ((self.k, True), (self.v, False)):
            window = buf[:, :, src:self.used]
            if rotate:  # (L, H, keep, D) -> rotate by -shift as (keep, L*H, D) rows
                L, H, n, D = window.shape
                window = self.rotary.shift(window.permute(2, 0, 1, 3).reshape(n, L * H, D), -shift)
                window = window.view(n, L, H, D).permute(1, 2, 0, 3)
            buf[:, :, self.sinks:self.sinks + keep] = window.clone()
        self.used = self.sinks + keep
        self.evictions += 1

    def rollback(self, length: int) -> None:
        drop = self.length - length
        floor = self.sinks if self.evictions else 0  # before any eviction slots map 1:1 to tokens
        if drop < 0 or drop > self.used - floor:
            raise RuntimeError(f"streaming cache cannot roll back {drop} tokens (window {self.used - floor})")
        self.used -= drop
        self.length = length

    def window_tokens(self) -> tuple[int, int]:
        """(sink slots, recent slots) currently live."""
        return min(self.sinks, self.used), max(0, self.used - self.sinks)
