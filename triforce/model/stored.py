"""Compute with a GGUF's weights as stored: 4- and 8-bit blocks, dequantized inside torch's packed
int4 matmul (`_weight_int4pack_mm_for_cpu`), so a one-token pass reads ~4.5 bits per weight where a
dequantized float32 folder reads 32.

The kernel computes with groups of 32 weights along K, each w = (code - 8) * scale + zero, code in
[0, 15] (checked against float64 in tests/model/test_stored.py). GGUF types map onto it exactly:

    Q4_1  w = d * q + m            -> code q, scale d, zero m + 8d
    Q4_K  w = d * sc_s * q - dmin * m_s, per 32-weight sub-block s -> Q4_1's form with d_s = d * sc_s
          and m_s = -dmin * m_s (gguf_blocks.decode_q4_k): code q, scale d * sc_s, zero
          8 * d * sc_s - dmin * m_s. Scale and both terms of the zero are exact in float32 (an f16 times
          a 6-bit integer); the zero's difference was exact in every sub-block of Qwen2.5-Coder-1.5B's
          Q4_K tensors checked (docs/results/2026-11-23-cpu-bytes.md). Q6_K cannot map: its scales
          change every 16 weights and the kernel's smallest group is 32.
    Q8_0  w = d * q, q in [-128,127] -> q = 16 * hi + lo with hi in [-8, 7], lo in [0, 15]: two int4
          matrices side by side along K, [hi + 8 | lo] with scales [16d | d] and zeros [0 | 8d], and
          the input repeated, [x | x]. Every partial weight is a small integer times d: exact.
    Q5_0  w = d * (q - 16), q in [0, 31] -> decoded to Q8_0's form (int8 q - 16, d), packed as Q8_0:
          8 bits a weight read (the high half holds one bit), half of bfloat16's 16.

With float32 scales (f16 d and m widen exactly) this is the GGUF's model to float accumulation order;
with bfloat16 activations the kernel also takes bfloat16 scales, the same rounding a bf16 folder
applies to each weight. torch's fast path is the bf16 one (on avx512_bf16, 1 thread: 0.77 ms for
SmolLM2's 49152x576 head against 2.6 ms dense bf16; the float32 path is a slow reference, 42 ms
against 9 ms dense float32), so `resolve_weights` measures before choosing it. Float32 layers
therefore compute through stored_avx2's kernels over block records (avx2, FMA, F16C: 1.09 ms for that
head at one row, one thread, against 6.3 dense float32; rows of a pass sum in one order, and torch's
threads share the work), else stored_f32's compiled product over the same codes and float32 scales
where it builds (2.4 ms for that head with torch's avx2 code), the int4 reference path only where
neither does.

bfloat16 rows (up to 256) on a CPU with avx512_bf16 take stored_bf16's kernels instead of the int4
kernel: the GGUF's own f16 scales (not bf16-rounded ones), read at memory speed (that head 0.49 ms
against 1.56 through the int4 kernel, one thread); the int4 buffers are then not built. Both record
kernels read the same records (stored_bf16's layout).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import stored_avx2, stored_bf16, stored_f32
from .gguf_blocks import BLOCK, FORMS, Blocks

# Above this many rows (prefill, window refills) the weights are dequantized for one dense GEMM:
# the packed kernel is a matrix-vector product per row (bf16, 1 thread, 3072x576: 0.05 ms for 1 row,
# 1.36 ms for 64 against 0.53 dense).
PACKED_KERNEL_MAX_ROWS = 16
# float32's compiled product (stored_f32) runs one row at a time, each reading the codes again: past
# this many rows dequantizing once is cheaper (SmolLM2's 121 matrices, one thread: 1 row 20 ms
# against 156 dense, 16 rows 282 against 200, 64 rows 1,120 against 319)
F32_ROWS_MAX = 8
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KERNEL_ROW_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu wants N divisible by 16


def _int4_kernels_available() -> bool:
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")


class PackedLinear(nn.Module):
    """y = x W^T + b with W in int4 groups of 32 (code, scale, zero), as the GGUF stores it.

    `repeat` is how many times x is laid side by side along K (2 for Q8_0's hi/lo halves).
    `records` (stored_bf16's block layout, "q4" or "q8") replace the int4 kernel for bf16 rows."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, repeat: int,
                 dtype: torch.dtype, bias: torch.Tensor | None = None, kind: str = "Q4_1",
                 records: tuple[str, torch.Tensor] | None = None):
        super().__init__()
        self.block_kernel = None if records is None else records[0]
        if records is not None:
            self.register_buffer("block_records", records[1])
        self.kind, self.repeat = kind, repeat
        self.out_features, self.packed_k = codes.shape
        self.in_features = self.packed_k // repeat
        self.stored_bytes = 0  # set by the loader: the GGUF bytes of this matrix
        # our own nibble pairs, for dequantizing (the kernel's packed layout is its own business)
        pairs = codes.to(torch.uint8).view(self.out_features, -1, 2)
        self.register_buffer("codes", shape_only(pairs.shape[:2], torch.uint8) if codes.is_meta
                             else pairs[..., 0] | (pairs[..., 1] << 4))
        self.register_buffer("scales", scales.float().contiguous())  # (N, K' / 32), exact f16 values
        self.register_buffer("zeros", zeros.float().contiguous())
        self.kernel_dtype = dtype if dtype in KERNEL_DTYPES and _int4_kernels_available() else None
        # float32 without the records' avx2 kernels: the compiled one-row product (stored_f32), where
        # it builds; torch's float32 int4 path is a slow reference
        self.compiled_f32 = dtype == torch.float32 and records is None and stored_f32.available()
        if self.compiled_f32 or self.block_kernel is not None:
            self.kernel_dtype = None
        if self.kernel_dtype is not None and codes.is_meta:  # shape_only: the packed state's shapes alone
            rows = self.out_features - self.out_features % -KERNEL_ROW_MULTIPLE
            self.register_buffer("packed", shape_only((rows, self.packed_k // 2), torch.uint8))
            self.register_buffer("scales_and_zeros", shape_only((scales.shape[1], rows, 2), dtype))
        elif self.kernel_dtype is not None:
            # the kernel packs rows 16 at a time: pad with zero weights (scale 0, zero 0), cut after
            pad = -self.out_features % KERNEL_ROW_MULTIPLE
            codes, scales, zeros = (F.pad(t, (0, 0, 0, pad)) for t in (codes.to(torch.int32), scales, zeros))
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
            # (K' / 32, N, 2): the kernel's scales_and_zeros, in the activations' dtype
            self.register_buffer("scales_and_zeros", torch.stack([scales.t(), zeros.t()], dim=-1)
                                 .to(dtype).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.dim() == 2  # the model's (tokens, features): no reshapes, each an op an eager layer pays 4 times
        rows = x if flat else x.reshape(-1, x.shape[-1])
        kernels = self._records_kernels(rows)
        if kernels is not None:
            product = kernels.q4_product if self.block_kernel == "q4" else kernels.q8_product
            out = product(rows, self.block_records, self.out_features)
            if self.bias is not None:
                out = out + self.bias
            return out if flat else out.reshape(*x.shape[:-1], self.out_features)
        if self.compiled_f32 and x.dtype == torch.float32 and rows.shape[0] <= F32_ROWS_MAX and x.device.type == "cpu":
            out = stored_f32.rows_product(torch.cat([rows] * self.repeat, dim=-1), self.codes, self.scales, self.zeros)
            if self.bias is not None:
                out = out + self.bias
            return out.reshape(*x.shape[:-1], self.out_features)
        if rows.shape[0] > PACKED_KERNEL_MAX_ROWS or x.dtype != self.kernel_dtype or not x.device.type == "cpu":
            return F.linear(x, self.dequantized(x.dtype), self.bias)
        if self.repeat > 1:
            rows = torch.cat([rows] * self.repeat, dim=-1)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows.contiguous(), self.packed, BLOCK, self.scales_and_zeros)
        out = out[:, :self.out_features]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def rows_step(self, like: torch.Tensor):
        """forward for eager passes of rows like `like` (T, any), the records' kernel chosen now
        (model/eager_steps.py): the same product and bias add as forward takes for 2-D rows."""
        kernels = self._records_kernels(like.new_empty(like.shape[0], self.in_features))
        if kernels is None:
            return self.forward
        product = kernels.q4_product if self.block_kernel == "q4" else kernels.q8_product
        records, n, bias = self.block_records, self.out_features, self.bias
        if bias is None:
            return lambda x: product(x, records, n)
        return lambda x: product(x, records, n) + bias

    def product_op(self, like: torch.Tensor) -> str | None:
        """The qualified name of the one torch op rows_step's product calls for rows like `like` (T,
        any), which model/fused_layers.py calls by name; None where it is not one op (bf16 chooses
        AMX tiles per call; no records)."""
        if self._records_kernels(like.new_empty(like.shape[0], self.in_features)) is not stored_avx2:
            return None
        return f"triforce_stored_f32::{self.block_kernel}_product"

    def _records_kernels(self, rows: torch.Tensor):
        """The module whose kernels take these rows over the records (stored_bf16 for bfloat16,
        stored_avx2 for float32), or None."""
        if self.block_kernel is None:
            return None
        if stored_bf16.serves(rows):
            return stored_bf16
        return stored_avx2 if stored_avx2.serves(rows) else None

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """W (N, K) in `dtype`: (code - 8) * scale + zero per group in float32 (float64 for float64),
        the hi/lo halves of Q8_0 summed (exact: both are small integers times d); float32 from the
        records d * q + m in one rounding, where the avx2 kernels built them."""
        if self.block_kernel is not None and dtype == torch.float32 and stored_avx2.available():
            dense = stored_avx2.q4_dense if self.block_kernel == "q4" else stored_avx2.q8_dense
            return dense(self.block_records, self.out_features)
        if self.compiled_f32 and dtype == torch.float32:
            return stored_f32.dense_weights(self.codes, self.scales, self.zeros, self.repeat)
        exact = torch.float64 if dtype == torch.float64 else torch.float32
        codes = torch.stack([self.codes & 15, self.codes >> 4], dim=-1).view(self.out_features, -1, BLOCK)
        w = (codes.to(exact) - 8) * self.scales.to(exact)[..., None] + self.zeros.to(exact)[..., None]
        w = w.view(self.out_features, self.repeat, self.in_features).sum(dim=1)
        return w.to(dtype)

    def bytes_per_row_pass(self) -> int:
        """Bytes of weights a pass of a few rows reads: the codes, scales and zeros."""
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        if self.block_kernel is not None:
            return self.block_records.numel() + bias
        elem = self.scales_and_zeros.element_size() if self.kernel_dtype is not None else 4
        return self.codes.numel() + 2 * self.scales.numel() * elem + bias

    def extra_repr(self) -> str:
        kernel = ("compiled float32" if self.compiled_f32 else
                  f"{self.block_kernel} records" if self.block_kernel else self.kernel_dtype)
        return f"{self.kind}, in={self.in_features}, out={self.out_features}, kernel={kernel}"


def packed_from_blocks(blocks: Blocks, dtype: torch.dtype, bias: torch.Tensor | None = None) -> PackedLinear:
    """The exact int4-group form of a matrix of a stored type, or a stack of one form (module docstring)."""
    forms = {FORMS.get(kind) for kind in blocks.kind.split("+")}
    records = block_records(blocks, forms) if records_route(dtype) else None
    if forms == {"affine"}:  # Q4_K arrives decoded into Q4_1's per-32 form
        zeros = blocks.m if blocks.m.is_meta else blocks.m + 8 * blocks.d  # shape_only: the same shape
        layer = PackedLinear(blocks.q, blocks.d, zeros, 1, dtype, bias, blocks.kind, records)
    elif (forms == {"signed"} and dtype == torch.float32 and records is None and stored_f32.available()
          and stored_f32.bytes_pay()):
        layer = ByteCodesLinear(blocks.q, blocks.d, bias, blocks.kind)
    elif forms == {"signed"} and blocks.q.is_meta:  # shape_only
        codes, scales = _cat([blocks.q.to(torch.int16)] * 2, dim=1), _cat([blocks.d] * 2, dim=1)
        layer = PackedLinear(codes, scales, scales, 2, dtype, bias, blocks.kind, records)
    elif forms == {"signed"}:  # Q5_0 arrives decoded into Q8_0's form
        q = blocks.q.to(torch.int16)
        hi, lo = (q >> 4) + 8, q & 15  # arithmetic shift: q = 16 * (hi - 8) + lo
        codes = torch.cat([hi, lo], dim=1)
        layer = PackedLinear(codes, torch.cat([16 * blocks.d, blocks.d], dim=1),
                             torch.cat([torch.zeros_like(blocks.d), 8 * blocks.d], dim=1), 2, dtype, bias,
                             blocks.kind, records)
    else:
        raise ValueError(f"no packed form for {blocks.kind}")
    layer.stored_bytes = blocks.stored_bytes
    return layer


def records_route(dtype: torch.dtype) -> bool:
    """Whether layers in `dtype` compute over block records: stored_bf16's kernels for bfloat16
    (avx512_bf16), stored_avx2's for float32 (avx2, FMA, F16C)."""
    if dtype == torch.bfloat16:
        return stored_bf16.available()
    return dtype == torch.float32 and stored_avx2.available()


def block_records(blocks: Blocks, forms: set) -> tuple[str, torch.Tensor] | None:
    """stored_bf16's records of a matrix: affine codes (Q4_1, Q4_K) as "q4", signed ones (Q8_0, Q5_0)
    as "q8" (Q5_0's 5-bit codes take 8 bits there, as in the int4 kernel's two halves). Scales are
    the GGUF's f16 values, but Q4_K's per-32 products d * sc, dmin * m, which take float32."""
    scale_dtype = torch.float32 if "Q4_K" in blocks.kind else torch.float16
    if forms == {"affine"}:
        return "q4", stored_bf16.q4_records(blocks.q, blocks.d, blocks.m, scale_dtype)
    if forms == {"signed"}:
        return "q8", stored_bf16.q8_records(blocks.q, blocks.d, scale_dtype)
    return None


class ByteCodesLinear(PackedLinear):
    """Float32 through the compiled product: Q8_0 and Q5_0 as bytes q + 128 with d per 32, not the
    kernel's two int4 halves (the same 8 bits a weight; half the work: SmolLM2's Q8_0 head 2.1 ms
    against 5.1 as halves and 5.6 dense float32, avx2)."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None, kind: str):
        nn.Module.__init__(self)
        self.kind, self.repeat, self.kernel_dtype, self.compiled_f32 = kind, 1, None, True
        self.block_kernel = None
        self.out_features, self.in_features = q.shape
        self.packed_k, self.stored_bytes = self.in_features, 0
        self.register_buffer("offset_codes", shape_only(q.shape, torch.uint8) if q.is_meta
                             else (q.to(torch.int16) + 128).to(torch.uint8))
        self.register_buffer("scales", d.float().contiguous())  # (N, K / 32): exact f16 values
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] > PACKED_KERNEL_MAX_ROWS or x.dtype != torch.float32 or x.device.type != "cpu":
            return F.linear(x, self.dequantized(x.dtype), self.bias)
        out = stored_f32.byte_rows_product(rows, self.offset_codes, self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype == torch.float32:
            return stored_f32.byte_dense_weights(self.offset_codes, self.scales)
        exact = torch.float64 if dtype == torch.float64 else torch.float32
        w = (self.offset_codes.to(exact) - 128).view(self.out_features, -1, BLOCK) * self.scales.to(exact)[..., None]
        return w.view(self.out_features, self.in_features).to(dtype)

    def bytes_per_row_pass(self) -> int:
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.offset_codes.numel() + self.scales.numel() * 4 + bias


def concat_blocks(parts: list[Blocks]) -> Blocks:
    """Matrices of one form stacked along rows (q, k, v into wqkv): rows keep their own scales."""
    kinds = sorted({p.kind for p in parts})
    if len({FORMS[k] for k in kinds}) != 1:
        raise ValueError(f"cannot stack {' and '.join(kinds)}: their packed forms differ")
    m = None if parts[0].m is None else _cat([p.m for p in parts])
    return Blocks("+".join(kinds), _cat([p.q for p in parts]), _cat([p.d for p in parts]), m,
                  nbytes=sum(p.stored_bytes for p in parts))


def shape_only(shape, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of a cached model's skeleton, the modules' shapes built on meta for its packed state
    to fill (gguf_loader, stored_cache). The packing steps make these without computing on meta:
    torch's meta ops for them (even an addition) run through its refs, which import torch._dynamo,
    a second of every run's start."""
    return torch.empty(shape, dtype=dtype, device="meta")


def _cat(tensors: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """torch.cat; of meta tensors (shape_only) the shape alone."""
    if not tensors[0].is_meta:
        return torch.cat(tensors, dim=dim)
    shape = list(tensors[0].shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    return shape_only(shape, tensors[0].dtype)


class StackedOutputs(nn.Module):
    """One fused projection whose parts are computed each its own way, packed or dense, their outputs
    side by side: Qwen2.5-Coder-1.5B's q, k are Q4_K (packed) where half its layers' v is Q6_K (dense)."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)
