"""The two products of decode attention for float32 query rows over a 16-bit (or float32) cache, on
CPUs with avx2, fma and f16c (as avx512f code where the CPU has it): scores = rows . keys^T and
out = probs . values for each KV head, the rows being the query rows that share the head (GQA group x
new tokens: 3 in a SmolLM2 decode step, 21 in a verification pass of 7 tokens, 42 for Qwen2.5-1.5B).

A float32 model on a CPU without avx512_bf16 keeps its KV cache in 16 bits (model/kv_dtype.py). The
products used to widen each head to float32 with `.to()` and run torch's GEMMs on the copy: memory
saw the 16-bit read, but the widening wrote and re-read a float32 copy of every head, every layer.
These kernels read the 16-bit cache itself, a block of keys or values at a time (4-8 KB, in L1 while
every row runs over it), widening each 8 values in registers as they are loaded (F16C's `vcvtph2ps`
for float16, a 16-bit shift for bfloat16): memory sees each 16-bit value once per call however many
rows share it, and no float32 copy is written.

- scores: rows in pairs, 4 keys at a time, each (row, key)'s partial sums in its own vector (8
  independent FMA chains, each key chunk loaded and widened once for both rows), reduced to one
  vector of 8 scores by a tree of horizontal adds; no transposition of the keys.
- mix: per key, each row's weight broadcast and multiply-added into the row's sums; rows in tiles
  whose sums fit the 16 ymm registers (6 rows x 16 dims, 2-3 x 32, 1 x 64), the sums waiting in the
  float32 output between blocks.

Both read ahead by software prefetch, spread over the loops that work on the block before.

- attend: the whole attention of the rows in one call, which is what attention.py calls. Each task,
  a (head, span of 2,048 keys), scores its span into a scratch block, turns the scores into weights
  against the span's own maximum (a vectorized exp), and mixes the span's values; each head then
  merges its spans by their maxima, in span order. It replaces scores, a scaling pass, torch's
  softmax and mix: torch's float32 softmax on avx2 cost 20-25% of the attention (SmolLM2 at 16K keys,
  3 rows: 453 us before, 403 after; 21 rows 2.91 ms, 2.58). A token t sees the first limits[t] keys,
  so a static view's slots past the sequence are never read, where scores and mix spanned them all.

Exact as bmm on the widened cache is, but for the order of the float32 sums: widening float16 or
bfloat16 to float32 is exact, and every product and sum is a float32 FMA.

SmolLM2 (30 layers x 3 KV heads x head_dim 64), both products, one thread, ATEN_CPU_CAPABILITY=avx2,
medians in ms (bench/attention_f32.py, results/attention-f32-avx2.json); "widen" is the earlier path
(per head `.to(float32)`, then addmm and matmul), the memory floor the float16 keys and values read
once at one thread's bandwidth (40 GB/s), the compute floor the multiply-adds at FMA's peak (69 G/s):

    keys  rows  float16 cache  widen   float32 cache: kernels  bmm   floor: memory  compute
    4096     1       2.2         8.1                   5.1      8.4          2.2      0.7
    4096     3       3.0        12.6                   4.9     13.3          2.2      2.1
    4096    21      16.1        28.5                  17.7     30.3          2.2     14.4
   16384     1       9.6        25.9                  21.0     33.6          9.4      2.7
   16384     3      11.6        48.6                  20.9     56.0          9.4      8.2
   16384     6      19.5        50.6                  23.1     70.8          9.4     16.4
   16384    12      38.1        69.5                  42.3     87.8          9.4     32.8
   16384    21      68.1       112.4                  71.8    121.3          9.4     57.4
   16384    42     127.6       176.6                 137.8    193.6          9.4    114.8

At 1-3 rows the float16 kernels run at the memory floor (2.7-4.2x faster than widening); past ~6 rows
they are bound by the multiply-adds, at 85-90% of FMA's peak. Over a float32 cache the same kernels
beat torch's bmm at every row count (1.4-3x), so they serve float32 caches too.

On a CPU with avx512f (and no native bfloat16: Xeons from Skylake-SP to Ice Lake, where the model
computes in float32) both products and the softmax's exponentials run as avx512f code
(csrc/attention_f32_avx512.h), each lane making the avx2 code's operations in its order: the same
bits, tested. Scores put two rows in a register (a pair's 8 partial sums per key in each half), 3 pairs
x 8 keys a tile, a block of 16-bit keys widened once into L1 when two tiles or more read it (where
the avx2 code's widening serves 2 rows, this one serves 6 to all); mix holds 16 dims of a row's sums a
register, 6 rows x 64 dims a tile. Below 5 rows (scores) and 2 (mix) the avx2 code runs: bound by
reading the cache, it was as fast or faster. SmolLM2's 30 layers on the 2-core avx512 Xeon, float16
cache, 2 threads, ms avx2 -> avx512 side by side in one process:

    keys  rows   scores            mix               attend
    4096     3    2.9 ->  2.7      2.8 ->  2.6       5.8 ->  5.8
    4096    21   11.8 ->  7.7     11.9 ->  5.8      27.9 -> 17.6 (1.59x)
   16384     3   12.6 -> 12.5     12.2 -> 11.4      27.1 -> 25.4
   16384    21   49.5 -> 31.0     50.1 -> 23.0     108.7 -> 62.8 (1.73x)

Llama-3-like heads (8 KV heads x 128 dims, 28 rows, 4,096 keys, one thread): scores 1.73x, mix
1.98x. `TRIFORCE_AVX512=0` keeps the avx2 code (cpu_kernels.wide_default).

The C++ is built at first use with torch's extension builder (cached on disk) and registered as torch
ops (`triforce_decode_f32::scores`, `::mix`, `::attend`) that torch.compile calls as opaque kernels. Where it
cannot build, or the CPU lacks avx2/fma/f16c, attention keeps its GEMMs.
"""
from __future__ import annotations

