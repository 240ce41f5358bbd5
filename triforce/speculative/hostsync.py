"""Counting the places where the host would wait for the device.

On a GPU the host queues kernels and runs ahead; it stops at a device-wide synchronize(), at every
read of a device value (item, tolist, cpu, numpy, and bool/int/float/index of a tensor) and at a
blocking host-to-device copy of a Python list (torch.tensor(list, device=...)), and where an
offloaded cache waits for its write-backs (Streamer.sync_host). On CPU nothing
waits, but the same call sites run, so counting the calls gives on CPU the count a GPU would pay.

`HostSyncCounter` patches those entry points while it is active. It counts every call made while
`counting` is true (the caller switches it on around the code it measures), and ignores calls made
from inside another counted call (tolist calling __index__, say): one read, one wait.
"""
from __future__ import annotations

import threading
from collections import Counter
from contextlib import contextmanager

import torch

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
_HOST_ONLY = threading.local()


@contextmanager
def on_the_host():
    """Around a read that only a CPU path makes (sampling.nucleus's search): on a GPU that path
    never runs, so the counter leaves it out."""
    _HOST_ONLY.depth = getattr(_HOST_ONLY, "depth", 0) + 1
    try:
        yield
    finally:
        _HOST_ONLY.depth -= 1


class HostSyncCounter:
    """with HostSyncCounter() as c: ... c.total, c.by_site (a Counter of entry point names)."""

    def __init__(self):
        self.by_site: Counter = Counter()
        self.counting = True
        self._inside = threading.local()
        self._saved: list[tuple[object, str, object]] = []

    @property
    def total(self) -> int:
        return sum(self.by_site.values())

    @contextmanager
    def paused(self):
        """Calls made inside are not counted (e.g. a test's own reads of the results)."""
        was, self.counting = self.counting, False
        try:
            yield
        finally:
            self.counting = was

    def _wrap(self, owner, name: str, site: str, applies=lambda *a, **k: True) -> None:
        original = getattr(owner, name)
        counter = self

        def counted(*args, **kwargs):
            if (getattr(counter._inside, "depth", 0) or getattr(_HOST_ONLY, "depth", 0) or not counter.counting
                    or not applies(*args, **kwargs)):
                return original(*args, **kwargs)
            counter._inside.depth = 1
            try:
                counter.by_site[site] += 1
                return original(*args, **kwargs)
            finally:
                counter._inside.depth = 0

        self._saved.append((owner, name, original))
        setattr(owner, name, counted)

    def __enter__(self) -> "HostSyncCounter":
        self._wrap(torch.cuda, "synchronize", "synchronize")
        # the engine's own helper does nothing on CPU: count its calls, where a GPU would wait
        import triforce.speculative.engine as engine
        self._wrap(engine, "synchronize", "synchronize", lambda device: device.type != "cuda")
        for name in READS:
            self._wrap(torch.Tensor, name, name)
        # the offloaded cache waits for its write-backs before the host reads its store (on CPU a no-op)
        from triforce.offload.streamer import Streamer
        self._wrap(Streamer, "sync_host", "offload write-back wait")
        self._wrap(torch, "tensor", "tensor(list)", lambda data, *a, **k: isinstance(data, (list, tuple)))
        self._wrap(torch, "as_tensor", "tensor(list)", lambda data, *a, **k: isinstance(data, (list, tuple)))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()
