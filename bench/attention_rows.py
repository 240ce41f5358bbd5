"""Milliseconds of decode attention's two products per pass against how many query rows share a KV
head (GQA group x verified tokens): the CPU bf16 kernels of model/decode_attention.py, the kernels of
an earlier revision (at most 16 rows per call: more go in chunks of 16) and torch.bmm, for L layers
x H KV heads at S keys, one thread (or --threads), medians of several repeats after a warm-up. Then
the whole attention: the two products with torch's softmax between them (three calls, as before
session 17) against `attend`, scores, softmax and values in one call, and `attend` over the keys in
tiles and values in pairs, the layout a full cache keeps them in (model/key_tiles.py, sessions 21, 33).

The floors: memory, reading every key and value once at the bandwidth one thread reads a long array
at; compute, the rows' multiply-adds at the peak rate of avx512_bf16's pair dot products (32 per
instruction), both measured here by small probes.

    python -m bench.attention_rows [--old ae7300c --rows 1,3,6,9,12,15,21,42 --keys 16384 --threads 1]
"""
from __future__ import annotations

import argparse
import ast
import statistics
import subprocess
import sys
import time

import torch

from triforce.model import cpu_kernels, decode_attention, key_tiles

OLD_MAX_ROWS = 16  # what the earlier kernels served per call

PROBES = r"""
#include <torch/extension.h>
#include <immintrin.h>
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512bf16")))

// n rounds of 16 independent pair dot products: the peak rate of the instruction
AVX512 double dot_rate(int64_t n) {
  __m512 a[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm512_set1_ps(1e-3f * i);
  __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), y = (__m512bh)_mm512_set1_epi32(0x3f003f00);
  for (int64_t k = 0; k < n; ++k) {
    for (int i = 0; i < 16; ++i) a[i] = _mm512_dpbf16_ps(a[i], x, y);
    asm volatile("" : "+v"(x));
  }
  float s = 0;
  for (int i = 0; i < 16; ++i) s += _mm512_reduce_add_ps(a[i]);
  return s;
}

// every 64-byte line of a tensor, read ahead by software prefetch as the kernels do
AVX512 int64_t read_all(torch::Tensor t) {
  const char* p = reinterpret_cast<const char*>(t.data_ptr());
  int64_t n = t.numel() * t.element_size();
  __m512i acc = _mm512_setzero_si512();
  for (int64_t i = 0; i + 64 <= n; i += 64) {
    _mm_prefetch(p + i + 4096, _MM_HINT_T0);
    acc = _mm512_xor_si512(acc, _mm512_loadu_si512(p + i));
  }
  return _mm512_reduce_add_epi64(acc);
}
"""


def old_source(rev: str) -> str:
    """The kernels' C++ at `rev`, its ops renamed into namespace triforce_decode_old."""
    return module_string(rev, "triforce/model/decode_attention.py", "SOURCE").replace("triforce_decode",
                                                                                       "triforce_decode_old")


def module_string(rev: str, path: str, name: str) -> str:
    """The string a module at `rev` assigns to `name`: literals joined by +, cpu_kernels' strings
    (AMX_FRAME, since session 32) read from cpu_kernels.py at the same revision, and since session 43
    the files of model/csrc/ that `csrc(...)` joins, read at the same revision."""
    text = git_show(rev, path)

    def value(node):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return value(node.left) + value(node.right)
        if isinstance(node, ast.Attribute) and getattr(node.value, "id", "") == "cpu_kernels":
            return module_string(rev, "triforce/model/cpu_kernels.py", node.attr)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "csrc":
            return "".join(git_show(rev, f"triforce/model/csrc/{ast.literal_eval(arg)}") for arg in node.args)
        return ast.literal_eval(node)

    return next(value(node.value) for node in ast.parse(text).body
                if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == name)


def git_show(rev: str, path: str) -> str:
    return subprocess.run(["git", "show", f"{rev}:{path}"], check=True, capture_output=True, text=True).stdout


def load_old(rev: str) -> bool:
    from torch.utils.cpp_extension import load_inline

    try:
        load_inline(f"triforce_decode_attention_old_{rev}", cpp_sources=[cpu_kernels.PRELUDE + old_source(rev)],
                    extra_cflags=["-O3"], is_python_module=False)
    except Exception as e:  # noqa: BLE001 - the table goes on without the column
        print(f"old kernels at {rev} not built: {e}", file=sys.stderr)
        return False
    old = torch.ops.triforce_decode_old
    if hasattr(old, "use_tiles"):  # a revision since session 32: its products on the path this tree's take
        old.use_tiles(decode_attention.tiles())
    return True


