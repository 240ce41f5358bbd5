"""The two products of attention at a few queries, on CPU in bfloat16, as kernels that read the
cache at memory speed: scores = rows . keys^T and out = probs . values, for each KV head, where rows
are the few query rows that share the head (GQA's group times the new tokens).

torch's bf16 `bmm` at 3 rows against SmolLM2's cache (one thread, 30 layers, 4K keys) took 3.8 ms for
the scores and 3.3 for the values against 1.06 ms to read either once at memory speed; these take
2.6 and 1.1 (docs/results/2026-11-23-cpu-bytes.md, session 11). inductor's own loops for the same
products (multiply and sum) took 5.3-6.2 ms, and torch's CPU flash kernel 8x the floor. Each is what
`bmm` computes but for the order of its float32 sums: the products of bfloat16 values are exact in
float32 (the scores through avx512_bf16's pair dot products, the values widened to float32), and each
output is rounded once to bfloat16, to nearest even, as bmm rounds its own.

The C++ is built at first use with torch's extension builder (a C++ compiler, as --compile needs
anyway; cached on disk) and registered as torch ops, which torch.compile calls as opaque kernels.
Where it cannot build, or the CPU lacks avx512_bf16, attention keeps torch's bmm.
"""
from __future__ import annotations

import torch

from . import cpu_kernels

HEAD_DIMS = (64, 128)  # the kernels are unrolled for these
MAX_ROWS = 16  # the value kernel keeps 4 rows in registers and reads the values again per 4 rows

SOURCE = r"""
namespace {

// 16 vectors of partial sums -> one vector of their 16 totals. Lane l holds the total of vector
// SLOT[l]: the dot product of key j is accumulated in vector SLOT[j] (SLOT is its own inverse),
// so the lanes come out in key order.
constexpr int SLOT[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

AVX512 inline __m512 totals16(__m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
}

// out[r, s] = rows[r] . keys[s] for one head: R rows and S keys of D = 32 * NC bf16 values
template <int NC>
AVX512 void scores_head(const bf16* rows, int64_t R, const bf16* keys, int64_t S, bf16* out) {
  constexpr int D = 32 * NC;
  int64_t full = S - S % 16;
  for (int64_t s0 = 0; s0 < full; s0 += 16) {
    const bf16* k = keys + s0 * D;
    for (int line = 0; line < 16 * D; line += 32) read_ahead(k + line);  // 64-byte lines
    for (int64_t r = 0; r < R; ++r) {
      __m512bh q[NC];
      for (int c = 0; c < NC; ++c) q[c] = (__m512bh)_mm512_loadu_si512(rows + r * D + 32 * c);
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) {
        __m512 a = _mm512_setzero_ps();
        for (int c = 0; c < NC; ++c)
          a = _mm512_dpbf16_ps(a, q[c], (__m512bh)_mm512_loadu_si512(k + j * D + 32 * c));
        acc[SLOT[j]] = a;
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * S + s0), to_bf16(totals16(acc)));
    }
  }
  for (int64_t s = full; s < S; ++s) {  // the last S % 16 keys one at a time
    for (int64_t r = 0; r < R; ++r) {
      __m512 a = _mm512_setzero_ps();
      for (int c = 0; c < NC; ++c)
        a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(rows + r * D + 32 * c),
                             (__m512bh)_mm512_loadu_si512(keys + s * D + 32 * c));
      out[r * S + s] = scalar_bf16(_mm512_reduce_add_ps(a));
    }
  }
}

// out[r] = sum_s probs[r, s] * values[s] for NR rows of one head, D = 16 * NC
template <int NC, int NR>
AVX512 void mix_rows(const bf16* probs, int64_t S, const bf16* values, bf16* out) {
  constexpr int D = 16 * NC;
  __m512 acc[NR][NC];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    __m512 v[NC];
    for (int c = 0; c < NC; c += 2) read_ahead(values + s * D + 16 * c);  // 64-byte lines
    for (int c = 0; c < NC; ++c) v[c] = widen(values + s * D + 16 * c);
    for (int r = 0; r < NR; ++r) {
      __m512 p = _mm512_set1_ps(scalar_f32(probs[r * S + s]));
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_fmadd_ps(p, v[c], acc[r][c]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * D + 16 * c), to_bf16(acc[r][c]));
}

template <int NC>
void mix_head(const bf16* probs, int64_t R, int64_t S, const bf16* values, bf16* out) {
  constexpr int D = 16 * NC;
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) mix_rows<NC, 4>(probs + r * S, S, values, out + r * D);
  switch (R - r) {
    case 3: mix_rows<NC, 3>(probs + r * S, S, values, out + r * D); break;
    case 2: mix_rows<NC, 2>(probs + r * S, S, values, out + r * D); break;
    case 1: mix_rows<NC, 1>(probs + r * S, S, values, out + r * D); break;
  }
}

void check_cache(const at::Tensor& cache, int64_t heads) {
  TORCH_CHECK(cache.dim() == 3 && cache.size(0) == heads, "cache must be (heads, tokens, head_dim)");
  TORCH_CHECK(cache.scalar_type() == at::kBFloat16, "cache must be bfloat16");
  TORCH_CHECK(cache.stride(2) == 1 && cache.stride(1) == cache.size(2), "each head's tokens must be contiguous");
}

at::Tensor scores(const at::Tensor& rows_in, const at::Tensor& keys) {
  auto rows = rows_in.contiguous();
  int64_t H = rows.size(0), R = rows.size(1), D = rows.size(2), S = keys.size(1);
  check_cache(keys, H);
  TORCH_CHECK(rows.scalar_type() == at::kBFloat16 && keys.size(2) == D, "rows must be bfloat16 (heads, rows, head_dim)");
  auto out = at::empty({H, R, S}, rows.options());
  auto* o = reinterpret_cast<bf16*>(out.data_ptr());
  for (int64_t h = 0; h < H; ++h) {
    const bf16* k = data(keys) + h * keys.stride(0);
    if (D == 64) scores_head<2>(data(rows) + h * R * D, R, k, S, o + h * R * S);
    else if (D == 128) scores_head<4>(data(rows) + h * R * D, R, k, S, o + h * R * S);
    else TORCH_CHECK(false, "head_dim must be 64 or 128");
  }
  return out;
}

at::Tensor mix(const at::Tensor& probs_in, const at::Tensor& values) {
  auto probs = probs_in.contiguous();
  int64_t H = probs.size(0), R = probs.size(1), S = probs.size(2), D = values.size(2);
  check_cache(values, H);
  TORCH_CHECK(probs.scalar_type() == at::kBFloat16 && values.size(1) == S, "probs must be bfloat16 (heads, rows, tokens)");
  auto out = at::empty({H, R, D}, probs.options());
  auto* o = reinterpret_cast<bf16*>(out.data_ptr());
  for (int64_t h = 0; h < H; ++h) {
    const bf16* v = data(values) + h * values.stride(0);
    if (D == 64) mix_head<4>(data(probs) + h * R * S, R, S, v, o + h * R * D);
    else if (D == 128) mix_head<8>(data(probs) + h * R * S, R, S, v, o + h * R * D);
    else TORCH_CHECK(false, "head_dim must be 64 or 128");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(triforce_decode, m) {
  m.def("scores(Tensor rows, Tensor keys) -> Tensor");
  m.def("mix(Tensor probs, Tensor values) -> Tensor");
}

TORCH_LIBRARY_IMPL(triforce_decode, CPU, m) {
  m.impl("scores", &scores);
  m.impl("mix", &mix);
}
"""