import torch

from . import cpu_kernels

HEAD_DIMS = (64, 128)  # the kernels are unrolled for these
CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

SOURCE = cpu_kernels.csrc("attention_f32_blocks.h", "attention_f32_avx512.h", "decode_attention_f32.cpp")

KERNEL = cpu_kernels.Kernel("triforce_decode_attention_f32", SOURCE, isa=cpu_kernels.AVX2, pool_ops="triforce_decode_f32")

# On a CPU with avx512f both products run as avx512f code, the same bits (csrc/attention_f32_avx512.h;
# cpu_kernels.wide_default)
WIDE = cpu_kernels.wide_default()


@cpu_kernels.constant_result  # torch.compile asks at trace time, and builds nothing inside a graph
def available() -> bool:
    """Whether the kernels build here (avx2, fma, f16c and a C++ compiler) and compute bmm's
    products on a small case; any failure means attention keeps torch's GEMMs. Asked once per process."""
    return cpu_kernels.built(KERNEL, _register_shapes, _self_check)


def _self_check() -> bool:
    """1 and 9 rows (the one-tile and tiled value loops), 77 keys (a part block and a part group of
    8), every cache dtype, against bmm on the widened cache; where the CPU has avx512f, its code the
    avx2 code's bits. Leaves the module on WIDE."""
    g = torch.Generator().manual_seed(0)
    ok = True
    for dtype in CACHE_DTYPES:
        cache = torch.randn(2, 77, 64, generator=g).to(dtype)
        wide = cache.float()
        for n in (1, 9):
            rows = torch.randn(2, n, 64, generator=g)
            probs = torch.rand(2, n, 77, generator=g)
            use_avx512(False)
            products = scores(rows, cache), mix(probs, cache)
            ok = ok and (torch.allclose(products[0], torch.bmm(rows, wide.transpose(1, 2)), rtol=1e-4, atol=1e-4)
                         and torch.allclose(products[1], torch.bmm(probs, wide), rtol=1e-4, atol=1e-4))
            if cpu_kernels.cpu_has(cpu_kernels.AVX512F):
                use_avx512(True)
                ok = ok and torch.equal(scores(rows, cache), products[0]) and torch.equal(mix(probs, cache), products[1])
    use_avx512(WIDE)
    return ok


_code = cpu_kernels.WideCode("triforce_decode_f32", lambda: available())
use_avx512, code = _code.use, _code.code  # the attention's code, and which one runs


def _register_shapes() -> None:
    """What the ops return, for torch.compile's tracing (which runs no kernel)."""
    @torch.library.register_fake("triforce_decode_f32::scores")
    def _(rows, keys):
        return rows.new_empty(rows.shape[0], rows.shape[1], keys.shape[1])

    @torch.library.register_fake("triforce_decode_f32::mix")
    def _(probs, values):
        return probs.new_empty(probs.shape[0], probs.shape[1], values.shape[2])

    @torch.library.register_fake("triforce_decode_f32::attend")
    def _(rows, keys, values, limits, scale):
        return rows.new_empty(rows.shape)

    @torch.library.register_fake("triforce_decode_f32::cache_attend")
    def _(q, k, v, cache_k, cache_v, layer, start, scale):
        return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def serves(rows: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether these kernels take float32 rows (H, R, D) against a cache layer (H, S, D): a 16-bit
    cache, and a float32 one too (1.4-3x faster than bmm there at 1-42 rows, SmolLM2 at 16K keys)."""
    return (rows.device.type == "cpu" and rows.dtype == torch.float32 and cache.dtype in CACHE_DTYPES
            and rows.shape[-1] in HEAD_DIMS and available())


def scores(rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """bmm(rows, keys^T) in float32: (H, R, D) float32 rows, (H, S, D) float16/bfloat16/float32 keys,
    each head's tokens contiguous."""
    return torch.ops.triforce_decode_f32.scores(rows, keys)


def mix(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """bmm(probs, values) in float32: (H, R, S) float32 weights, (H, S, D) float16/bfloat16/float32 values."""
    return torch.ops.triforce_decode_f32.mix(probs, values)


def attend(rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, limits: torch.Tensor,
           scale: float) -> torch.Tensor:
    """softmax(scale * rows . keys^T) . values in float32, scores, softmax and mix in one call:
    (H, R, D) float32 rows, row r being token r % T of its head's query group, token t seeing the
    first limits[t] keys ((T,) int64); (H, S, D) float16/bfloat16/float32 keys and values."""
    return torch.ops.triforce_decode_f32.attend(rows, keys, values, limits, scale)


def cache_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                 layer: int, start: int, scale: float) -> torch.Tensor:
    """The T new tokens' keys and values (T, Hkv, D) float32 into a cache's buffers (L, Hkv, S, D) at
    [layer, :, start:start + T] (rounded to the cache's dtype as copy_ rounds), then `attend` for their
    queries (T, Hq, D) over the first start + T slots, token t seeing start + t + 1 -> (T, Hq * D):
    one call where the write, the grouping of the rows and the views were ~20 torch ops a layer."""
    return torch.ops.triforce_decode_f32.cache_attend(q, k, v, cache_k, cache_v, layer, start, scale)
