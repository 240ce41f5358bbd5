"""A layer's small elementwise steps as one C++ call each, for eager decoding on CPU.

A decode step of a small model is ~50 torch ops a layer, and on CPU every op costs its Python call
and dispatch, a few microseconds, whatever its size: at SmolLM2's widths the RMSNorm (6 kernels
inside torch's rms_norm) took 7 us a call and the rotation of q and k (slices, a cat, two products
and a sum) 13 us, together about 1 ms of a 12.8 ms token (avx2, one thread, 4K). Here each is one
call of about a microsecond:

- `rotary_qk`: q and k of the fused qkv projection, rotated, as two tensors: x cos + (-x2, x1) sin
  with each product and the sum rounded to the model's dtype as torch's separate ops round them (no
  fused multiply-add: built with -ffp-contract=off), so the same bits as `rope.apply_rotary`.
- `rms_norm`: x * rsqrt(mean(x^2) + eps) * weight, the mean summed in float64 (one order per row,
  whatever the rows: a verification pass normalizes each row as a one-token pass does). A 16-bit
  model rounds the normalized value to its dtype before the weight's product, as transformers' Llama
  does; its float32 statistics are summed in another order than torch's, which moves about 1 element
  in 10^5 by one unit of bfloat16's last place (tests/model/test_layer_ops.py). torch's ops took
  15.7 us a bf16 norm at SmolLM2's width, this 3.3 (61 norms a step: ~0.75 ms of a 7-10 ms token).

Eager only: a compiled graph fuses these steps itself. Plain C++ (no intrinsics); built at first use
like the other CPU kernels (model/cpu_kernels.py); where it cannot build, the layer keeps torch's ops.
"""
from __future__ import annotations

import torch

from . import cpu_kernels

# off: eager layers take torch's ops for these steps, and attention.store_and_attend its write and
# views (bench/layer_calls.py compares the two in one process)
enabled = True

SOURCE = cpu_kernels.csrc("layer_ops.cpp")

KERNEL = cpu_kernels.Kernel("triforce_layer_ops", SOURCE, isa=frozenset(), cflags=("-ffp-contract=off",),
                            pool_ops="triforce_layer")


def available() -> bool:
    """Whether the ops build here and agree with torch's on a small case. Asked once per process."""
    return cpu_kernels.built(KERNEL, _register_shapes, _self_check)


def _self_check() -> bool:
    from .rope import apply_rotary

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        qkv = torch.randn(3, 5 * 64, generator=g).to(dtype)
        cos, sin = torch.randn(3, 64, generator=g).to(dtype), torch.randn(3, 64, generator=g).to(dtype)
        q, k = rotary_qk(qkv, cos, sin, 3, 1)
        want = apply_rotary(qkv[:, :4 * 64].view(3, 4, 64), cos, sin)
        if not (torch.equal(q, want[:, :3]) and torch.equal(k, want[:, 3:])):
            return False
    x, w = torch.randn(3, 576, generator=g), torch.randn(576, generator=g)
    if not torch.allclose(rms_norm(x, w, 1e-5), torch.nn.functional.rms_norm(x, (576,), w, 1e-5), rtol=1e-5, atol=1e-6):
        return False
    x, w = x.bfloat16(), w.bfloat16()
    want = w * torch.nn.functional.rms_norm(x.float(), (576,), eps=1e-5).bfloat16()
    return torch.allclose(rms_norm(x, w, 1e-5).float(), want.float(), rtol=2 ** -7, atol=0)


def _register_shapes() -> None:
    @torch.library.register_fake("triforce_layer::rotary_qk")
    def _(qkv, cos, sin, heads, kv_heads):
        D = cos.shape[-1]
        return qkv.new_empty(qkv.shape[0], heads, D), qkv.new_empty(qkv.shape[0], kv_heads, D)

    @torch.library.register_fake("triforce_layer::rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x)

    @torch.library.register_fake("triforce_layer::attention_in")
    def _(x, norm, eps, products, records, features, biases, cos, sin, heads, kv_heads):
        T, D = x.shape[0], cos.shape[-1]
        return x.new_empty(T, heads, D), x.new_empty(T, kv_heads, D), x.new_empty(T, kv_heads, D)

    @torch.library.register_fake("triforce_layer::layer_out")
    def _(x, attended, norm, eps, products, records, features, biases):
        return torch.empty_like(x)


def serves(x: torch.Tensor) -> bool:
    """Whether these ops take x: on CPU, 16 or 32 bits, eager (a compiled graph fuses the steps itself), built here."""
    return (enabled and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and not torch.compiler.is_compiling() and available())


def rotary_qk(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, heads: int,
              kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (T, heads, D), k (T, kv_heads, D)): the first heads + kv_heads heads of qkv (T, >= (heads +
    kv_heads) * D) through `rope.apply_rotary` with (cos, signed_sin) (T or 1, D), bit for bit."""
    return torch.ops.triforce_layer.rotary_qk(qkv, cos, signed_sin, heads, kv_heads)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dimension, float32, the mean summed in float64."""
    return torch.ops.triforce_layer.rms_norm(x, weight, eps)


def attention_in(x, norm, eps: float, products: str, records, features, biases, cos, sin, heads: int,
                 kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's steps before its attention (model/fused_layers.py): rms_norm(x), the q/k/v product
    (`products`: its op's qualified name; its records, output features and bias as one-item lists), q
    and k rotated -> (q, k, v)."""
    return torch.ops.triforce_layer.attention_in(x, norm, eps, products, records, features, biases, cos, sin,
                                                 heads, kv_heads)


def layer_out(x, attended, norm, eps: float, products: str, records, features, biases) -> torch.Tensor:
    """A layer's steps after its attention: h = x + o(attended), then h + down(silu(gate) * up) of
    rms_norm(h); the three products' op names comma-separated, in that order, their records, output
    features and biases as lists."""
    return torch.ops.triforce_layer.layer_out(x, attended, norm, eps, products, records, features, biases)
