"""Milliseconds of decode attention's two products (scores and values) for float32 query rows, the
way an avx2-only CPU runs them: a float32 model over a 16-bit KV cache (model/kv_dtype.py), L layers
x H KV heads x head_dim D at S keys, one thread, medians of several repeats after a warm-up.

Variants:
  attend_f16    the whole attention in one call (decode_attention_f32.attend: scores, softmax, mix)
  three_calls   what attention.py ran before attend: scores, a scaling, torch's softmax, mix
  kernels_f16   model/decode_attention_f32.py's two products over a float16 cache (every head in one call)
  kernels_f32   the same kernels over a float32 cache
  widen_gemm    the earlier path: each head widened with .to(float32), then addmm and matmul
  bmm_f32       torch.bmm over a float32 cache (what a float32 KV cache costs)
Floors: memory, the 16-bit cache's keys and values read once at the bandwidth one thread reads a long
array at (read ahead by software prefetch); compute, the rows' multiply-adds at the peak rate of
avx2's FMA; both measured by small probes.

    ATEN_CPU_CAPABILITY=avx2 python -m bench.attention_f32 [--rows 1,3,6,12,21,42 --keys 4096,16384]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from triforce.model import decode_attention_f32 as f32

PROBES = r"""
#include <torch/extension.h>
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2,fma,f16c")))

// n rounds of 12 independent FMAs: the peak multiply-add rate
AVX2 double fma_rate(int64_t n) {
  __m256 a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_ps(1e-3f * i);
  __m256 x = _mm256_set1_ps(0.999f), y = _mm256_set1_ps(1e-6f);
  for (int64_t k = 0; k < n; ++k) {
    for (int i = 0; i < 12; ++i) a[i] = _mm256_fmadd_ps(a[i], x, y);
    asm volatile("" : "+x"(x));
  }
  float s = 0, t[8];
  for (int i = 0; i < 12; ++i) { _mm256_storeu_ps(t, a[i]); for (int j = 0; j < 8; ++j) s += t[j]; }
  return s;
}

