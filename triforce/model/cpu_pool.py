"""The CPU kernels' threads: one pool for the process, shared by every kernel module of ours.

Why not OpenMP's threads (at::parallel_for), which the kernels used before: a parallel call there
ends at a barrier where the caller waits for every thread of the team, started or not. The command
line lets waiting threads sleep (OMP_WAIT_POLICY=PASSIVE: spinning threads fight a busy machine's
other jobs for its cores), so each of a SmolLM2 decode step's ~150 calls paid for waking a thread
and then for being woken (~45 us on this project's 2-core EPYC): two threads decoded slower than
one. With spinning threads the calls were cheap, but on a loaded machine a step collapsed (x10-x80)
whenever the caller spun at the barrier for a thread the system had not scheduled.

Here the caller never waits for a thread that has not started: it takes tasks itself from the
first moment, each task taken by whichever thread is free, and at the end it waits only for tasks
already under way. A helper that is late (asleep, or not scheduled) finds the tasks gone, and the
call costs what one thread would. A helper spins for SPIN_US after its last task, which catches the
next call of a decode step, and then sleeps on a futex, so an idle process costs nothing.

Each kernel module's prelude (csrc/prelude.h) calls the pool through the function whose address
its use_pool op receives from `address()`; the pool's own ops (`workers`, `spread`) serve tests.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

import torch

from . import cpu_kernels

POOL_SOURCE = cpu_kernels.csrc("cpu_pool.cpp")

KERNEL = cpu_kernels.Kernel("triforce_cpu_pool", POOL_SOURCE, isa=frozenset(), prelude=False)

_ADDRESS: list[int] = []


_SCOPES: list[int] = []  # the torch threads each open kernels_threaded scope took, innermost last


@contextmanager
def kernels_threaded():
    """Within: torch's own ops on the calling thread, the pool's kernels on the threads torch had.
    For decoding on our kernels (a pass of a few rows, or the engine's whole decode loop), where
    torch's ops are small (a norm, the logits' conversion, sampling over the vocabulary) and an
    OpenMP region costs more than it saves: under OpenMP's default wait policy its threads then spin
    for a while after, on the cores the pool's helpers need (SmolLM2 bf16 at 4K on two cores: 11.2 ms
    a step against 7.1 with this). Nested scopes change nothing; `torch_threaded` undoes it for a
    pass of many rows inside."""
    threads = torch.get_num_threads()
    if threads == 1 or not (_ADDRESS and _ADDRESS[0]):  # one thread anyway, or no kernel of ours took the pool
        yield
        return
    torch.ops.triforce_pool.set_threads(threads)
    torch.set_num_threads(1)
    _SCOPES.append(threads)
    try:
        yield
    finally:
        _SCOPES.pop()
        torch.set_num_threads(threads)
        torch.ops.triforce_pool.set_threads(_SCOPES[-1] if _SCOPES else 0)


@contextmanager
def torch_threaded():
    """Within a kernels_threaded scope, torch's ops on its threads again: a prefill piece or a long
    catch-up pass, whose GEMMs want them. Elsewhere nothing changes."""
    if not _SCOPES or torch.get_num_threads() != 1:
        yield
        return
    torch.set_num_threads(_SCOPES[-1])
    try:
        yield
    finally:
        torch.set_num_threads(1)


def address() -> int:
    """The pool's entry point, for the kernel modules' use_pool ops; 0 where it does not build."""
    if not _ADDRESS:
        _ADDRESS.append(_build())
    return _ADDRESS[0]


def _build() -> int:
    if os.name != "posix" or not KERNEL.load():
        return 0
    return int(torch.ops.triforce_pool.address())
