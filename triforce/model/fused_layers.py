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

`stack` goes further: every layer of a pass in one call (layer_ops.cpp's Stack, built once per model
and dtype, holding the layers' records, norms and product ops), the attention's cache write and
kernel (decode_attention_f32.cache_attend, the call a cache of plain slots makes for float32 rows)
between each layer's two calls, below autograd's dispatch. Two calls a layer still cost three
crossings from Python (the attention through the cache) with their argument conversion, boxed
dispatch and autograd fallback, and the ATen calls inside went through autograd's layers again.
SmolLM2 float32 on the avx512 Xeon, 2 threads, float16 cache, in one process alternating: 9.7-11.4
against 13.4-16.0 ms a one-token pass at 256 cached tokens (1.4x), 16.6-18.2 against 23.1-26.4 at
4K (1.3-1.6x); the same logits, cache contents and kept queries (tests/model/test_eager_steps.py).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from . import decode_attention_f32, layer_ops

enabled = True  # off: bound layers call their steps one by one (`python -m bench.layer_calls --switch fused_layers`)
stack_enabled = True  # off: a pass calls its fused layers one by one (`python -m bench.layer_calls --switch fused_stack`)


def _parts(block: nn.Module, like: torch.Tensor) -> tuple | None:
    """The pieces of block's two calls for rows like `like`: (into, out) products as (names, records,
    features, biases), the norms as (weight, eps) pairs; None where a part is not one op."""
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
    return products([0]), products([1, 2, 3]), [(n.weight, n.eps) for n in norms]


def step(block: nn.Module, like: torch.Tensor) -> Callable | None:
    """block's pass (x, cos, sin, cache, layer) -> x for rows like `like` (T, hidden) as two calls,
    or None where a part is not one op (module docstring)."""
    parts = _parts(block, like)
    if parts is None:
        return None
    into, out, ((first, first_eps), (second, second_eps)) = parts
    heads, kv_heads = block.attention.n_heads, block.attention.n_kv_heads

    def layer(x, cos, sin, cache, index: int):
        q, k, v = layer_ops.attention_in(x, first, first_eps, *into, cos, sin, heads, kv_heads)
        return layer_ops.layer_out(x, cache.attend(index, q, k, v), second, second_eps, *out)
    return layer


def stack(layers, like: torch.Tensor):
    """Every layer of a pass in one call (layer_ops.cpp's Stack): `layers` (the model's blocks) through
    their two calls each, with the attention a cache of plain slots makes for float32 rows
    (decode_attention_f32.cache_attend) between them. None where a layer is not two calls or that
    kernel does not build; a cache whose attention takes another route runs the layers one by one
    (`runs_stack`)."""
    parts = [_parts(block, like) for block in layers]
    if not (stack_enabled and parts and None not in parts and like.dtype == torch.float32
            and layers[0].attention.head_dim in decode_attention_f32.HEAD_DIMS and decode_attention_f32.available()):
        return None
    into_names, out_names, records, features, biases, norms, eps = [], [], [], [], [], [], []
    for into, out, layer_norms in parts:
        into_names.append(into[0])
        out_names.append(out[0])
        for names, rec, feat, bias in (into, out):
            records += rec
            features += feat
            biases += bias
        norms += [weight for weight, _ in layer_norms]
        eps += [float(e) for _, e in layer_norms]
    attention = layers[0].attention
    # the scale store_and_attend passes: q.shape[-1] ** -0.5
    return torch.classes.triforce_layer.Stack(into_names, out_names, records, features, biases, norms, eps,
                                              attention.n_heads, attention.n_kv_heads, attention.head_dim ** -0.5)


def runs_stack(cache_k: torch.Tensor, tiled: bool) -> bool:
    """Whether a cache's attention for float32 rows of a few tokens is the call a Stack makes
    (attention.store_and_attend's route for them): plain slots, a dtype the kernels read."""
    return not tiled and cache_k.dtype in decode_attention_f32.CACHE_DTYPES and cache_k.device.type == "cpu"


def run_stack(stack, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache_k: torch.Tensor,
              cache_v: torch.Tensor, start: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """x (T, hidden) through every layer of `stack`, the new keys and values into the cache's buffers
    (layers, kv_heads, slots, D) at slots [start, start + T) -> (x, each layer's rotated queries)."""
    return torch.ops.triforce_layer.run_stack(stack, x, cos, sin, cache_k, cache_v, start)
