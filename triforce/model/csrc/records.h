// What stored_bf16.cpp's avx512 kernels and stored_amx.cpp's AMX kernels share over the same block
// records (stored_bf16.py's docstring has the layout): the decode of codes into bfloat16 pairs by
// table lookups, the scales, x's block sums and the store of a group's 16 outputs.

// every function here avx512 code, the lambda torch's threads run included: one without the target
// passes its __m512 accumulators to store_group by another convention (garbage in 12 of 16 lanes)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16")

namespace {

constexpr int64_t GRAIN_WEIGHTS = int64_t(1) << 18;  // a thread's least share: ~4 us at memory speed

// bfloat16 bit patterns of 32 table entries: vpermw indexes with a word's low 5 bits, so entry i
// is the value of the nibble i & 15 (bit 4 of the index is another nibble's, and ignored)
struct Tables {
  alignas(64) bf16 unsigned_nibble[32];  // 0..15
  alignas(64) bf16 signed_high[32];      // 16 * h, h the nibble as 4-bit two's complement: -128..112
};

inline bf16 exact_bf16(float v) {  // small integers: the top 16 bits of the float32 are the value
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return bf16(u >> 16);
}

const Tables& tables() {
  static const Tables t = [] {
    Tables t;
    for (int i = 0; i < 32; ++i) {
      int nibble = i & 15;
      t.unsigned_nibble[i] = exact_bf16(float(nibble));
      t.signed_high[i] = exact_bf16(float(16 * (nibble < 8 ? nibble : nibble - 16)));
    }
    return t;
  }();
  return t;
}

AVX512 inline __m512 load_scales(const uint16_t* p) {  // 16 f16 values, widened exactly
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
AVX512 inline __m512 load_scales(const float* p) { return _mm512_loadu_ps(p); }

AVX512 inline __m512bh lookup(__m512i words, __m512i table) {
  return (__m512bh)_mm512_permutexvar_epi16(words, table);
}

// The 4 column pairs of one vector of code words as bfloat16 pairs. Q4: nibble k of each half is
// column pair k, all through the unsigned table. Q8: bytes 0 and 2 of a word (its halves' low bytes)
// are one column pair, bytes 1 and 3 the next: low nibbles unsigned, high nibbles signed times 16.
AVX512 inline void decode4(__m512i v, __m512i low_table, __m512i high_table, __m512bh* w) {
  w[0] = lookup(v, low_table);
  w[1] = lookup(_mm512_srli_epi16(v, 4), high_table);
  w[2] = lookup(_mm512_srli_epi16(v, 8), low_table);
  w[3] = lookup(_mm512_srli_epi16(v, 12), high_table);
}

template <typename Scale> constexpr int q4_record() { return 256 + 2 * 16 * int(sizeof(Scale)); }
template <typename Scale> constexpr int q8_record() { return 512 + 16 * int(sizeof(Scale)); }

// sums of x over each block of 32 columns, float32: the min's factor
AVX512 void block_sums(const bf16* x, int64_t blocks, float* out) {
  for (int64_t b = 0; b < blocks; ++b)
    out[b] = _mm512_reduce_add_ps(_mm512_add_ps(widen(x + 32 * b), widen(x + 32 * b + 16)));
}

AVX512 void store_group(__m512 acc, bf16* out, int64_t valid) {
  if (valid >= 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), to_bf16(acc));
    return;
  }
  alignas(32) bf16 all[16];  // a last partial group: its padding rows stay out of the output
  _mm256_store_si256(reinterpret_cast<__m256i*>(all), to_bf16(acc));
  std::memcpy(out, all, valid * sizeof(bf16));
}

// One call's checked shapes, x's block sums (the min's factor, Q4 only) and its output
struct Product {
  at::Tensor x, out;
  int64_t R, K, groups, blocks, bytes;
  bool f32;  // float32 scales (else the GGUF's float16 ones)
  std::vector<float> sums;
  const uint8_t* rec;
  bf16* o;

  Product(const at::Tensor& x_in, const at::Tensor& records, int64_t out_features, bool q4) : x(x_in.contiguous()) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be bfloat16 (rows, K)");
    TORCH_CHECK(records.dim() == 3 && records.scalar_type() == at::kByte && records.is_contiguous(),
                "records must be uint8 (groups, blocks, record bytes)");
    R = x.size(0), K = x.size(1), groups = records.size(0), blocks = records.size(1), bytes = records.size(2);
    TORCH_CHECK(K == 32 * blocks && out_features <= 16 * groups && out_features > 16 * (groups - 1), "shapes disagree");
    f32 = bytes == (q4 ? q4_record<float>() : q8_record<float>());
    TORCH_CHECK(f32 || bytes == (q4 ? q4_record<uint16_t>() : q8_record<uint16_t>()), "unknown record size");
    sums.resize(q4 ? R * blocks : 0);
    for (int64_t r = 0; q4 && r < R; ++r) block_sums(data(x) + r * K, blocks, sums.data() + r * blocks);
    out = at::empty({R, out_features}, x.options());
    o = reinterpret_cast<bf16*>(out.data_ptr());
    rec = records.const_data_ptr<uint8_t>();
  }
};

}  // namespace

#pragma GCC pop_options
