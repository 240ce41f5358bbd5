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
    caches on CUDA. One query stays with SDPA, whose cuDNN kernel splits the keys itself (13 us at
    32K on the H200)."""
    return q.is_cuda and 1 < T <= MAX_QUERIES and S >= MIN_KEYS


def split_keys_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                         piece: int | None = None) -> torch.Tensor:
    """q (T, Hq, D) against a layer's keys and values (Hkv, S, D) under an additive (T, S) mask;
    returns (T, Hq * D) in q's dtype. `piece`: keys per piece (default PIECE)."""
    piece = piece or PIECE
    T, Hq, D = q.shape
    Hkv, S, _ = keys.shape
    group = Hq // Hkv
    rows = q.unflatten(1, (Hkv, group)).permute(1, 2, 0, 3).reshape(1, Hkv, group * T, D)
    # the mask for every folded row, clamped finite, rows 16 elements apart (the kernels' alignment)
    bias = torch.empty(group * T, -(-S // 16) * 16, dtype=q.dtype, device=q.device)[:, :S]
    bias.view(group, T, S).copy_(mask.expand(group, T, S)).clamp_(min=-MASKED)
    kernel = _cuda_kernel if q.is_cuda else _cpu_kernel
    main = S - S % piece
    outs, lses = [], []
    for start, length, n in ((0, piece, main // piece), (main, S - main, 1)):
        if n == 0 or length == 0:
            continue
        end = start + n * length
        k = keys[:, start:end].unflatten(1, (n, length)).transpose(0, 1)  # (n, Hkv, length, D): views
        v = values[:, start:end].unflatten(1, (n, length)).transpose(0, 1)
        b = bias[:, start:end].unflatten(1, (n, length)).transpose(0, 1)[:, None].expand(n, Hkv, group * T, length)
        out, lse = kernel(rows.expand(n, Hkv, group * T, D).contiguous(), k, v, b)
        outs.append(out)
        lses.append(lse)
    out, lse = (outs[0], lses[0]) if len(outs) == 1 else (torch.cat(outs), torch.cat(lses))
    weights = torch.softmax(lse.float(), dim=0)  # (pieces, Hkv, group * T): each piece's share of a row
    merged = (out * weights[..., None]).sum(0)  # in float32 (the weights' dtype): (Hkv, group * T, D)
    return merged.to(q.dtype).view(Hkv, group, T, D).permute(2, 0, 1, 3).reshape(T, Hq * D)
