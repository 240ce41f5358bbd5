"""Bringing offloaded layers' KV to the device: two staging slots, chunked copies, write-back.

Layer j of the host store goes to slot j % 2, so while the model computes layer j from one slot
the copy of layer j+1 fills the other. On CUDA the copies run on a side stream and are ordered
with events only (no device-wide synchronize):

    copy stream:    wait freed[s] -> H2D chunks of layer j into slot s -> record copied[s]
    compute stream: wait copied[s] -> write new tokens into slot s -> attention -> record freed[s]
    copy stream:    wait (new tokens written) -> D2H of the new tokens into the host store

Each slot remembers which layer it holds and how many leading tokens of it are valid, so a copy
only brings what is missing: nothing when a layer is still staged from the previous pass (one
offloaded layer, or the next pass's first layer prefetched at the end of a pass), and a rollback
just lowers the valid count. On CPU the "device" is the CPU: the same copies are synchronous
memcpys into the staging buffers, timed with a wall clock.
"""
from __future__ import annotations

import time

import torch

from .counters import Counters, Pass


class Streamer:
    def __init__(self, store, device: torch.device, chunk_tokens: int, counters: Counters):
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
        self.store, self.device, self.chunk, self.counters = store, device, chunk_tokens, counters
        _, max_len, heads, dim = store.k.shape

        def slot():
            return torch.empty(max_len, heads, dim, dtype=store.k.dtype, device=device)

        self.k, self.v = [slot(), slot()], [slot(), slot()]
        self.held: list[tuple[int, int] | None] = [None, None]  # (store layer, valid tokens) per slot
        self.cuda = device.type == "cuda"
        self.pass_: Pass | None = None
        if self.cuda:
            self.stream = torch.cuda.Stream(device)
            self.copied = [torch.cuda.Event(), torch.cuda.Event()]
            self.freed = [torch.cuda.Event(), torch.cuda.Event()]
            self.written = torch.cuda.Event()
            self._timing: list[tuple[Pass, str, torch.cuda.Event, torch.cuda.Event]] = []

    @property
    def nbytes(self) -> int:
        return 4 * self.k[0].numel() * self.k[0].element_size()

    # ------------------------------------------------------------------ copies
    def fetch(self, j: int, length: int) -> None:
        """Start bringing store layer j's tokens [:length] into its slot (async on CUDA)."""
        s = j % 2
        valid = self.held[s][1] if self.held[s] and self.held[s][0] == j else 0
        self.held[s] = (j, max(valid, length))
        if valid >= length:
            return
        src_k, src_v = self.store.k[j], self.store.v[j]
        if self.cuda:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(self.freed[s])  # the layer computed from this slot is done with it
                start = self._event()
                self._copy_chunks(src_k, src_v, self.k[s], self.v[s], valid, length)
                self.copied[s].record(self.stream)
                self._timing.append((self.pass_, "copy", start, self._event()))
        else:
            t0 = time.perf_counter()
            self._copy_chunks(src_k, src_v, self.k[s], self.v[s], valid, length)
            spent = time.perf_counter() - t0
            self._add_times(spent, spent)  # synchronous: compute waited for all of it
        self.counters.add_h2d(2 * (length - valid) * self.store.token_bytes)

    def _copy_chunks(self, src_k, src_v, dst_k, dst_v, start: int, end: int) -> None:
        # chunks bound each DMA's size and keep the source contiguous (token-major store): a
        # non-contiguous pinned source would make torch stage it through pageable memory, synchronously
        for a in range(start, end, self.chunk):
            b = min(a + self.chunk, end)
            dst_k[a:b].copy_(src_k[a:b], non_blocking=True)
            dst_v[a:b].copy_(src_v[a:b], non_blocking=True)

    def acquire(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot holding layer j, once its copy has landed (compute waits on an event, not the host)."""
        s = j % 2
        assert self.held[s] is not None and self.held[s][0] == j, (j, self.held)
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            before = self._event(compute)
            compute.wait_event(self.copied[s])
            self._timing.append((self.pass_, "wait", before, self._event(compute)))
        return self.k[s], self.v[s]

    def write_back(self, j: int, start: int, end: int) -> None:
        """Copy tokens [start, end) of layer j, just written into its slot, back to the host store."""
        s = j % 2
        self.held[s] = (j, end)
        dst_k, dst_v = self.store.k[j], self.store.v[j]
        if self.cuda:
            ready = self._event(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(ready)
                self._copy_chunks(self.k[s], self.v[s], dst_k, dst_v, start, end)
                self.written.record(self.stream)
        else:
            t0 = time.perf_counter()
            self._copy_chunks(self.k[s], self.v[s], dst_k, dst_v, start, end)
            spent = time.perf_counter() - t0
            self._add_times(spent, spent)
        self.counters.add_d2h(2 * (end - start) * self.store.token_bytes)

    def release(self, j: int) -> None:
        """Compute has finished with layer j's slot: the next copy into it may start."""
        if self.cuda:
            self.freed[j % 2].record(torch.cuda.current_stream(self.device))

    def slot(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Staging slot s's K and V buffers (max_len, Hkv, D): a graphed pass (graphed.py) fills them itself."""
        return self.k[s], self.v[s]

    def hand_over(self) -> None:
        """A graphed pass is about to use the slots and read the store: it runs after every copy
        issued so far (a write-back still landing in the store included), and the slots' contents
        are forgotten, so an eager pass after it refetches."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self.held = [None, None]

    def take_back(self) -> None:
        """The first eager pass after graphed ones: its copies wait for the graphs' work on the slots."""
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def truncate(self, length: int) -> None:
        """After a rollback: staged tokens beyond `length` are no longer valid."""
        self.held = [None if h is None else (h[0], min(h[1], length)) for h in self.held]

    def sync_host(self) -> None:
        """Before the host reads the store: every write-back has landed (waits on one event)."""
        if self.cuda:
            self.written.synchronize()

    # ------------------------------------------------------------------ timing
    def begin_pass(self, p: Pass) -> None:
        self.pass_ = p
        if self.cuda:
            self._pass_start = self._event(torch.cuda.current_stream(self.device))
        else:
            self._pass_start = time.perf_counter()

    def end_pass(self) -> None:
        """Wall time of the pass: host clock on CPU, compute-stream events on CUDA."""
        if self.cuda:
            self._timing.append((self.pass_, "pass", self._pass_start,
                                 self._event(torch.cuda.current_stream(self.device))))
        elif self.pass_ is not None:
            self.pass_.seconds += time.perf_counter() - self._pass_start
            self.counters.pass_seconds += time.perf_counter() - self._pass_start

    def _event(self, stream=None) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream or self.stream)
        return ev

    def _add_times(self, copy: float, wait: float) -> None:
        if self.pass_ is not None:
            self.counters.add_times(self.pass_, copy, wait)

    def resolve(self, block: bool = False) -> None:
        """Turn finished CUDA event pairs into seconds; unfinished ones wait unless `block`."""
        if not self.cuda:
            return
        pending = []
        for p, kind, a, b in self._timing:
            if block or b.query():
                b.synchronize()
                seconds = a.elapsed_time(b) / 1e3
                if p is not None and kind == "pass":
                    p.seconds += seconds
                    self.counters.pass_seconds += seconds
                elif p is not None:
                    self.counters.add_times(p, seconds if kind == "copy" else 0.0, seconds if kind == "wait" else 0.0)
            else:
                pending.append((p, kind, a, b))
        self._timing = pending
