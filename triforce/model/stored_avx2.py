"""float32 products of a few rows with weights as stored (GGUF blocks), as avx2 kernels: the float32
path that CPUs without native bfloat16 take (avx2-only ones, and avx512 Xeons from Skylake-SP to
Ice Lake, where the same kernels run as avx512f code, the same bits).

The same records as stored_bf16 (its module docstring has the layout: 16 output rows a group, one per
lane; per block of 32 columns the codes, then the rows' d, then m), read here as two halves of 8
lanes. For each row x (float32) and output n:

    y[n] = sum over blocks b of  d[n,b] * (sum_{k in b} q[n,k] x[k])  +  m[n,b] * (sum_{k in b} x[k])

with q the codes (0..15 for Q4_1/Q4_K, -128..127 for Q8_0/Q5_0), d and m the GGUF's own values in
float32. The dequantized model computes sum_k (d q + m) x: the same sum in another grouping, so the
outputs agree to float32 accumulation order (tests/model/test_stored_avx2.py holds them to float64).

How a code becomes a float with few instructions: a code is masked where it lies in its 32-bit word,
so it arrives as q * 2^s (exact), and the power of two is taken out of something else, exactly:

- Q4: nibble j of a word (bits 4j..4j+3) is masked in place (q * 2^4j, one AND; the top nibble is
  shifted down 4 first, so that its value stays positive); each column always sits in the same
  nibble, so every row of x is copied once per call with column k scaled by that nibble's 2^-4j.
  q * 2^4j times x * 2^-4j is the product q * x, rounded the same (scaling by a power of two is
  exact while x * 2^-28 stays a normal float, |x| > 2^-98).
- Q8: each byte is moved to the top of the word (q * 2^24 with its sign, a shift or a mask), and the
  block's d is taken as d * 2^-24: t * (d * 2^-24) rounds as (t * 2^-24) * d.

Then one convert and one multiply-add a weight vector, one sum chain per output row and half, in the
same order whatever the number of rows (a row of a verification pass is that row's one-token pass,
bit for bit), groups of rows split over torch's threads.

One row, one thread, avx2 code (`ATEN_CPU_CAPABILITY=avx2 python -m bench.f32_routes`, AMD EPYC):
32768x1024 Q4 1.08 ms against 6.00 dense float32 and 2.76 through stored_f32's compiled product;
SmolLM2's 49152x576 head (Q8 records) 1.05 against 6.34 and 1.99. Past one row the decode of each
code is shared by 4 rows and the kernels run at the float32 multiply-add peak, as a GEMM over dense
weights does.

On a CPU with avx512f a group's 16 outputs are one register and two groups run side by side, each
lane making the avx2 code's operations in its order: the same bits, and on the 2-core avx512 Xeon
(SmolLM2's 121 products in turn, 2 threads) one row 8.4 -> 7.8 ms (the records' read bounds it), 4
rows 14.8 -> 12.2, 7 rows 24.6 -> 19.1 (`python -m bench.pass_cost --dtype float32 --products
avx512,avx2`: whole passes, side by side).
"""
from __future__ import annotations

import torch

from . import cpu_kernels
from .stored_bf16 import BLOCK, q4_records, q8_records

# The kernels take rows 4 at a time, each group's records read from memory once per call and from
# cache per 4 rows. Past 4 rows they run at the float32 multiply-add peak, as torch's GEMM does over
# dense weights (3072x576, 2 threads: 64 rows 1.02 ms against 0.35 to dequantize + 1.19; 256 rows 4.09
# against 0.35 + 4.06): past this many rows (prefill pieces) the GEMM takes them, since each group
# then streams every row of x, from memory once x outgrows the caches
MAX_ROWS = 256

SOURCE = cpu_kernels.csrc("stored_avx2.cpp")

KERNEL = cpu_kernels.Kernel("triforce_stored_f32", SOURCE, isa=cpu_kernels.AVX2, pool_ops="triforce_stored_f32")

