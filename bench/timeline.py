"""Where a decode run's time goes on the device: one profiled run, its GPU activity merged into busy
intervals by kind, against the run's wall time.

bench.bench's rows say how fast a system decodes; this says why it is not faster. Plain decoding with
the KV in host memory at 4K took 2.39 ms a token on the H200 where its link floor is 1.75 and the
pass with the KV resident 1.80 (session 36): either the copies and the kernels do not overlap, or
the device waits on the host between passes. An adaptive run spent 0.4-0.6 ms a token more than its
passes' sum (session 37). Per token, from the profiler's device activity (CUPTI; kernels and copies
inside CUDA graph replays included):

    wall      the run's time, first device activity to last
    kernels   the union of the compute kernels' intervals
    h2d, d2h  the same for host-to-device and device-to-host copies
    busy      the union of everything the device did
    overlap   kernels + h2d - (kernels | h2d): the copies hidden under compute
    idle      wall - busy: the device waiting, mostly on the host

`python -m bench.bench ... --timeline` adds one such run of TOKENS tokens per system after the timed
ones (the profiler slows launches, so it is never one of them). On CPU there is no device activity:
the entry says so and gives the wall time alone.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

KINDS = ("kernels", "h2d", "d2h", "other")
TOKENS = 16  # decoded in the profiled run: enough passes of every kind, few enough records to sort


def kind_of(name: str) -> str:
    """A device activity's kind from its profiler name ("Memcpy HtoD (Pinned -> Device)", a kernel's)."""
    if name.startswith("Memcpy"):
        return "h2d" if "HtoD" in name else "d2h" if "DtoH" in name else "other"
    if name.startswith("Memset"):
        return "other"
    return "kernels"


def union_length(intervals: list[tuple[float, float]]) -> float:
    """The total length covered by `intervals` (start, end), overlaps counted once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def summarize(intervals: dict[str, list[tuple[float, float]]], tokens: int) -> dict:
    """Per-token milliseconds of each kind, busy, overlap and idle, from intervals in microseconds."""
    every = [iv for kind in KINDS for iv in intervals.get(kind, [])]
    if not every:
        return {"device_activity": False}
    wall = max(e for _, e in every) - min(s for s, _ in every)
    per = {kind: union_length(intervals.get(kind, [])) for kind in KINDS}
    busy = union_length(every)
    overlap = per["kernels"] + per["h2d"] - union_length(intervals.get("kernels", []) + intervals.get("h2d", []))
    scale = 1e-3 / max(tokens, 1)  # us in all -> ms a token
    out = {"device_activity": True, "tokens": tokens, "wall": wall * scale, "busy": busy * scale,
           "overlap": overlap * scale, "idle": (wall - busy) * scale}
    out.update({kind: per[kind] * scale for kind in KINDS})
    out["launches"] = {kind: len(intervals.get(kind, [])) for kind in KINDS}
    return out


def device_intervals(events) -> dict[str, list[tuple[float, float]]]:
    """The profiler's CUDA activity as (start, end) microseconds by kind."""
    out: dict[str, list[tuple[float, float]]] = {kind: [] for kind in KINDS}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[kind_of(e.name)].append((e.time_range.start, e.time_range.end))
    return out


def profile_run(run: Callable[[], int], cuda: bool) -> dict:
    """run() (which decodes and returns its token count) profiled on CUDA: the device summary, and
    `host_wall`, the run's ms a token as the host saw it (the profiler's launch cost included).
    Elsewhere there is no device to watch, and the CPU profiler's per-op records would multiply a
    run's time: the run is timed alone."""
    if not cuda:
        start = time.perf_counter()
        tokens = run()
        return {"device_activity": False, "host_wall": (time.perf_counter() - start) * 1e3 / max(tokens, 1)}
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    # the CPU activity too, as bench/kernels.py profiles on CUDA: its device records are known to come
    # back as events there (graph replays launch few CPU ops to record)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        tokens = run()
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    summary = summarize(device_intervals(prof.events()), tokens)
    summary["host_wall"] = wall * 1e3 / max(tokens, 1)
    return summary


def table_rows(rows: list[dict]) -> list[list[str]]:
    """[context, system, wall, kernels, h2d, overlap, busy, idle] (ms a token) of rows with a timeline."""
    out = []
    for r in rows:
        t = r.get("timeline")
        if not t:
            continue
        if not t.get("device_activity"):
            out.append([str(r["context"]), r["system"], f"{t['host_wall']:.2f}", *["-"] * 5])
            continue
        out.append([str(r["context"]), r["system"], *(f"{t[k]:.2f}" for k in ("wall", "kernels", "h2d", "overlap",
                                                                             "busy", "idle"))])
    return out
