"""A layer of an eager CPU pass as two calls around its attention (layer_ops' `attention_in` and
`layer_out`), where every product of the layer is one op over stored records.

A bound layer (model/eager_steps.py) still made a dozen calls from Python a pass: the norm, the q/k/v
product, the rotation and a view; the output product and the residual add; the norm, the gate/up
product, two slices, silu, the product and the down product with its add. Each costs a few
microseconds of Python and dispatch whatever its size, several milliseconds of a small model's pass
(SmolLM2 float32 at 256 cached tokens on the avx512 Xeon: a 16 ms pass whose products take 9). The
C++ side calls the same kernels in the same order (the products by their ops' names, torch's add,
silu and mul as ATen calls), so the bits are the bound steps' (tests/model/test_eager_steps.py). The
attention stays in Python, with the cache that decides where the new keys go. SmolLM2 float32 greedy
decoding, one thread, the other core busy (`python -m bench.layer_calls --switch fused_layers
--dtypes f32 --threads 1`): 109 torch calls a token instead of 499; 28.9 against 30.6 ms a token at
256 cached tokens (1.06x), 40.1 against 43.1 at 4K (1.08x), the same tokens.

Only layers whose products are each a single op: float32 over stored records (stored_avx2). A bf16
product chooses AMX tiles per call in Python, and dense products are torch's; those layers keep
their bound steps.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from . import layer_ops

enabled = True  # off: bound layers call their steps one by one (`python -m bench.layer_calls --switch fused_layers`)


def step(block: nn.Module, like: torch.Tensor) -> Callable | None:
    """block's pass (x, cos, sin, cache, layer) -> x for rows like `like` (T, hidden) as two calls,
    or None where a part is not one op (module docstring)."""
    attention, mlp = block.attention, block.mlp
    linears = (attention.wqkv, attention.wo, mlp.w13, mlp.w2)
    norms = (block.attention_norm, block.mlp_norm)
    if not (enabled and layer_ops.serves(like) and all(n.weight.dtype == like.dtype for n in norms)):
        return None
    names = [getattr(m, "product_op", lambda rows: None)(like) for m in linears]
    if None in names:
        return None

    def products(parts):
        return (",".join(names[i] for i in parts), [linears[i].block_records for i in parts],
                [linears[i].out_features for i in parts], [linears[i].bias for i in parts])

    into, out = products([0]), products([1, 2, 3])
    (first, first_eps), (second, second_eps) = ((n.weight, n.eps) for n in norms)
    heads, kv_heads = attention.n_heads, attention.n_kv_heads

    def layer(x, cos, sin, cache, index: int):
        q, k, v = layer_ops.attention_in(x, first, first_eps, *into, cos, sin, heads, kv_heads)
        return layer_ops.layer_out(x, cache.attend(index, q, k, v), second, second_eps, *out)
    return layer