# On a CPU with avx512f the kernels take 16 outputs a register, two groups side by side, the same
# bits as the avx2 code (csrc/stored_avx2.cpp; cpu_kernels.wide_default)
WIDE = cpu_kernels.wide_default()


@cpu_kernels.constant_result  # torch.compile asks at trace time, and builds nothing inside a graph
def available() -> bool:
    """Whether the kernels build here (avx2, FMA, F16C and a C++ compiler) and compute the dequantized
    product on a small case. Asked once per process."""
    return cpu_kernels.built(KERNEL, _register_shapes, _self_check)


def _self_check() -> bool:
    """Both kernels and both dequantizations against float64 on 5 rows of a 40 x 64 matrix (two
    groups and a partial one, a 4-row and a 1-row pass); where the CPU has avx512f, its kernels the
    avx2 ones' bits. Leaves the module on WIDE."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g)
    d = (torch.rand(40, 2, generator=g) * 0.01).half().float()
    m = -(torch.rand(40, 2, generator=g) * 0.08).half().float()
    q4 = torch.randint(0, 16, (40, 64), generator=g)
    q8 = torch.randint(-128, 128, (40, 64), generator=g)
    ok = True
    for records, codes, mins, product, dense in (
            (q4_records(q4, d, m), q4, m, q4_product, q4_dense),
            (q8_records(q8, d), q8, torch.zeros_like(m), q8_product, q8_dense)):
        w = (codes.view(40, 2, BLOCK).double() * d.double()[..., None] + mins.double()[..., None]).view(40, 64)
        want = x.double() @ w.t()
        use_avx512(False)
        narrow = product(x, records, 40)
        ok = ok and bool(((narrow.double() - want).abs() <= 1e-5 * (1 + want.abs())).all())
        ok = ok and bool(((dense(records, 40).double() - w).abs() <= 1e-6 * w.abs()).all())
        if cpu_kernels.cpu_has(cpu_kernels.AVX512F):
            use_avx512(True)
            ok = ok and torch.equal(product(x, records, 40), narrow)
    use_avx512(WIDE)
    return ok


_code = cpu_kernels.WideCode("triforce_stored_f32", lambda: available())
use_avx512, code = _code.use, _code.code  # the products' code, and which one runs


def _register_shapes() -> None:
    """What the ops return, for torch.compile's tracing (which runs no kernel)."""
    for op in ("q4_product", "q8_product"):
        @torch.library.register_fake(f"triforce_stored_f32::{op}")
        def _(x, records, out_features):
            return x.new_empty(x.shape[0], out_features)
    for op in ("q4_dense", "q8_dense"):
        @torch.library.register_fake(f"triforce_stored_f32::{op}")
        def _(records, out_features):
            return records.new_empty(out_features, records.shape[1] * BLOCK, dtype=torch.float32)


def q4_product(x: torch.Tensor, records: torch.Tensor, out_features: int) -> torch.Tensor:
    """x (R, K) float32 . W^T for W = d * q + m as Q4 records -> (R, out_features) float32."""
    return torch.ops.triforce_stored_f32.q4_product(x, records, out_features)


def q8_product(x: torch.Tensor, records: torch.Tensor, out_features: int) -> torch.Tensor:
    """x (R, K) float32 . W^T for W = d * q as Q8 records -> (R, out_features) float32."""
    return torch.ops.triforce_stored_f32.q8_product(x, records, out_features)


def q4_dense(records: torch.Tensor, out_features: int) -> torch.Tensor:
    """W = d * q + m (out_features, K) float32 from Q4 records."""
    return torch.ops.triforce_stored_f32.q4_dense(records, out_features)


def q8_dense(records: torch.Tensor, out_features: int) -> torch.Tensor:
    """W = d * q (out_features, K) float32 from Q8 records."""
    return torch.ops.triforce_stored_f32.q8_dense(records, out_features)


def serves(x: torch.Tensor) -> bool:
    """Whether these kernels take this input: float32 on CPU, a few rows, the kernels built."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.numel() <= MAX_ROWS * x.shape[-1]
            and available())