// every 64-byte line of a tensor, read ahead by software prefetch as the kernels do
AVX2 int64_t read_all(torch::Tensor t) {
  const char* p = reinterpret_cast<const char*>(t.data_ptr());
  int64_t n = t.numel() * t.element_size();
  __m256i acc = _mm256_setzero_si256();
  for (int64_t i = 0; i + 64 <= n; i += 64) {
    _mm_prefetch(p + i + 4096, _MM_HINT_T0);
    acc = _mm256_xor_si256(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
    acc = _mm256_xor_si256(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
  }
  return _mm256_extract_epi64(acc, 0) + _mm256_extract_epi64(acc, 1);
}
"""


def probes():
    from torch.utils.cpp_extension import load_inline

    return load_inline("attention_f32_probes", cpp_sources=[PROBES], functions=["fma_rate", "read_all"],
                       extra_cflags=["-O3"])


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def fastest_ms(fn, repeats: int = 3) -> float:
    """A probe's best time after a warm-up: the rate the machine can reach."""
    fn()
    return min(median_ms(fn, 1) for _ in range(repeats))


def each(cache, fn) -> None:
    for k, v in cache:
        fn(k, v)


def widen_gemm(q: torch.Tensor, probs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, D: int):
    """attention.py's earlier float32 path over a 16-bit cache, products only: per head, widen, GEMM."""
    for h in range(k.shape[0]):
        torch.empty(q.shape[1], k.shape[1]).addmm_(q[h], k[h].to(torch.float32).T, beta=0, alpha=D ** -0.5)
        torch.matmul(probs[h], v[h].to(torch.float32))


def measure(rows: list[int], keys: int, layers: int, heads: int, dim: int, repeats: int, p) -> tuple[list, dict]:
    g = torch.Generator().manual_seed(0)
    half = [tuple(torch.randn(heads, keys, dim, generator=g).half() for _ in range(2)) for _ in range(layers)]
    full = [tuple(t.float() for t in kv) for kv in half]
    half_bytes = sum(t.nbytes for kv in half for t in kv)
    memory_floor = fastest_ms(lambda: [p.read_all(t) for kv in half for t in kv])
    n = 2_000_000  # rounds of 12 FMAs of 8 multiply-adds
    macs_per_s = n * 12 * 8 / (fastest_ms(lambda: p.fma_rate(n)) / 1e3)
    out = []
    for R in rows:
        q = torch.randn(heads, R, dim, generator=g)
        probs = torch.softmax(torch.randn(heads, R, keys, generator=g), dim=-1)
        row = {"rows": R, "keys": keys}
        # each result dropped as the next layer starts, as in a pass: holding 30 layers' scores (250 MB
        # at 42 rows, 16K keys) measured the allocator's page faults instead
        row["kernels_f16_scores"] = median_ms(lambda: each(half, lambda k, v: f32.scores(q, k)), repeats)
        row["kernels_f16_mix"] = median_ms(lambda: each(half, lambda k, v: f32.mix(probs, v)), repeats)
        row["kernels_f16"] = row["kernels_f16_scores"] + row["kernels_f16_mix"]
        limits = torch.tensor([keys])
        row["attend_f16"] = median_ms(lambda: each(half, lambda k, v: f32.attend(q, k, v, limits, dim ** -0.5)), repeats)
        row["three_calls"] = median_ms(lambda: each(half, lambda k, v: f32.mix(
            torch.softmax(f32.scores(q, k).mul_(dim ** -0.5), dim=-1), v)), repeats)
        row["kernels_f32"] = median_ms(lambda: each(full, lambda k, v: (f32.scores(q, k), f32.mix(probs, v))), repeats)
        row["widen_gemm"] = median_ms(lambda: each(half, lambda k, v: widen_gemm(q, probs, k, v, dim)), repeats)
        row["bmm_f32"] = median_ms(lambda: each(full, lambda k, v: (torch.bmm(q, k.transpose(1, 2)),
                                                                     torch.bmm(probs, v))), repeats)
        row["memory_floor_f16"] = memory_floor
        row["compute_floor"] = 2 * R * keys * dim * heads * layers / macs_per_s * 1e3
        out.append(row)
    info = {"read_gbs": half_bytes / memory_floor / 1e6, "kv_mb_f16": half_bytes / 1e6, "fma_gmacs": macs_per_s / 1e9}
    return out, info


def table(rows: list[dict], info: dict, args) -> str:
    lines = [f"float32 rows, {args.layers} layers x {args.heads} KV heads, head_dim {args.dim}, 1 thread: "
             f"ms per pass (attention or its products)",
             f"floors: memory (float16 K+V once) at {info['read_gbs']:.1f} GB/s, compute at "
             f"{info['fma_gmacs']:.0f} G float32 multiply-adds/s",
             f"{'keys':>6} {'rows':>4} {'attend':>7} {'3 calls':>8} {'kernels':>8} {'k/f32':>7} {'widen':>7} "
             f"{'bmm f32':>8} {'memory':>7} {'compute':>8}"]
    for r in rows:
        lines.append(f"{r['keys']:>6} {r['rows']:>4} {r['attend_f16']:7.1f} {r['three_calls']:8.1f} "
                     f"{r['kernels_f16']:8.1f} {r['kernels_f32']:7.1f} {r['widen_gemm']:7.1f} {r['bmm_f32']:8.1f} "
                     f"{r['memory_floor_f16']:7.1f} {r['compute_floor']:8.1f}")
    lines.append("attend: the whole attention in one call, float16 cache; 3 calls: scores, softmax, mix (before "
                 "attend);\nkernels: the two products alone; k/f32: them over a float32 cache; widen: per-head "
                 ".to(float32) + addmm/matmul\nover float16; bmm f32: torch.bmm over a float32 cache")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.attention_f32", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,3,6,12,21,42")
    ap.add_argument("--keys", default="4096,16384")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--dim", type=int, default=64, choices=f32.HEAD_DIMS)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default="", help="write the rows and floors to this file")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(1)
    if not f32.available():
        print("the kernels do not build here (no avx2/fma/f16c or no C++ compiler)", file=sys.stderr)
        return 1
    p = probes()
    rows, infos = [], {}
    for S in (int(x) for x in args.keys.split(",")):
        part, infos[S] = measure([int(x) for x in args.rows.split(",")], S, args.layers, args.heads, args.dim,
                                 args.repeats, p)
        rows += part
    print(table(rows, infos[max(infos)], args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setup": {"layers": args.layers, "heads": args.heads, "head_dim": args.dim, "threads": 1,
                                 "repeats": args.repeats,
                                 "ATEN_CPU_CAPABILITY": os.environ.get("ATEN_CPU_CAPABILITY", ""),
                                 "torch": torch.__version__},
                       "floors": {str(k): v for k, v in infos.items()}, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
