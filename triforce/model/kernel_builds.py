"""The CPU kernels a run will use, compiled before it starts, with progress.

Each kernel module compiles at first use (cpu_kernels.Kernel: 9-12 s a module on a 2-core CPU, up
to four modules a run). Left to first use, a fresh machine's first run sat silent inside its
prefill while they compiled: the bar said 4,096 tokens at "311 tok/s" in 48 s, 35 s of them
compiling. Built here, ahead of the run, they compile side by side on the free cores and the run
says so; a machine that has them built pays a file check per module."""
from __future__ import annotations

import os
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Callable

import torch

from .cpu_kernels import Kernel

REPORT_SECONDS = 0.5  # how often the report's clock moves while modules compile


def kernels(dtype: torch.dtype, stored: bool = True) -> list[Kernel]:
    """The kernel modules a CPU run in `dtype` uses that this CPU can run: the pool, the layer ops,
    attention in the dtype's own code (bfloat16: avx512_bf16; float32: avx2) and, with `stored`
    (weights kept as a GGUF's blocks), the stored blocks' products in that code (bfloat16 with AMX:
    its tile kernels too)."""
    from . import cpu_pool, decode_attention, decode_attention_f32, layer_ops, stored_amx, stored_avx2, stored_bf16

    modules = [cpu_pool, layer_ops]
    if dtype == torch.bfloat16:
        modules += [decode_attention] + ([stored_bf16] + ([] if stored_amx.OFF else [stored_amx]) if stored else [])
    elif dtype == torch.float32:
        modules += [decode_attention_f32] + ([stored_avx2] if stored else [])
    return [m.KERNEL for m in modules if m.KERNEL.fits()]


def build(dtype: torch.dtype, stored: bool = True, report: Callable[[str], None] | None = None,
          workers: int | None = None) -> int:
    """Compile and load the modules a CPU run in `dtype` uses (`stored`: see kernels) that have no
    build on disk; see compile_all. Returns how many compiled."""
    return compile_all([k for k in kernels(dtype, stored) if not k.compiled()], report, workers)


def compile_all(todo: list, report: Callable[[str], None] | None = None, workers: int | None = None) -> int:
    """Load each of `todo` (objects with a `load()`, a Kernel's build-or-find), `workers` at a time
    (default: the cores this process may use); `report` gets a line of progress when the work
    starts, at least every REPORT_SECONDS after, and one starting "compiled " at the end, naming any
    module that did not build (it stays unbuilt for the process: its callers keep torch's ops)."""
    if not todo:
        return 0
    workers = max(1, min(workers or len(os.sched_getaffinity(0)), len(todo)))
    clock = BuildClock(len(todo), workers)
    failed: list[str] = []

    def compile_one(kernel) -> None:
        began = clock.started()
        try:
            built = kernel.load()
        except Exception:  # noqa: BLE001 - Kernel.load says False; anything else is the same to the run
            built = False
        finally:
            clock.finished(began)
        if not built:
            failed.append(getattr(kernel, "name", str(kernel)))

    with ThreadPoolExecutor(workers) as pool:  # the compiler runs as a child process: threads suffice
        pending = {pool.submit(compile_one, k) for k in todo}
        while pending:
            if report is not None:
                report(clock.line())
            _, pending = wait(pending, timeout=REPORT_SECONDS, return_when=FIRST_COMPLETED)
    if report is not None:
        report(done_line(len(todo), sorted(failed), clock.elapsed()))
    return len(todo)


def done_line(total: int, failed: list[str], seconds: float) -> str:
    if not failed:
        return f"compiled the CPU kernels in {seconds:.0f} s (once per machine)"
    return (f"compiled {total - len(failed)} of {total} CPU kernels in {seconds:.0f} s; {', '.join(failed)} did not "
            "build here (they need a C++ compiler, g++, and Python's headers): torch's ops run in their place, slower")


class BuildClock:
    """Progress of `total` modules compiling `workers` at a time, and an honest time left: a module
    under way needs the mean time of those done less what it has had (at least a second), and each
    module not started needs that mean, `workers` at a time. No time left before one is done: the
    modules are alike (the headers dominate), but nothing measured says how fast this machine is."""

    def __init__(self, total: int, workers: int, now: Callable[[], float] = time.monotonic):
        self.total, self.workers, self.now = total, workers, now
        self.start = now()
        self.running: list[float] = []  # start times of the modules under way
        self.durations: list[float] = []

    def started(self) -> float:
        began = self.now()
        self.running.append(began)
        return began

    def finished(self, began: float) -> None:
        self.running.remove(began)
        self.durations.append(self.now() - began)

    def elapsed(self) -> float:
        return self.now() - self.start

    def seconds_left(self) -> float | None:
        if not self.durations:
            return None
        mean = sum(self.durations) / len(self.durations)
        now = self.now()
        under_way = max((max(mean - (now - began), 1.0) for began in self.running), default=0.0)
        waiting = self.total - len(self.durations) - len(self.running)
        return under_way + mean * -(-waiting // self.workers)

    def line(self) -> str:
        """'compiling the CPU kernels (first run here): 2 of 4 done, 10 s, about 9 s left'."""
        line = (f"compiling the CPU kernels (first run here): {len(self.durations)} of {self.total} done, "
                f"{self.elapsed():.0f} s")
        left = self.seconds_left()
        return line + (f", about {left:.0f} s left" if left is not None else "")
