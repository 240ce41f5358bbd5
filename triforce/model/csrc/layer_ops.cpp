// A layer's small steps as single calls (layer_ops.py), after prelude.h; built with
// -ffp-contract=off, so each step rounds as torch's ops do.

#include <cmath>
#include <mutex>
#include <string>
#include <unordered_map>
#include <ATen/core/dispatch/Dispatcher.h>

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


// ======== a layer's steps around its attention, one call on each side ========
// An eager decode pass's layer was a dozen calls from Python (a norm, the q/k/v product, the rotation,
// a view; the output product and its add; a norm, the gate/up product, two slices, silu, a product,
// the down product and its add), each a few microseconds of Python and dispatch whatever its size.
// Here the steps before the attention are one call and those after it another: the same kernels in
// the same order (the products through the dispatcher by name, torch's add, silu and mul as ATen
// calls), so the same bits; the attention stays with the cache, in Python.

// products over stored records by their ops' qualified names ("triforce_stored_f32::q4_product"),
// comma-separated, each looked up once
using Product = c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>;

const std::vector<Product>& products_named(const std::string& names) {
  static std::mutex guard;
  static std::unordered_map<std::string, std::vector<Product>> known;
  std::lock_guard<std::mutex> hold(guard);
  auto found = known.find(names);
  if (found != known.end()) return found->second;
  std::vector<Product> ops;
  for (size_t start = 0; start <= names.size();) {
    size_t end = std::min(names.find(',', start), names.size());
    ops.push_back(c10::Dispatcher::singleton().findSchemaOrThrow(names.substr(start, end - start).c_str(), "")
                      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>());
    start = end + 1;
  }
  return known.emplace(names, std::move(ops)).first->second;
}

// product i of a call: x W^T (+ bias, torch's add, as `product(x) + bias` adds in Python)
at::Tensor apply(const std::vector<Product>& ops, size_t i, const at::Tensor& x, at::TensorList records,
                 at::IntArrayRef features, const c10::List<std::optional<at::Tensor>>& biases) {
  TORCH_CHECK(i < ops.size() && i < records.size() && i < features.size() && i < biases.size(),
              "one product name, records, feature count and bias (or None) each");
  auto y = ops[i].call(x, records[i], features[i]);
  std::optional<at::Tensor> bias = biases.get(i);
  return bias.has_value() ? y + *bias : y;
}

// rms_norm, the fused q/k/v product, q and k rotated -> (q, k, v (T, kv_heads, D), a view of the product)
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_in_with(
    const std::vector<Product>& ops, const at::Tensor& x, const at::Tensor& norm, double eps, at::TensorList records,
    at::IntArrayRef features, const c10::List<std::optional<at::Tensor>>& biases, const at::Tensor& cos,
    const at::Tensor& sin, int64_t heads, int64_t kv_heads) {
  auto qkv = apply(ops, 0, rms_norm(x, norm, eps), records, features, biases);
  auto [q, k] = rotary_qk(qkv, cos, sin, heads, kv_heads);
  int64_t T = qkv.size(0), D = cos.size(-1);
  return {q, k, qkv.slice(1, (heads + kv_heads) * D).view({T, kv_heads, D})};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_in(
    const at::Tensor& x, const at::Tensor& norm, double eps, const std::string& names, at::TensorList records,
    at::IntArrayRef features, const c10::List<std::optional<at::Tensor>>& biases, const at::Tensor& cos,
    const at::Tensor& sin, int64_t heads, int64_t kv_heads) {
  return attention_in_with(products_named(names), x, norm, eps, records, features, biases, cos, sin, heads, kv_heads);
}

// h = x + o(attended); h + down(silu(gate) * up) of rms_norm(h), gate and up the fused product's halves;
// the products in the order o, gate/up, down
at::Tensor layer_out_with(const std::vector<Product>& ops, const at::Tensor& x, const at::Tensor& attended,
                          const at::Tensor& norm, double eps, at::TensorList records, at::IntArrayRef features,
                          const c10::List<std::optional<at::Tensor>>& biases) {
  auto h = x + apply(ops, 0, attended, records, features, biases);
  auto both = apply(ops, 1, rms_norm(h, norm, eps), records, features, biases);
  int64_t intermediate = features[1] / 2;
  auto gated = at::silu(both.slice(-1, 0, intermediate)) * both.slice(-1, intermediate);
  return h + apply(ops, 2, gated, records, features, biases);
}

at::Tensor layer_out(const at::Tensor& x, const at::Tensor& attended, const at::Tensor& norm, double eps,
                     const std::string& names, at::TensorList records, at::IntArrayRef features,
                     const c10::List<std::optional<at::Tensor>>& biases) {
  return layer_out_with(products_named(names), x, attended, norm, eps, records, features, biases);
}

// ======== every layer of a pass in one call ========

// With each layer two calls around its attention, a pass still crossed from Python into C++ three
// times a layer (the attention through the cache's Python), and every crossing paid argument
// conversion, the dispatcher's boxed call and autograd's fallback, and each ATen call inside it the
// autograd and view-tracking layers again: about 5 ms of a 15 ms SmolLM2 float32 pass at 256 cached
// tokens. A Stack holds a model's layers (their records, norms, biases and product ops) once; its
// forward runs them all, with the attention's cache write and kernel (triforce_decode_f32::cache_attend,
// the call the cache makes for these rows) in between, below autograd (a pass computes, never records).
// The same kernels in the same order as the layer-by-layer calls, so the same bits.
using CacheAttend = c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                        at::Tensor, at::Tensor, int64_t, int64_t, double)>;