def probes():
    from torch.utils.cpp_extension import load_inline

    return load_inline("attention_rows_probes", cpp_sources=[PROBES], functions=["dot_rate", "read_all"],
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


def chunked(op, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The old kernels' way past 16 rows: calls of at most 16 rows each."""
    return torch.cat([op(a[:, r:r + OLD_MAX_ROWS], b) for r in range(0, a.shape[1], OLD_MAX_ROWS)], dim=1)


def tiles_of(keys: torch.Tensor, write=key_tiles.write) -> torch.Tensor:
    """Plain keys (H, S, D) in tiles (or values in pairs, with key_tiles.write_values), in a buffer of
    whole blocks; its first S slots."""
    buffer = keys.new_zeros(keys.shape[0], key_tiles.slots_for(keys.shape[1]), keys.shape[2])
    write(buffer, torch.arange(keys.shape[1]), keys)
    return buffer[:, :keys.shape[1]]


def measure(rows: list[int], keys: int, layers: int, heads: int, dim: int, repeats: int, old: str | None):
    g = torch.Generator().manual_seed(0)
    cache = [tuple(torch.randn(heads, keys, dim, generator=g).bfloat16() for _ in range(2)) for _ in range(layers)]
    # keys and values as a full cache stores them (model/key_tiles.py)
    tiled = [(tiles_of(k), tiles_of(v, key_tiles.write_values)) for k, v in cache]
    kv_bytes = sum(k.nbytes + v.nbytes for k, v in cache)
    p = probes()
    n = 2_000_000  # rounds of 16 pair dot products of 32 multiply-adds each
    macs_per_s = n * 16 * 32 / (fastest_ms(lambda: p.dot_rate(n)) / 1e3)
    memory_floor = fastest_ms(lambda: [p.read_all(t) for kv in cache for t in kv])
    have_old = old is not None and load_old(old)
    out = []
    for R in rows:
        q = torch.randn(heads, R, dim, generator=g).bfloat16()
        probs = torch.softmax(torch.randn(heads, R, keys, generator=g), dim=-1).bfloat16()
        row = {"rows": R}
        row["new_scores"] = median_ms(lambda: [decode_attention.scores(q, k) for k, _ in cache], repeats)
        row["new_mix"] = median_ms(lambda: [decode_attention.mix(probs, v) for _, v in cache], repeats)
        scale, limits = dim ** -0.5, torch.tensor([keys])
        row["three_calls"] = median_ms(lambda: [decode_attention.mix(
            torch.softmax(decode_attention.scores(q, k).mul_(scale), dim=-1), v) for k, v in cache], repeats)
        row["attend"] = median_ms(lambda: [decode_attention.attend(q, k, v, limits, scale) for k, v in cache], repeats)
        row["attend_tiled"] = median_ms(lambda: [decode_attention.attend(q, k, v, limits, scale, True)
                                                 for k, v in tiled], repeats)
        row["bmm"] = median_ms(lambda: [(torch.bmm(q, k.transpose(1, 2)), torch.bmm(probs, v)) for k, v in cache],
                               repeats)
        if have_old:
            ops = torch.ops.triforce_decode_old
            row["old"] = median_ms(lambda: [(chunked(ops.scores, q, k), chunked(ops.mix, probs, v))
                                            for k, v in cache], repeats)
        row["compute_floor"] = 2 * R * keys * dim * heads * layers / macs_per_s * 1e3
        row["memory_floor"] = memory_floor
        out.append(row)
    info = {"dot_gmacs": macs_per_s / 1e9, "read_gbs": kv_bytes / memory_floor / 1e6, "kv_mb": kv_bytes / 1e6}
    return out, info


def table(rows: list[dict], info: dict, args) -> str:
    lines = [f"decode attention, {args.layers} layers x {args.heads} KV heads, head_dim {args.dim}, {args.keys} keys, "
             f"{args.threads} thread(s): ms per pass (scores + values; then the attention whole)",
             f"floors: memory {info['kv_mb']:.0f} MB at {info['read_gbs']:.1f} GB/s, compute at "
             f"{info['dot_gmacs']:.0f} G bf16 multiply-adds/s (pair dot products)",
             f"{'rows':>4} {'old':>7} {'new':>7} {'(scores':>8} {'values)':>8} {'bmm':>7} {'floor':>7} "
             f"{'compute':>8} {'memory':>7} {'3 calls':>8} {'attend':>7} {'tiled':>6}"]
    for r in rows:
        new = r["new_scores"] + r["new_mix"]
        old = f"{r['old']:7.1f}" if "old" in r else f"{'-':>7}"
        floor = max(r["compute_floor"], r["memory_floor"])
        lines.append(f"{r['rows']:>4} {old}{'*' if r['rows'] > OLD_MAX_ROWS and 'old' in r else ' '}"
                     f"{new:6.1f} {r['new_scores']:8.1f} {r['new_mix']:8.1f} {r['bmm']:7.1f} "
                     f"{floor:7.1f} {r['compute_floor']:8.1f} {r['memory_floor']:7.1f} {r['three_calls']:8.1f} "
                     f"{r['attend']:7.1f} {r['attend_tiled']:6.1f}")
    lines.append(f"* in calls of at most {OLD_MAX_ROWS} rows; floor: the larger of compute and memory; "
                 "tiled: attend over keys in tiles and values in pairs, as the full cache holds them")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.attention_rows", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,3,6,9,12,15,21,42")
    ap.add_argument("--keys", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--dim", type=int, default=64, choices=decode_attention.HEAD_DIMS)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--old", default="ae7300c", help="git revision of the earlier kernels ('' for none)")
    ap.add_argument("--threads", type=int, default=1, help="torch's threads (the floors stay one thread's)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    if not decode_attention.available():
        print("the kernels do not build here (no avx512_bf16 or no C++ compiler)", file=sys.stderr)
        return 1
    rows, info = measure([int(x) for x in args.rows.split(",")], args.keys, args.layers, args.heads, args.dim,
                         args.repeats, args.old or None)
    print(table(rows, info, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