@torch.compiler.assume_constant_result  # torch.compile asks at trace time, and builds nothing inside a graph
def available() -> bool:
    """Whether the kernels build here and compute bmm's products on a small case (any failure,
    a missing compiler or headers, means attention keeps bmm). Asked once per process."""
    return cpu_kernels.built("triforce_decode_attention", SOURCE, _register_shapes, _self_check)


def _self_check() -> bool:
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(2, 3, 64, generator=g).bfloat16()
    cache = torch.randn(2, 37, 64, generator=g).bfloat16()
    probs = torch.rand(2, 3, 37, generator=g).bfloat16()
    return (torch.allclose(scores(rows, cache).float(), torch.bmm(rows, cache.transpose(1, 2)).float(),
                           rtol=1e-2, atol=1e-2)
            and torch.allclose(mix(probs, cache).float(), torch.bmm(probs, cache).float(), rtol=1e-2, atol=1e-2))


def _register_shapes() -> None:
    """What the ops return, for torch.compile's tracing (which runs no kernel)."""
    @torch.library.register_fake("triforce_decode::scores")
    def _(rows, keys):
        return rows.new_empty(rows.shape[0], rows.shape[1], keys.shape[1])

    @torch.library.register_fake("triforce_decode::mix")
    def _(probs, values):
        return probs.new_empty(probs.shape[0], probs.shape[1], values.shape[2])


def serves(rows: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether these kernels take rows (H, R, D) against a cache layer (H, S, D)."""
    return (rows.device.type == "cpu" and rows.dtype == cache.dtype == torch.bfloat16
            and rows.shape[1] <= MAX_ROWS and rows.shape[-1] in HEAD_DIMS and available())


def scores(rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """bmm(rows, keys^T): (H, R, D) bf16 rows, (H, S, D) bf16 keys, each head's tokens contiguous."""
    return torch.ops.triforce_decode.scores(rows, keys)


def mix(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """bmm(probs, values): (H, R, S) bf16 weights, (H, S, D) bf16 values."""
    return torch.ops.triforce_decode.mix(probs, values)