struct Stack : torch::CustomClassHolder {
  struct Layer {
    const std::vector<Product>* into;  // the q/k/v product
    const std::vector<Product>* out;   // o, gate/up, down
    std::vector<at::Tensor> into_records, out_records;
    std::vector<int64_t> into_features, out_features;
    c10::List<std::optional<at::Tensor>> into_biases, out_biases;
    at::Tensor first_norm, second_norm;
    double first_eps, second_eps;
  };
  std::vector<Layer> layers;
  int64_t heads, kv_heads;
  double scale;
  CacheAttend attend;

  // per layer i: into_names[i] the q/k/v product's op, out_names[i] the other three's (comma-separated);
  // records, features and biases 4 a layer in that order; norms and eps 2 a layer (attention's, mlp's)
  Stack(c10::List<std::string> into_names, c10::List<std::string> out_names, c10::List<at::Tensor> records,
        c10::List<int64_t> features, c10::List<std::optional<at::Tensor>> biases, c10::List<at::Tensor> norms,
        c10::List<double> eps, int64_t heads, int64_t kv_heads, double scale)
      : heads(heads), kv_heads(kv_heads), scale(scale),
        attend(c10::Dispatcher::singleton().findSchemaOrThrow("triforce_decode_f32::cache_attend", "")
                   .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor, at::Tensor,
                                     int64_t, int64_t, double)>()) {
    size_t L = into_names.size();
    TORCH_CHECK(out_names.size() == L && records.size() == 4 * L && features.size() == 4 * L &&
                biases.size() == 4 * L && norms.size() == 2 * L && eps.size() == 2 * L,
                "a name pair a layer, records, features and biases 4 a layer, norms and eps 2 a layer");
    for (size_t i = 0; i < L; ++i) {
      Layer layer;
      layer.into = &products_named(into_names.get(i));
      layer.out = &products_named(out_names.get(i));
      TORCH_CHECK(layer.into->size() == 1 && layer.out->size() == 3, "1 product before the attention, 3 after");
      for (size_t j = 0; j < 4; ++j) {
        (j == 0 ? layer.into_records : layer.out_records).push_back(records.get(4 * i + j));
        (j == 0 ? layer.into_features : layer.out_features).push_back(features.get(4 * i + j));
        (j == 0 ? layer.into_biases : layer.out_biases).push_back(biases.get(4 * i + j));
      }
      layer.first_norm = norms.get(2 * i);
      layer.second_norm = norms.get(2 * i + 1);
      layer.first_eps = eps.get(2 * i);
      layer.second_eps = eps.get(2 * i + 1);
      layers.push_back(std::move(layer));
    }
  }

  // x (T, hidden) through every layer, the new keys and values into cache_k/cache_v (layers, kv_heads,
  // slots, D) at slots [start, start + T) -> (x, each layer's rotated queries (T, heads, D))
  std::tuple<at::Tensor, c10::List<at::Tensor>> forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                                                        const at::Tensor& cache_k, const at::Tensor& cache_v,
                                                        int64_t start) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    c10::List<at::Tensor> queries;
    queries.reserve(layers.size());
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer& l = layers[i];
      auto [q, k, v] = attention_in_with(*l.into, x, l.first_norm, l.first_eps, l.into_records, l.into_features,
                                         l.into_biases, cos, sin, heads, kv_heads);
      auto attended = attend.call(q, k, v, cache_k, cache_v, int64_t(i), start, scale);
      x = layer_out_with(*l.out, x, attended, l.second_norm, l.second_eps, l.out_records, l.out_features,
                         l.out_biases);
      queries.push_back(q);
    }
    return {x, queries};
  }
};

// the stack's forward as an op: one op to the dispatcher (a profiler or an op counter sees the pass's
// layers as one call, as it sees each layer's two), the ATen calls inside it unseen
std::tuple<at::Tensor, c10::List<at::Tensor>> run_stack(const c10::intrusive_ptr<Stack>& stack, const at::Tensor& x,
                                                        const at::Tensor& cos, const at::Tensor& sin,
                                                        at::Tensor cache_k, at::Tensor cache_v, int64_t start) {
  return stack->forward(x, cos, sin, cache_k, cache_v, start);
}

}  // namespace

TORCH_LIBRARY(triforce_layer, m) {
  m.def("use_pool(int address) -> ()", &use_pool);
  m.def("rotary_qk(Tensor qkv, Tensor cos, Tensor sin, int heads, int kv_heads) -> (Tensor, Tensor)");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("attention_in(Tensor x, Tensor norm, float eps, str products, Tensor[] records, int[] features, "
        "Tensor?[] biases, Tensor cos, Tensor sin, int heads, int kv_heads) -> (Tensor, Tensor, Tensor)");
  m.def("layer_out(Tensor x, Tensor attended, Tensor norm, float eps, str products, Tensor[] records, "
        "int[] features, Tensor?[] biases) -> Tensor");
  m.class_<Stack>("Stack")
      .def(torch::init<c10::List<std::string>, c10::List<std::string>, c10::List<at::Tensor>, c10::List<int64_t>,
                       c10::List<std::optional<at::Tensor>>, c10::List<at::Tensor>, c10::List<double>, int64_t,
                       int64_t, double>())
      .def("forward", &Stack::forward);
  m.def("run_stack(__torch__.torch.classes.triforce_layer.Stack stack, Tensor x, Tensor cos, Tensor sin, "
        "Tensor(a!) cache_k, Tensor(b!) cache_v, int start) -> (Tensor, Tensor[])");
}

TORCH_LIBRARY_IMPL(triforce_layer, CPU, m) {
  m.impl("rotary_qk", &rotary_qk);
  m.impl("rms_norm", &rms_norm);
  m.impl("attention_in", &attention_in);
  m.impl("layer_out", &layer_out);
  m.impl("run_stack", &run_stack);
}
