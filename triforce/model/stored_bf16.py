"""bfloat16 products of a few rows with weights as stored (GGUF blocks), read once at memory speed.

torch's packed int4 kernel ran at 17-20 GB/s on this project's CPU whatever the shape, against ~48 to
read memory (one thread; SmolLM2's weight products 5.6 ms a token against a 2.1 ms byte floor), and
it takes the scales rounded to bfloat16. These kernels compute, for each row x (bf16) and output n,

    y[n] = sum over blocks b of  d[n,b] * (sum_{k in b} q[n,k] x[k])  +  m[n,b] * (sum_{k in b} x[k])

which is x . W^T for W = d * q + m (Q4_1, and Q4_K decoded to per-32 blocks) or W = d * q (Q8_0, and
Q5_0 decoded to Q8_0's form, with m = 0), with d and m the GGUF's own values as float32 (f16 values,
or for Q4_K an f16 times a 6-bit integer: stored as float32 there). Every product q * x is exact in
float32 (the codes are exact in bfloat16: 0..15, or for Q8_0 its two nibbles 16 * hi + lo with hi in
[-8, 7]; avx512_bf16 multiplies pairs of bfloat16 exactly), every sum is a float32 sum, and each output
is rounded once to bfloat16, to nearest even. So this is the dequantized model's product but for the
order (and grouping by block) of float32 sums; tests/model/test_stored_bf16.py holds it to float64.

Layout ("records", built by `q4_records` / `q8_records`, stored in the packed cache): the output rows
in groups of 16, one per lane of a 512-bit vector, so that a block's sum lands in a lane without
horizontal sums. For each group and block of 32 columns, contiguous (one stream, read ahead 4 KB):

    Q4 (320 bytes, or 384 with float32 scales): 4 vectors of 16 int32 words, lane n of vector c holding
       row n's columns 8c..8c+7 of the block as nibbles: nibble k of the low 16 bits is column 8c+2k,
       nibble k of the high 16 bits column 8c+2k+1; then the 16 rows' d, then their m.
    Q8 (544 bytes, or 576): 8 vectors of 16 words, lane n of vector c holding row n's int8 codes of
       columns 4c, 4c+2, 4c+1, 4c+3 (in byte order); then the 16 rows' d.

A word's 16-bit halves are extracted by the same shift, and looked up (vpermw, one instruction) in
a table of bfloat16 values: each extraction is a pair of columns (2j, 2j+1) whose x is one 32-bit
broadcast, so x needs no rearranging. Rows past N (a last partial group) have zero codes and scales.
"""
from __future__ import annotations

import torch

from . import cpu_kernels, stored_amx

LANES = 16  # output rows per group: one per float32 lane of a 512-bit vector
BLOCK = 32
# The kernels take any number of rows of x, 4 at a time in registers, each group's records read from
# memory once and again from cache per 4 rows; past this many, dequantizing for one dense GEMM is
# cheaper (SmolLM2's 121 matrices, one thread: 64 rows 68 ms against 449 ms to dequantize and
# multiply, 256 rows 272 against 546, 1,024 rows 1,148 against 1,038). A drafter catching up on
# tokens it did not see, or refilling its window, feeds tens to hundreds of rows.
MAX_ROWS = 256

SOURCE = cpu_kernels.csrc("records.h", "stored_bf16.cpp")

KERNEL = cpu_kernels.Kernel("triforce_stored_bf16", SOURCE, pool_ops="triforce_stored")


@cpu_kernels.constant_result  # torch.compile asks at trace time, and builds nothing inside a graph
def available() -> bool:
    """Whether the kernels build here and compute the dequantized product on a small case (any
    failure keeps torch's int4 kernel). Asked once per process."""
    return cpu_kernels.built(KERNEL, register_shapes, _self_check)


def _self_check(q4_product=None, q8_product=None) -> bool:
    """Both kernels (these, or stored_amx's) against the dequantized weights on 3 rows of a 24 x 64
    matrix (a partial group)."""
    q4_product, q8_product = q4_product or _q4_avx512, q8_product or _q8_avx512
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g).bfloat16()
    d = (torch.rand(24, 2, generator=g) * 0.01).half().float()
    m = -(torch.rand(24, 2, generator=g) * 0.08).half().float()
    q4 = torch.randint(0, 16, (24, 64), generator=g)  # float16 scales here; float32 ones in the tests
    q8 = torch.randint(-128, 128, (24, 64), generator=g)
    ok = True
    for out, codes, mins in ((q4_product(x, q4_records(q4, d, m), 24), q4, m),
                             (q8_product(x, q8_records(q8, d), 24), q8, torch.zeros_like(m))):
        w = codes.view(24, 2, BLOCK).double() * d.double()[..., None] + mins.double()[..., None]
        want = x.double() @ w.view(24, 64).t()
        ok = ok and bool(((out.double() - want).abs() <= 2 ** -7 * want.abs() + 1e-6).all())
    return ok


