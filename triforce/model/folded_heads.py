"""Attention of a few queries against many keys on CUDA as one-query attention: each (query head,
query) pair becomes a query head of its own, so the call has one query per head and cuDNN's
one-query kernel, which splits the keys itself, serves it.

Why: the middle level's check of a drafter's token is a 2-position pass over the retrieval cache
(8,192 slots at 32K). On the H200 it cost 3.2 ms where the 1-position pass cost 1.66 ms (session 40,
SmolLM2, 30 layers): the split-keys form (split_keys.py) pays about 40 us a layer of small kernels
whatever the query count, where cuDNN's one-query call took 6.5 us at 4K keys and 12.6 at 32K
(session 36's op forms). At SmolLM2's size that check decides whether triforce beats retrieval alone.

The form: rows ordered (KV head, query head in its group, query), so that SDPA's grouped heads
(enable_gqa: query head j reads KV head j // (group * T)) hand every row its own KV head; the mask's
row t repeated for every head (split_keys.folded_bias, built once per pass). The same attention as
the other forms, computed in another order, so it changes no token beyond rounding.

Which form serves a shape is measured on the device the first time the shape is seen (eagerly: a
pass's first calls are, before any graph is captured or compiled), since neither wins everywhere:
at 7 queries against 32K keys the folded call reads each key 7 times per head, where the split keys
read it once. A shape seen first under a capture or a trace takes the other form.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from .split_keys import folded_bias

MAX_QUERIES = 32  # the widest verification a pass pads to (speculative/models.py WIDTHS up to 32)
TIMED_CALLS = 3  # calls of each form timed, after one untimed call each (cuDNN builds its plan then)

# (queries, heads, KV heads, head dim, dtype, keys' layout, length's bits) -> the folded form serves
_FOLDED_SERVES: dict[tuple, bool] = {}


def folded_heads_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           mask: torch.Tensor) -> torch.Tensor:
    """q (T, Hq, D) against a layer (Hkv, S, D) under an additive (T, S) mask, as Hq * T one-query
    heads; returns (T, Hq * D) in q's dtype."""
    T, Hq, D = q.shape
    Hkv = keys.shape[0]
    group = Hq // Hkv
    rows = q.view(T, Hkv, group, D).permute(1, 2, 0, 3).reshape(1, Hq * T, 1, D)
    bias = folded_bias(mask, Hq, q.dtype)  # (Hq * T, S): row (head, t) is mask row t
    out = F.scaled_dot_product_attention(rows, keys[None], values[None], attn_mask=bias[None, :, None],
                                         enable_gqa=True)
    return out.view(Hkv, group, T, D).permute(2, 0, 1, 3).reshape(T, Hq * D)


def cudnn_takes(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether cuDNN's kernel accepts the folded call (on CPU: never)."""
    if not q.is_cuda:
        return False
    from torch.backends import cuda as backends
    T, Hq, D = q.shape
    rows = q.new_empty(1, Hq * T, 1, D)
    bias = q.new_empty(1, Hq * T, 1, mask.shape[1])
    try:
        params = backends.SDPAParams(rows, keys[None], values[None], bias, 0.0, False, True)
        return bool(backends.can_use_cudnn_attention(params))
    except (RuntimeError, TypeError, AttributeError):  # a torch without these checks
        return False


def serves(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
           other: Callable[[], torch.Tensor], timer: Callable | None = None) -> bool:
    """Whether the folded form serves this call rather than `other` (the form the call takes without
    it): decided once per shape, by timing both on the device when cuDNN takes the folded call."""
    T = q.shape[0]
    if not 2 <= T <= MAX_QUERIES:
        return False
    key = (T, q.shape[1], keys.shape[0], q.shape[2], q.dtype, keys.stride(1) == keys.shape[2],
           keys.shape[1].bit_length())
    if key not in _FOLDED_SERVES:
        if torch.compiler.is_compiling() or (q.is_cuda and torch.cuda.is_current_stream_capturing()):
            return False  # decided at the shape's next eager call
        if not cudnn_takes(q, keys, values, mask):
            _FOLDED_SERVES[key] = False
        else:
            time = timer or seconds_per_call
            try:
                folded = time(lambda: folded_heads_attention(q, keys, values, mask))
            except RuntimeError:  # the probe said yes and the kernel said no: the other form serves
                _FOLDED_SERVES[key] = False
            else:
                _FOLDED_SERVES[key] = folded < time(other)
    return _FOLDED_SERVES[key]


def seconds_per_call(fn: Callable[[], torch.Tensor]) -> float:
    """fn's device time per call, by CUDA events around TIMED_CALLS calls after an untimed one."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(TIMED_CALLS):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / TIMED_CALLS


def decisions() -> dict[str, bool]:
    """What the device decided so far, for a benchmark's record: a shape -> whether folded heads serve."""
    return {f"{T} queries, {2 ** (bits - 1)}+ keys, {heads}/{kv_heads} heads, {str(dtype).removeprefix('torch.')}, "
            f"{'head' if head_major else 'token'}-major": v
            for (T, heads, kv_heads, _, dtype, head_major, bits), v in _FOLDED_SERVES.items()}
