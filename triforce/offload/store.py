"""The full KV cache kept in host memory and streamed to the device layer by layer.

`HostStore` holds K and V of the offloaded layers, pinned when CUDA is present, sized once for
the longest sequence and written in place. `OffloadedCache` speaks exactly the FullCache
protocol (begin/attend/end/rollback, queries, chunk_key_means/gather/slice), so every engine runs
on it unchanged; the first `onchip_layers` layers stay resident on the device.

Layout is token-major, (layers, tokens, kv_heads, head_dim), unlike FullCache's head-major one:
a layer's live prefix [:length] and every chunk of it is then one contiguous block (one DMA per
chunk), and it is flash-attn's KV layout. The attention math is `model.attention.attend`
on a transposed view, so offloading changes no number the model computes.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from triforce.model.attention import attend
from triforce.model.kv import KVShape
from triforce.model.errors import UserError

from .counters import Counters
from .streamer import Streamer


# the widest eager pass whose new K/V stay on the device for the retrieval cache's absorb: a
# verification's, not a prefill piece's (2,048 tokens of every layer)
KEEP_FRESH = 64


class HostStore:
    """K and V of `layers` layers for up to `max_len` tokens, in host memory."""

    def __init__(self, layers: int, max_len: int, heads: int, head_dim: int, dtype: torch.dtype, pin: bool):
        size = (layers, max_len, heads, head_dim)
        try:  # empty, not zeros: slots past the length pointer are never read
            self.k = torch.empty(size, dtype=dtype, pin_memory=pin)
            self.v = torch.empty(size, dtype=dtype, pin_memory=pin)
        except RuntimeError as e:
            gib = 2 * torch.Size(size).numel() * torch.finfo(dtype).bits / 8 / 2**30
            raise UserError(f"cannot allocate {gib:.1f} GiB of {'pinned ' if pin else ''}host memory for the KV "
                            f"store ({e.__class__.__name__}); lower Settings.context") from None
        self.token_bytes = heads * head_dim * self.k.element_size()  # one token of K (or V) in one layer

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def mapped(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K and V as tensors on `device` whose kernels write the host memory itself, or None where that
        does not work. On CPU the store is the device's memory. On CUDA a pinned buffer has one address
        for the host and every device (unified addressing), so a tensor over that address, made through
        the CUDA array interface, is one a kernel writes across the link; a probe write through it
        must land before it is trusted."""
        if device.type != "cuda":
            return self.k, self.v
        try:
            k, v = _on_device(self.k, device), _on_device(self.v, device)
            torch.cuda.synchronize(device)  # no copy back into the store still in flight
            landed = probe_write(self.k, k, lambda: torch.cuda.synchronize(device))
        except (RuntimeError, TypeError, ValueError, AttributeError):
            return None
        return (k, v) if landed else None


def probe_write(host: torch.Tensor, alias: torch.Tensor, wait: Callable[[], None]) -> bool:
    """Whether a kernel's write through `alias` lands in the memory of `host`, the same bytes seen
    from the host. The store is probed on first use, after the prompt's K/V are in it, so the probed
    values are put back whatever happens: else layer 0's first key would not be the one the model
    computed (an H200 caught exactly that: 16 bytes zeroed, the tokens unchanged at a test's size)."""
    first = host.view(-1).view(torch.int16)[:8]
    kept = first.clone()
    try:
        probe = torch.arange(1, 9, dtype=torch.int16, device=alias.device)
        alias.view(-1).view(torch.int16)[:8].index_copy_(0, torch.arange(8, device=alias.device), probe)
        wait()
        return torch.equal(first, probe.cpu())
    finally:
        wait()
        first.copy_(kept)


def _on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on `device` over pinned host tensor t's memory (as 16-bit integers through the
    interface, which names no bfloat16, then viewed as t's dtype)."""
    class Interface:
        __cuda_array_interface__ = {"data": (t.data_ptr(), False), "shape": tuple(t.shape), "version": 3,
                                    "typestr": f"<i{t.element_size()}",
                                    "strides": tuple(n * t.element_size() for n in t.stride())}

    with torch.cuda.device(device):
        alias = torch.as_tensor(Interface(), device=device).view(t.dtype)
    if alias.data_ptr() != t.data_ptr() or alias.shape != t.shape:
        raise ValueError("the device tensor is not the store's memory")
    return alias