def register_shapes(namespace: str = "triforce_stored") -> None:
    """What the ops return, for torch.compile's tracing (which runs no kernel)."""
    for op in ("q4_product", "q8_product"):
        @torch.library.register_fake(f"{namespace}::{op}")
        def _(x, records, out_features):
            return x.new_empty(x.shape[0], out_features)


def _q4_avx512(x, records, out_features):
    return torch.ops.triforce_stored.q4_product(x, records, out_features)


def _q8_avx512(x, records, out_features):
    return torch.ops.triforce_stored.q8_product(x, records, out_features)


def q4_product(x: torch.Tensor, records: torch.Tensor, out_features: int) -> torch.Tensor:
    """x (R, K) bf16 . W^T for W = d * q + m as Q4 records -> (R, out_features) bf16 (through AMX
    tiles where the CPU has them: every row count takes one path, stored_amx's docstring says why)."""
    if stored_amx.available():
        return torch.ops.triforce_stored_amx.q4_product(x, records, out_features)
    return _q4_avx512(x, records, out_features)


def q8_product(x: torch.Tensor, records: torch.Tensor, out_features: int) -> torch.Tensor:
    """x (R, K) bf16 . W^T for W = d * q as Q8 records -> (R, out_features) bf16 (as q4_product)."""
    if stored_amx.available():
        return torch.ops.triforce_stored_amx.q8_product(x, records, out_features)
    return _q8_avx512(x, records, out_features)


# --- the records (layout in the module docstring) ----------------------------------------------------

def _groups(t: torch.Tensor) -> torch.Tensor:
    """(N, ...) -> (N padded to 16, ...) with zero rows: a last partial group computes zeros."""
    pad = -t.shape[0] % LANES
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


def _scale_bytes(scales: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """Scales (N, B) as (G, B, 16 * size) bytes of `dtype`: float16 for the GGUF's own f16 d and m
    (half the bytes; they must be f16 values), float32 for Q4_K's d * sc and dmin * m."""
    out = []
    for s in scales:
        if dtype == torch.float16 and s.device.type != "meta" and not torch.equal(s.half().float(), s.float()):
            raise ValueError("float16 records need scales that are float16 values")
        s = _groups(s.float()).to(dtype)
        g = s.shape[0] // LANES
        out.append(s.view(g, LANES, -1).transpose(1, 2).contiguous().view(torch.uint8).view(g, s.shape[1], -1))
    return out


def _shape_only(q: torch.Tensor, record_bytes: int) -> torch.Tensor:
    """The records' shape for codes q (N, K) on meta (stored.shape_only)."""
    return torch.empty((-(-q.shape[0] // LANES), q.shape[1] // BLOCK, record_bytes), dtype=torch.uint8, device="meta")


def q4_records(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, scale_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Codes q (N, K) in [0, 15], d and m (N, K / 32) -> Q4 records (G, K / 32, 320 or 384) uint8."""
    if q.is_meta:  # stored.shape_only
        return _shape_only(q, 256 + 2 * LANES * scale_dtype.itemsize)
    q = _groups(q.to(torch.int64))  # shifts past bit 31 below: no overflow
    g, blocks = q.shape[0] // LANES, q.shape[1] // BLOCK
    # column 8c + 2k + e of a block goes to vector c, bit 4k + 16e of its lane's word
    shifts = 4 * torch.arange(4, device=q.device)[:, None] + 16 * torch.arange(2, device=q.device)[None, :]
    words = (q.view(g, LANES, blocks, 4, 4, 2) << shifts).sum((-1, -2)).to(torch.uint32)
    codes = words.permute(0, 2, 3, 1).contiguous().view(torch.uint8).view(g, blocks, 256)
    d_bytes, m_bytes = _scale_bytes([d, m], scale_dtype)
    return torch.cat([codes, d_bytes, m_bytes], dim=-1).contiguous()


def q8_records(q: torch.Tensor, d: torch.Tensor, scale_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Codes q (N, K) in [-128, 127], d (N, K / 32) -> Q8 records (G, K / 32, 544 or 576) uint8."""
    if q.is_meta:  # stored.shape_only
        return _shape_only(q, 512 + LANES * scale_dtype.itemsize)
    q = _groups(q.to(torch.int8))
    g, blocks = q.shape[0] // LANES, q.shape[1] // BLOCK
    # columns 4c + (0, 2, 1, 3) of a block are the bytes of vector c's lane word
    words = q.view(g, LANES, blocks, 8, 4)[..., [0, 2, 1, 3]]
    codes = words.permute(0, 2, 3, 1, 4).contiguous().view(torch.uint8).view(g, blocks, 512)
    (d_bytes,) = _scale_bytes([d], scale_dtype)
    return torch.cat([codes, d_bytes], dim=-1).contiguous()


def serves(x: torch.Tensor) -> bool:
    """Whether these kernels take this input: bfloat16 on CPU, a few rows, the kernels built."""
    return (x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.numel() <= MAX_ROWS * x.shape[-1]
            and available())
