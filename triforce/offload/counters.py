"""Byte and time counters of the offloaded KV cache.

Bytes are counted where copies are issued, so the figures are exact and machine-independent:
host->device (h2d) for streamed KV prefixes and for what the retrieval cache reads, device->host
(d2h) for the new tokens written back. Times: on CPU copies are synchronous memcpys timed with a
wall clock (all of it is waiting); on CUDA they come from events on the copy stream (copy time)
and on the compute stream around each wait (the part of the copy that compute did not hide).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Pass:
    tokens: int  # new tokens fed by this forward
    length: int  # cached tokens before it
    h2d: int = 0
    d2h: int = 0
    copy_seconds: float = 0.0  # time the link was busy (CUDA: copy-stream events; CPU: memcpy wall time)
    wait_seconds: float = 0.0  # time compute stood still waiting for a copy
    seconds: float = 0.0  # the whole pass (CPU: host clock; CUDA: compute-stream events)


@dataclass
class Counters:
    h2d: int = 0  # every host->device byte: streamed KV and retrieval reads
    d2h: int = 0  # every device->host byte: written-back KV
    retrieval_h2d: int = 0  # the part of h2d that the retrieval cache read (chunk means, gathers, slices)
    copy_seconds: float = 0.0
    wait_seconds: float = 0.0
    pass_seconds: float = 0.0
    passes: list[Pass] = field(default_factory=list)
    keep_passes: int = 4096  # per-pass records kept (the totals above never drop anything)

    @property
    def bytes_moved(self) -> int:
        return self.h2d + self.d2h

    def start_pass(self, tokens: int, length: int) -> Pass:
        p = Pass(tokens, length)
        self.passes.append(p)
        if len(self.passes) > self.keep_passes:
            del self.passes[: len(self.passes) - self.keep_passes]
        return p

    def current(self) -> Pass | None:
        return self.passes[-1] if self.passes else None

    def add_h2d(self, n: int, retrieval: bool = False) -> None:
        self.h2d += n
        if retrieval:
            self.retrieval_h2d += n
        elif self.passes:
            self.passes[-1].h2d += n

    def add_d2h(self, n: int) -> None:
        self.d2h += n
        if self.passes:
            self.passes[-1].d2h += n

    def add_times(self, p: Pass, copy: float, wait: float) -> None:
        p.copy_seconds += copy
        p.wait_seconds += wait
        self.copy_seconds += copy
        self.wait_seconds += wait

    def summary(self) -> dict:
        """Totals, achieved link bandwidth, and the share of copy time compute did not hide."""
        streamed = self.h2d - self.retrieval_h2d + self.d2h
        return {
            "h2d_bytes": self.h2d, "d2h_bytes": self.d2h, "retrieval_h2d_bytes": self.retrieval_h2d,
            "bytes_moved": self.bytes_moved, "passes": len(self.passes),
            "copy_seconds": self.copy_seconds, "wait_seconds": self.wait_seconds, "pass_seconds": self.pass_seconds,
            "compute_seconds": self.pass_seconds - self.wait_seconds,
            "bandwidth_gbps": streamed / self.copy_seconds / 1e9 if self.copy_seconds > 0 else None,
            "hidden_fraction": 1 - self.wait_seconds / self.copy_seconds if self.copy_seconds > 0 else None,
        }