class OffloadedCache:
    """FullCache's interface over a host store, a streamer and optional device-resident layers."""

    def __init__(self, shape: KVShape, max_len: int, prefill_chunk: int = 512, onchip_layers: int = 0,
                 chunk_tokens: int = 4096, prefetch_next: bool | None = None, pin: bool | None = None):
        L, H, D = shape.num_layers, shape.num_kv_heads, shape.head_dim
        if not 0 <= onchip_layers <= L:
            raise UserError(f"Settings.onchip_layers {onchip_layers} is outside 0..{L} (the model has {L} layers)")
        self.shape, self.max_len, self.max_feed = shape, max_len, prefill_chunk
        self.device = torch.device(shape.device)
        cuda = self.device.type == "cuda"
        self.onchip = onchip_layers
        self.resident_k = torch.zeros(onchip_layers, max_len, H, D, dtype=shape.dtype, device=self.device)
        self.resident_v = torch.zeros_like(self.resident_k)
        self.store = HostStore(L - onchip_layers, max_len, H, D, shape.dtype, pin=cuda if pin is None else pin)
        self.counters = Counters()
        self.streamer = Streamer(self.store, self.device, chunk_tokens, self.counters) if L > onchip_layers else None
        # prefetching the next pass's first offloaded layer overlaps it with drafting; on CPU the copy
        # is synchronous, so it would only add the rejected tokens' bytes
        self.prefetch_next = cuda if prefetch_next is None else prefetch_next
        self.length = 0
        self.queries: list[torch.Tensor | None] = [None] * L
        # graphed passes (graphed.py): slots known finite (written or zeroed), the last pass's new
        # tokens on their way back to the store, its pinned staging per width, and who ran last
        self._finite = 0
        self._fresh: tuple | None = None
        # the last decode pass's new K/V on the device: (first position, k, v), each (offloaded layers,
        # T, Hkv, D) in a graph's buffers, or per layer the tensors an eager pass computed (lists);
        # read by `slice` until the next pass
        self._fresh_device: tuple | None = None
        self._eager_fresh: tuple[list, list] | None = None  # an eager pass's, while it runs
        self._staging: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._graphed = False
        # the store as the device's kernels write it: a graphed pass writes its new tokens' K/V there
        # itself, so the next pass can be queued with nothing for the host to do in between; None:
        # through pinned staging, which the host moves into place (flush_fresh) before the next pass
        self._mapped: tuple | None | bool = False  # False: not probed yet (the first graphed pass probes)
        self._written = None  # on CUDA, an event after the last graphed pass's writes into the store

    @property
    def mapped(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The store's K and V as the device's kernels write them (HostStore.mapped), or None: through
        staging. Probed on first use, by the first graphed pass: an eager run (tensor parallelism,
        --no-cuda-graphs) never maps it."""
        if self._mapped is False:
            self._mapped = self.store.mapped(self.device) if self.streamer else None
        return self._mapped

    @mapped.setter
    def mapped(self, value: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self._mapped = value

    def store_writes(self) -> str | None:
        """How passes' new K/V reach the store: 'mapped' (a graph writes it), 'staged' (a graph's go
        through pinned staging), 'eager' (no graphed pass yet: each layer's copy back), None: no store."""
        if not self.streamer:
            return None
        return "eager" if self._mapped is False else "staged" if self._mapped is None else "mapped"

    @property
    def capacity(self) -> int:
        return self.max_len

    @property
    def bytes_moved(self) -> int:
        """Every host<->device byte so far (the generator reports the part spent while decoding)."""
        return self.counters.bytes_moved

    def nbytes(self) -> int:
        staged = self.streamer.nbytes if self.streamer else 0
        return self.store.nbytes + 2 * self.resident_k.numel() * self.resident_k.element_size() + staged

    # ------------------------------------------------------------------ model protocol
    def begin(self, T: int) -> torch.Tensor:
        self._check_room(T)
        self.flush_fresh()
        # an eager decode pass's new K/V per offloaded layer, kept on the device for the retrieval
        # cache's absorb (as a graphed pass's are): from the store it waits for the write-backs
        self._fresh_device = None
        self._eager_fresh = ([], []) if T <= KEEP_FRESH else None
        if self.streamer:
            if self._graphed:
                self.streamer.take_back()
                self._graphed = False
            self.streamer.resolve()
            self.streamer.begin_pass(self.counters.start_pass(T, self.length))
            self.streamer.fetch(0, self.length)  # the first offloaded layer; the rest chain in attend
        return torch.arange(self.length, self.length + T, device=self.device)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.queries[layer] = q  # kept for retrieval scoring; (T, Hq, D), rotated
        start, end = self.length, self.length + k.shape[0]
        j = layer - self.onchip
        if j < 0:
            kb, vb = self.resident_k[layer], self.resident_v[layer]
        else:
            kb, vb = self.streamer.acquire(j)
            if j + 1 < self.store.k.shape[0]:
                self.streamer.fetch(j + 1, start)  # overlaps with this layer's compute below
        kb[start:end] = k
        vb[start:end] = v
        if j >= 0:
            self.streamer.write_back(j, start, end)
            if self._eager_fresh is not None:  # the layer's own tensors (the slot is refilled two layers on)
                self._eager_fresh[0].append(k.to(kb.dtype))
                self._eager_fresh[1].append(v.to(vb.dtype))
        out = attend(q, kb[:end].transpose(0, 1), vb[:end].transpose(0, 1))
        if j >= 0:
            self.streamer.release(j)
        return out

    def end(self, T: int) -> None:
        if self._eager_fresh is not None and self._eager_fresh[0]:
            self._fresh_device = (self.length, *self._eager_fresh)  # stacked if an absorb asks (slice)
        self._eager_fresh = None
        self.length += T
        self._finite = max(self._finite, self.length)
        if self.streamer:
            self.streamer.end_pass()
            if self.prefetch_next:
                self.streamer.fetch(0, self.length)

    def rollback(self, length: int) -> None:
        assert 0 <= length <= self.length, (length, self.length)
        self.length = length
        if self._fresh_device is not None and self._fresh_device[0] >= length:
            self._fresh_device = None
        if self.streamer:
            self.streamer.truncate(length)

    # ------------------------------------------------------------------ persistence (speculative/kvfile.py)
    def read(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V (Hkv, end-start, D) of one layer's tokens [start, end), where they live (no copy)."""
        k, v, _ = self._at_rest(layer)
        return k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Put K, V (Hkv, n, D) into one layer's slots [start, start + n); the length is unchanged."""
        kb, vb, _ = self._at_rest(layer)
        self._finite = max(self._finite, start + k.shape[1])
        self._fresh_device = None  # the store is the one copy of these slots now
        if self.streamer:
            self.streamer.truncate(min(start, self.length))  # staged copies of these slots are stale now
        kb[start:start + k.shape[1]] = k.transpose(0, 1)
        vb[start:start + v.shape[1]] = v.transpose(0, 1)

    def fill(self, length: int) -> None:
        """The first `length` slots now hold the sequence (written with `write`)."""
        if length > self.max_len:
            raise ValueError(f"{length} tokens do not fit the cache's {self.max_len}")
        self.length = length
        self._finite = max(self._finite, length)

    # ------------------------------------------------------------------ graphed passes (graphed.py)
    def _check_room(self, T: int) -> None:
        if self.length + T > self.max_len:
            raise UserError(f"sequence of {self.length + T} tokens exceeds the cache's {self.max_len}; "
                            f"lower GenerationConfig.max_new_tokens or raise Settings.context")

    def graph_begin(self, T: int) -> int:
        """Before a graphed pass of T tokens: the store up to date, the slots handed over; returns the
        pass's first slot (the length)."""
        self._check_room(T)
        self.flush_fresh()
        self.mapped  # noqa: B018 (probed here, eagerly, before the first capture reads it)
        self._fresh_device = None  # this pass's replay rewrites those buffers
        if self.streamer:
            self.streamer.hand_over()
        self._graphed = True
        self.counters.start_pass(T, self.length)
        return self.length

    def graph_span(self, end: int, bucket: int) -> int:
        """The tokens every offloaded layer brings in a graphed pass that ends at `end`: `end` rounded
        up to a bucket (one capture serves a bucket of lengths), at most the capacity. The store is made
        finite up to it, zeroed where nothing was written: a masked slot gets no weight, but its value
        is still multiplied by that zero, and 0 * NaN is NaN."""
        span = min(self.max_len, -(-end // bucket) * bucket)
        written = max(self._finite, self.length)
        if written < span:
            self.store.k[:, written:span].zero_()  # past every copy in flight: those read below the length
            self.store.v[:, written:span].zero_()
            self._finite = span
        self.counters.add_h2d(2 * span * self.store.token_bytes * self.store.k.shape[0])
        return span

    def graph_end(self, T: int, fresh_k: torch.Tensor, fresh_v: torch.Tensor) -> None:
        """After a graphed pass: the new tokens' K/V of the offloaded layers (layers, T, Hkv, D) are in
        the graph's device buffers, and, where the store is mapped, in the store (the graph wrote
        them). Else they start back to the store with one device->host copy into pinned staging, which
        flush_fresh moves into place before anything next reads the store."""
        if self.streamer and self.mapped is not None:
            if self.device.type == "cuda":
                self._written = torch.cuda.Event()
                self._written.record(torch.cuda.current_stream(self.device))
            self._fresh_device = (self.length, fresh_k, fresh_v)
            self.counters.add_d2h(2 * T * self.store.token_bytes * self.store.k.shape[0])
        elif self.streamer:
            stage = self._staging.get(T)
            if stage is None:
                pin = self.device.type == "cuda"
                stage = self._staging[T] = tuple(torch.empty(fresh_k.shape, dtype=fresh_k.dtype, pin_memory=pin)
                                                 for _ in range(2))
            stage[0].copy_(fresh_k, non_blocking=True)
            stage[1].copy_(fresh_v, non_blocking=True)
            done = None
            if self.device.type == "cuda":
                done = torch.cuda.Event()
                done.record(torch.cuda.current_stream(self.device))
            self._fresh = (self.length, T, stage, done)
            self._fresh_device = (self.length, fresh_k, fresh_v)
            self.counters.add_d2h(2 * T * self.store.token_bytes * self.store.k.shape[0])
        self.length += T
        self._finite = max(self._finite, self.length)

    def flush_fresh(self) -> None:
        """The last graphed pass's new tokens into the store (a host copy of T tokens a layer)."""
        if self._fresh is None:
            return
        start, T, (k, v), done = self._fresh
        self._fresh = None
        if done is not None and not done.query():  # landed long ago in practice: the host has read the pass's tokens
            done.synchronize()
        self.store.k[:, start:start + T] = k
        self.store.v[:, start:start + T] = v

    def timings(self) -> dict:
        """Counter summary, with every outstanding CUDA timing event resolved."""
        if self.streamer:
            self.streamer.resolve(block=True)
        return self.counters.summary()

    # ------------------------------------------------------------------ what the retrieval cache reads
    def _at_rest(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """K, V (max_len, Hkv, D) of a layer where it lives, and whether that is the host store."""
        j = layer - self.onchip
        if j < 0:
            return self.resident_k[layer], self.resident_v[layer], False
        self._host_may_touch()
        return self.store.k[j], self.store.v[j], True

    def _host_may_touch(self) -> None:
        """Before the host reads or writes the store: every pass's K/V has landed there."""
        self.flush_fresh()
        if self._written is not None:  # a graph's writes through the mapped store
            self._written.synchronize()
            self._written = None
        self.streamer.sync_host()

    def _to_device(self, t: torch.Tensor, from_host: bool) -> torch.Tensor:
        if not from_host:
            return t
        self.counters.add_h2d(t.numel() * t.element_size(), retrieval=True)
        return t.to(self.device)

    def chunk_key_means(self, layer: int, chunk: int, n_chunks: int) -> torch.Tensor:
        """(Hkv, n_chunks, D) mean key of each of the first n_chunks complete chunks."""
        keys, _, host = self._at_rest(layer)
        keys = keys[:n_chunks * chunk]
        means = keys.view(n_chunks, chunk, *keys.shape[1:]).float().mean(dim=1)  # where the keys are
        return self._to_device(means.transpose(0, 1).contiguous(), host)

    def gather(self, layer: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V (Hkv, n, D) of token positions `index` (Hkv, n), chosen per KV head."""
        k, v, host = self._at_rest(layer)
        rows = index.to(k.device)
        heads = torch.arange(k.shape[1], device=k.device)[:, None]
        return self._to_device(k[rows, heads], host), self._to_device(v[rows, heads], host)

    def slice(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V (layers, Hkv, end-start, D) of tokens [start, end). Tokens the last decode pass made
        (what the retrieval cache absorbs after every pass) come from the device, where the pass left
        them (a graph's buffers, an eager pass's own tensors): from the store they cost a wait on the
        write-back, a host copy and a blocking host-to-device copy out of pageable memory each pass."""
        ks = [self.resident_k[:, start:end].transpose(1, 2)]
        vs = [self.resident_v[:, start:end].transpose(1, 2)]
        fresh = self._fresh_device
        if fresh is not None and isinstance(fresh[1], list):  # an eager pass's, layer by layer
            fresh = self._fresh_device = (fresh[0], torch.stack(fresh[1]), torch.stack(fresh[2]))
        if self.streamer and fresh is not None and fresh[0] <= start and end <= fresh[0] + fresh[1].shape[1]:
            rows = slice(start - fresh[0], end - fresh[0])
            return torch.cat(ks + [fresh[1][:, rows].transpose(1, 2)]), torch.cat(vs + [fresh[2][:, rows].transpose(1, 2)])
        if self.streamer:
            self._host_may_touch()
            ks.append(self._to_device(self.store.k[:, start:end].transpose(1, 2).contiguous(), True))
            vs.append(self._to_device(self.store.v[:, start:end].transpose(1, 2).contiguous(), True))
        return torch.cat(ks), torch.cat(vs)
