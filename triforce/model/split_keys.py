"""Attention of a few queries against many keys on CUDA, the keys split into pieces (flash-decoding).

SDPA's fused kernels give each (batch, head, block of 64 queries) one thread block that walks every
key. A verification pass has a few queries, so at SmolLM2's 9 heads a layer is 9 blocks walking
32K keys on a 132-SM GPU. The H200 measured it (bench.op_forms, session 35): 7 queries against
32,768 keys took 473 us a layer against 13 us for one query, so a 7-token pass paid 14 ms of
attention where a 1-token pass paid 0.4 ms, and every speculative mode lost to plain decoding at 32K
with the KV on the GPU.

Here each piece of PIECE keys is a batch entry: the kernel runs pieces x KV heads blocks, each over
PIECE keys, and returns each piece's log-sum-exp; the pieces' outputs are merged by those in float32.
The query heads that share a KV head are folded into the query rows, so each key is read once per
KV head, as in attention._attend_past_and_piece. Masked keys carry a large finite bias instead of
-inf: a piece that a row cannot see at all (the static views' unused slots) then has a log-sum-exp
near -MASKED and weight exactly 0, where -inf would give 0/0 in some kernels and 0 in others.
"""
from __future__ import annotations

import torch

PIECE = 512  # keys a thread block walks: 64 pieces at 32K (192 blocks at 3 KV heads), 8 at 4K
# below, the old form's few blocks cost about what this form's dozen small kernels do (7 queries:
# 63 us a layer at 4K keys on the H200, about 33 at 2K by its rate; these kernels ~2 us each)
MIN_KEYS = 4096
MAX_QUERIES = 128  # verification widths; a prefill piece's thousands of queries make blocks enough
MASKED = 30000.0  # the bias of a key a query must not see: exp(-MASKED) is 0 in float32


def _cpu_kernel(q, k, v, bias):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias)[:2]


def _cuda_kernel(q, k, v, bias):
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True)[:2]
    return out, lse[..., :q.shape[2]]  # the log-sum-exps come padded to a multiple of 32 rows


def serves(T: int, S: int, q: torch.Tensor) -> bool:
    """Whether a call of T queries against S keys takes this form: verification passes over long
    caches on CUDA. One query comes here only where cuDNN, which splits the keys itself (13 us at 32K
    on the H200), refused it in both forms (attention.attend_shared_heads asks first): float32,
    which cuDNN's kernel does not take, or a GPU or head size it does not serve. The memory-efficient
    kernel then walked the keys in 9 blocks: float32 plain decoding with the KV in host memory at 32K
    took 120 ms a pass against a 27 ms link floor, where 5-token passes through this form took 28."""
    return q.is_cuda and 1 <= T <= MAX_QUERIES and S >= MIN_KEYS


def split_keys_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                         piece: int | None = None) -> torch.Tensor:
    """q (T, Hq, D) against a layer's keys and values (Hkv, S, D) under an additive (T, S) mask;
    returns (T, Hq * D) in q's dtype. `piece`: keys per piece (default PIECE)."""
    piece = piece or PIECE
    T, Hq, D = q.shape
    Hkv, S, _ = keys.shape
    group = Hq // Hkv
    main = S - S % piece
    # the query heads sharing a KV head folded into its rows, one copy per piece (the kernel takes no
    # zero batch stride), in one kernel: a ragged last piece takes the first copy
    pieces = max(main // piece, 1)
    rows = torch.empty(pieces, Hkv, group, T, D, dtype=q.dtype, device=q.device)
    rows.copy_(q.view(T, Hkv, group, D).permute(1, 2, 0, 3).expand(pieces, Hkv, group, T, D))
    rows = rows.view(pieces, Hkv, group * T, D)
    bias = folded_bias(mask, group, q.dtype)
    kernel = _cuda_kernel if q.is_cuda else _cpu_kernel
    outs, lses = [], []
    for start, length, n in ((0, piece, main // piece), (main, S - main, 1)):
        if n == 0 or length == 0:
            continue
        end = start + n * length
        k = keys[:, start:end].unflatten(1, (n, length)).transpose(0, 1)  # (n, Hkv, length, D): views
        v = values[:, start:end].unflatten(1, (n, length)).transpose(0, 1)
        b = bias[:, start:end].unflatten(1, (n, length)).transpose(0, 1)[:, None].expand(n, Hkv, group * T, length)
        out, lse = kernel(rows[:n], k, v, b)
        outs.append(out)
        lses.append(lse)
    out, lse = (outs[0], lses[0]) if len(outs) == 1 else (torch.cat(outs), torch.cat(lses))
    weights = torch.softmax(lse.float(), dim=0)  # (pieces, Hkv, group * T): each piece's share of a row
    merged = (out * weights[..., None]).sum(0)  # in float32 (the weights' dtype): (Hkv, group * T, D)
    # back to (T, Hq * D) and to q's dtype in one copy (a cast, then a permute, are two kernels)
    result = torch.empty(T, Hq * D, dtype=q.dtype, device=q.device)
    result.view(T, Hkv, group, D).copy_(merged.view(Hkv, group, T, D).permute(2, 0, 1, 3))
    return result


# the last bias built: (mask, its version, group, dtype, built inside a CUDA graph's capture, the
# bias). Every layer of a pass gets the same mask tensor (the static views build it once per pass),
# so the layers after the first reuse the first's bias: two kernels fewer a layer, about 5 us each in
# a captured graph on the H200, where the form costs 52-62 us a layer. Inside a captured graph the
# first layer's kernels rebuild it at every replay; an eager pass rewrites the mask in place first,
# which bumps its version. A capture never reuses a bias built outside one: the graph would read
# memory this cache lets go of.
_last_bias: tuple | None = None


def capturing_graph(mask: torch.Tensor) -> bool:
    return mask.is_cuda and torch.cuda.is_current_stream_capturing()


def folded_bias(mask: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """The (T, S) mask for every folded row (group * T, S), clamped finite, rows 16 elements apart (the
    kernels' alignment); built once per pass of a mask."""
    global _last_bias
    if torch.compiler.is_compiling():  # dynamo reads no version counter (nor this cache); inductor
        return _fold(mask, group, dtype)  # dedupes the layers' identical copies itself
    last, capturing = _last_bias, capturing_graph(mask)
    if (last is not None and last[0] is mask and last[1] == mask._version and last[2:4] == (group, dtype)
            and last[4] >= capturing):
        return last[5]
    bias = _fold(mask, group, dtype)
    _last_bias = (mask, mask._version, group, dtype, capturing, bias)
    return bias


def _fold(mask: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    T, S = mask.shape
    bias = torch.empty(group * T, -(-S // 16) * 16, dtype=dtype, device=mask.device)[:, :S]
    bias.view(group, T, S).copy_(mask.expand(group, T, S)).clamp_(min=-MASKED)
    return bias
