"""How many bits the KV cache stores, apart from the dtype the model computes in.

At long context a decode step on CPU is bound by reading the KV cache (SmolLM2 at 16K: 755 MB of
float32 KV against 538 MB of float32 weights), so a float32 model may keep its cache in 16 bits: memory
sees half the bytes. With avx2, fma and f16c, attention's products read the 16-bit cache directly and
widen in registers (model/decode_attention_f32.py); elsewhere attention widens one KV head at a time
(model/attention.py). Whether that pays depends on how cheaply the CPU widens 16-bit values, so it is
measured, once per process, like the stored-weights kernel: under ATEN_CPU_CAPABILITY=avx2 on the
EPYC the per-head widening measured 1.08-1.17x a float32 cache (float32 kept, at the 1/0.85 bar), the
kernels 1.68x for float16 and 1.48x for bfloat16 (16 bits chosen).
Half precision compute keeps its own dtype for the cache, as before.
"""
from __future__ import annotations

import functools
import os
import time

import torch
from torch import nn

KV_DTYPES = {"auto": None, "same": None, "bfloat16": torch.bfloat16, "float16": torch.float16,
             "float32": torch.float32}


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo), less those torch was told not to use: with
    ATEN_CPU_CAPABILITY=avx2 (or default) the avx512 and AMX flags are dropped, so that one variable
    makes this machine an avx2-only one for torch's kernels, inductor's code and ours alike (the
    dtype default, which kernels build)."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() in ("avx2", "default"):
        flags = {f for f in flags if not f.startswith(("avx512", "amx"))}
    if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "default":
        flags = {f for f in flags if not f.startswith(("avx", "fma", "f16c"))}
    return frozenset(flags)


def sixteen_bit_kind() -> torch.dtype:
    """float16 where the CPU converts it in hardware (F16C: one instruction per 8 values) and keeps
    3 more mantissa bits than bfloat16; bfloat16 (a shift) elsewhere."""
    return torch.float16 if "f16c" in cpu_flags() else torch.bfloat16


def sixteen_bit_kv_pays(kind: torch.dtype = torch.float16, slots: int = 16384) -> bool:
    return sixteen_bit_kv_speedup(kind, slots) > 1 / 0.85


@functools.lru_cache(maxsize=None)
def sixteen_bit_kv_speedup(kind: torch.dtype = torch.float16, slots: int = 16384) -> float:
    """How much faster float32 attention of one query over a 16-bit cache (the kernels, or widened per head) beats the same
    over a float32 cache, timed on 8 layers of SmolLM2's KV shape at `slots` tokens (120 MB of float32,
    more than any last-level cache), alternating the two, best of 3."""
    from .attention import attend

    layers, heads, dim = 8, 3, 64
    q = torch.ones(1, 3 * heads, dim)
    caches = {dt: torch.full((2, layers, heads, slots, dim), 0.01, dtype=dt) for dt in (torch.float32, kind)}

    def step(cache):
        for layer in range(layers):
            attend(q, cache[0, layer], cache[1, layer])

    best = {dt: float("inf") for dt in caches}
    for dt, cache in caches.items():
        step(cache)  # warm-up
    for _ in range(3):
        for dt, cache in caches.items():
            start = time.perf_counter()
            step(cache)
            best[dt] = min(best[dt], time.perf_counter() - start)
    return best[torch.float32] / best[kind]


def kv_dtype_for(device, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype a KV cache stores for a model computing in `compute_dtype` on `device`: 16 bits for
    float32 on a CPU where attention reads it in our kernels, or where that measures faster, else the
    compute dtype (float64 tests stay exact)."""
    if torch.device(device).type != "cpu" or compute_dtype != torch.float32:
        return compute_dtype
    kind = sixteen_bit_kind()
    if _kernels_read(kind):
        # the kernels read the 16-bit cache itself, widening in registers: half the bytes at no cost
        # (1.48-1.68x on the EPYC under avx2, 1.5-1.7x on the avx512 Xeon, against the 1/0.85 bar),
        # so the 0.19 s of timing it on every start decided nothing
        return kind
    return kind if sixteen_bit_kv_pays(kind) else compute_dtype


def _kernels_read(kind: torch.dtype) -> bool:
    from . import decode_attention_f32

    probe = torch.empty(1, 1, decode_attention_f32.HEAD_DIMS[0])
    return decode_attention_f32.serves(probe, probe.to(kind))


def resolve_kv_dtype(name: str, device, compute_dtype: torch.dtype) -> torch.dtype:
    """--kv-dtype NAME: auto (kv_dtype_for), same (the compute dtype), or a dtype name."""
    if name not in KV_DTYPES:
        from .errors import UserError
        raise UserError(f"unknown KV dtype '{name}': choose one of {', '.join(KV_DTYPES)}")
    if name == "auto":
        return kv_dtype_for(device, compute_dtype)
    return KV_DTYPES[name] or compute_dtype


def use_kv_dtype(model: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    """Make every cache built from `model.kv_shape()` store `dtype` (None: the model's own dtype).
    Set it before building caches: a cache keeps the dtype it was allocated with."""
    model.kv_dtype = dtype
    return model
