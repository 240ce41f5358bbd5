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

SOURCE = r"""
#include <cmath>

namespace {

constexpr int64_t ROWS_PER_TASK = 64;  // rows (tokens) a task of the pool takes at least

template <typename T> inline float wide(T x) { return float(x); }
template <typename T> inline T narrow(float x) { return T(x); }  // c10's Half/BFloat16: to nearest even

// out (T, H, D) = the first H heads of rows (T, >= H * D) rotated: x cos + swap(x) sin, swap(x) the
// halves exchanged (the minus rides in sin), each product and the sum rounded to T
template <typename S>
void rotate(const S* x, int64_t stride, const S* cos, const S* sin, int64_t tokens, int64_t H, int64_t D,
            int64_t first, S* out) {
  int64_t half = D / 2;
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const S* in = x + t * stride + (first + h) * D;
      const S *c = cos + t * D, *s = sin + t * D;
      S* o = out + (t * H + h) * D;
      for (int64_t d = 0; d < D; ++d) {
        S straight = narrow<S>(wide(in[d]) * wide(c[d]));
        S swapped = narrow<S>(wide(in[d < half ? d + half : d - half]) * wide(s[d]));
        o[d] = narrow<S>(wide(straight) + wide(swapped));
      }
    }
}

std::tuple<at::Tensor, at::Tensor> rotary_qk(const at::Tensor& qkv, const at::Tensor& cos_in,
                                             const at::Tensor& sin_in, int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be (tokens, features), features contiguous");
  auto cos = cos_in.expand({qkv.size(0), cos_in.size(-1)}).contiguous();
  auto sin = sin_in.expand({qkv.size(0), sin_in.size(-1)}).contiguous();
  int64_t T = qkv.size(0), D = cos.size(1);
  TORCH_CHECK(D % 2 == 0 && (heads + kv_heads) * D <= qkv.size(1), "qkv is narrower than its heads");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "cos and sin must be in qkv's dtype");
  auto q = at::empty({T, heads, D}, qkv.options()), k = at::empty({T, kv_heads, D}, qkv.options());
  auto run = [&](auto zero) {
    using S = decltype(zero);
    const S *x = qkv.const_data_ptr<S>(), *c = cos.const_data_ptr<S>(), *s = sin.const_data_ptr<S>();
    S *qo = q.data_ptr<S>(), *ko = k.data_ptr<S>();
    int64_t stride = qkv.stride(0);
    over_ranges(T, ROWS_PER_TASK, [&](int64_t t0, int64_t t1) {  // a prefill's tokens over the pool
      rotate(x + t0 * stride, stride, c + t0 * D, s + t0 * D, t1 - t0, heads, D, 0, qo + t0 * heads * D);
      rotate(x + t0 * stride, stride, c + t0 * D, s + t0 * D, t1 - t0, kv_heads, D, heads, ko + t0 * kv_heads * D);
    });
  };
  switch (qkv.scalar_type()) {
    case at::kFloat: run(float(0)); break;
    case at::kBFloat16: run(c10::BFloat16(0)); break;
    case at::kHalf: run(c10::Half(0)); break;
    default: TORCH_CHECK(false, "rotary_qk takes float32, bfloat16 or float16");
  }
  return {q, k};
}

// out = x * rsqrt(mean(x^2) + eps) * weight by rows of D, the mean summed in float64 (one order per
// row, whatever the rows: LANES partial sums, lane j taking dims j, j + LANES, ..., then added
// pairwise, which the compiler turns into vector code). A 16-bit S rounds the normalized value to S
// before the weight's product, as transformers' Llama does (float32 statistics, then back to the
// model's dtype, then times the weight). Rows split over the pool's threads in ranges of at least
// ROWS_PER_TASK: a prefill's thousands (a decode or verification pass runs on the caller alone).
constexpr int LANES = 8;

template <typename S>
inline float inverse_rms(const S* row, int64_t D, float eps) {
  double part[LANES] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t d = 0;
  for (; d + LANES <= D; d += LANES)
    for (int j = 0; j < LANES; ++j) {
      double x = wide(row[d + j]);
      part[j] += x * x;
    }
  for (int j = 0; d < D; ++d, ++j) {
    double x = wide(row[d]);
    part[j] += x * x;
  }
  double squares = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
  return 1.0f / std::sqrt(float(squares / double(D)) + eps);
}

template <typename S>
void normalize(const S* in, const S* w, int64_t rows, int64_t D, float eps, S* o) {
  over_ranges(rows, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const S* row = in + r * D;
      S* out = o + r * D;
      float inverse = inverse_rms(row, D, eps);
      for (int64_t d = 0; d < D; ++d) out[d] = narrow<S>(wide(narrow<S>(wide(row[d]) * inverse)) * wide(w[d]));
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  auto x = x_in.contiguous();
  auto weight = weight_in.contiguous();
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "the weight must be in x's dtype");
  int64_t D = weight.numel();
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == D, "x's last dimension must be the weight's");
  auto out = at::empty_like(x);
  int64_t rows = x.numel() / std::max<int64_t>(D, 1);
  auto run = [&](auto zero) {
    using S = decltype(zero);
    normalize(x.const_data_ptr<S>(), weight.const_data_ptr<S>(), rows, D, float(eps), out.data_ptr<S>());
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(float(0)); break;
    case at::kBFloat16: run(c10::BFloat16(0)); break;
    case at::kHalf: run(c10::Half(0)); break;
    default: TORCH_CHECK(false, "rms_norm takes float32, bfloat16 or float16");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(triforce_layer, m) {
  m.def("use_pool(int address) -> ()", &use_pool);
  m.def("rotary_qk(Tensor qkv, Tensor cos, Tensor sin, int heads, int kv_heads) -> (Tensor, Tensor)");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(triforce_layer, CPU, m) {
  m.impl("rotary_qk", &rotary_qk);
  m.impl("rms_norm", &rms_norm);
}
"""

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
