"""bfloat16 products on stored blocks through stored_bf16's records kernels: each output is the float64
product with the GGUF's dequantized weights but for float32 sums and one rounding to bfloat16, every
weight reads back exactly, and PackedLinear takes the kernels for few bf16 rows (compiled too). Each
test runs over the avx512 kernels and, on a CPU with AMX, over stored_amx's tile kernels, which
every product takes there."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from triforce.model import cpu_kernels, stored_amx, stored_bf16
from triforce.model.gguf_blocks import Blocks
from triforce.model.stored import concat_blocks, packed_from_blocks

from .test_stored import random_blocks

needs_kernels = pytest.mark.skipif(not stored_bf16.available(),
                                   reason="no avx512_bf16 or no C++ compiler: the int4 kernel serves")
BF16_UNIT_ROUNDOFF = 2 ** -8  # relative: one rounding to nearest bfloat16 (8 significant bits)
F32_EPS = 2 ** -24


@pytest.fixture(params=["avx512", "amx"], autouse=True)
def kernels(request, monkeypatch):
    """The products through the avx512 kernels, or through AMX tiles (where the CPU has them)."""
    if request.param == "amx" and not stored_amx.available():
        pytest.skip("no AMX here (or TRIFORCE_AMX=0): the avx512 kernels serve every product")
    if request.param == "avx512":
        monkeypatch.setattr(stored_amx, "available", lambda: False)
    return request.param


def product_error_ok(got: torch.Tensor, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per output: within one bf16 rounding of the float64 product plus a float32 summation error
    bound (K roundings of at most the sum of |x w|), the tolerance of any float32-accumulating GEMM."""
    want = x.double() @ weights.t()
    magnitude = x.double().abs() @ weights.abs().t()
    bound = BF16_UNIT_ROUNDOFF * want.abs() * (1 + 1e-6) + x.shape[1] * F32_EPS * magnitude
    return (got.double() - want).abs() <= bound


def blocks_of(kind: str, rows: int, cols: int, seed: int) -> Blocks:
    if "+" in kind:  # a fused projection of two signed kinds (Qwen2.5-0.5B's q, k Q5_0 and v Q8_0)
        return concat_blocks([random_blocks(part, rows // 2, cols, seed + i) for i, part in enumerate(kind.split("+"))])
    return random_blocks(kind, rows, cols, seed)


@needs_kernels
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q5_0+Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 37])
@pytest.mark.parametrize("shape", [(40, 96), (64, 512), (16, 1536)])  # 40: a partial group of 16
def test_kernel_is_the_float64_dequantized_product(kind, rows, shape):
    n, k = shape
    if kind == "Q4_K" and k % 256:
        k = 512
    blocks = blocks_of(kind, n, k, seed=rows + n)
    layer = packed_from_blocks(blocks, torch.bfloat16)
    assert layer.block_kernel == ("q4" if kind in ("Q4_1", "Q4_K") else "q8")
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k + rows)).bfloat16()
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    assert product_error_ok(got, x, blocks.dequantize()).all()


@needs_kernels
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q4_K"])
def test_a_row_of_a_batch_is_that_row_alone(kind):
    """A verification pass of R tokens computes each row as a one-token pass does, bit for bit (each
    row's sums run in one order whatever rows share the call): greedy verification cannot flip a
    near-tie that plain decoding resolves the other way. Over 8,192 x 9 outputs of 2,048 columns, two
    chains of sums at 2-4 rows (against four for one) changed a few of them."""
    k = 2048
    layer = packed_from_blocks(blocks_of(kind, 8192, k, seed=3), torch.bfloat16)
    x = (torch.randn(9, k, generator=torch.Generator().manual_seed(2)) * 2).bfloat16()
    alone = torch.cat([layer(x[r:r + 1]) for r in range(9)])
    for rows in (2, 3, 4, 5, 7, 9):
        assert torch.equal(layer(x[:rows]), alone[:rows]), rows


@needs_kernels
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_rows_past_a_tile_are_each_row_alone(kind):
    """AMX takes rows 16 at a time (a tile): the rows of a second and third tile, a partial one
    last, are still each row's own one-row product; so are the avx512 kernels' groups of 4."""
    k = 256
    layer = packed_from_blocks(blocks_of(kind, 104, k, seed=5), torch.bfloat16)  # 7 groups: sets of 2 and 3 with a partial
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(6)).bfloat16()
    alone = torch.cat([layer(x[r:r + 1]) for r in range(40)])
    for rows in (16, 17, 33, 40):
        assert torch.equal(layer(x[:rows]), alone[:rows]), rows


@needs_kernels
def test_kernel_is_closer_to_the_gguf_model_than_the_int4_kernel():
    """The int4 kernel takes bf16 scales and zeros (each weight off by up to a bf16 rounding); the
    records hold the GGUF's own: the float32-sum bound holds here and fails there."""
    blocks = random_blocks("Q4_1", 256, 576, seed=7)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(8)).bfloat16()
    assert product_error_ok(packed_from_blocks(blocks, torch.bfloat16)(x), x, blocks.dequantize()).all()
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(blocks.q.to(torch.int32), 1)
    scales_and_zeros = torch.stack([blocks.d.t(), (blocks.m + 8 * blocks.d).t()], dim=-1).bfloat16().contiguous()
    int4 = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales_and_zeros)
    assert not product_error_ok(int4, x, blocks.dequantize()).all()


@needs_kernels
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q4_K"])
def test_one_hot_rows_read_every_weight_back(kind):
    """x = e_k reads column k: d * q (+ m) once rounded to float32, then to bf16: the float32
    dequantized weight rounded to bf16, exactly. Every column of a partial group: a code or scale
    in the wrong place of the records shows here."""
    cols = 512 if kind == "Q4_K" else 96
    blocks = random_blocks(kind, 40, cols, seed=3)
    layer = packed_from_blocks(blocks, torch.bfloat16)
    eye = torch.eye(cols, dtype=torch.bfloat16)
    read = torch.cat([layer(eye[c:c + 16]) for c in range(0, cols, 16)])
    assert torch.equal(read.t(), blocks.dequantize(torch.float32).bfloat16())


@needs_kernels
def test_many_rows_and_other_dtypes_keep_the_dense_product():
    blocks = random_blocks("Q4_1", 48, 96, seed=4)
    layer = packed_from_blocks(blocks, torch.bfloat16)
    x = torch.randn(stored_bf16.MAX_ROWS + 1, 96).bfloat16()
    assert not stored_bf16.serves(x) and stored_bf16.serves(x[:stored_bf16.MAX_ROWS])
    assert torch.equal(layer(x), F.linear(x, layer.dequantized(torch.bfloat16)))
    assert not stored_bf16.serves(x[:1].float())


@needs_kernels
def test_compiled_layer_calls_the_kernel_and_gives_the_eager_result():
    blocks = random_blocks("Q8_0", 48, 96, seed=5)
    layer = packed_from_blocks(blocks, torch.bfloat16, bias=torch.randn(48))
    x = torch.randn(3, 96).bfloat16()
    compiled = cpu_kernels.compile(layer, fullgraph=True)
    assert torch.equal(compiled(x), layer(x))


def test_float16_records_refuse_scales_that_are_not_float16():
    q, d = torch.zeros(16, 32, dtype=torch.uint8), torch.full((16, 1), 1 + 2 ** -20)
    with pytest.raises(ValueError):
        stored_bf16.q4_records(q, d, d)
    assert stored_bf16.q4_records(q, d, d, torch.float32).shape == (1, 1, 384)


def test_kernels_build_where_the_cpu_has_avx512_bf16():
    """Where they can build they must build and pass their own check: a kernel that computes wrongly
    would otherwise turn into a silent fallback to the int4 kernel (and the tests above into skips)."""
    if not cpu_kernels.cpu_has() or shutil.which("c++") is None:
        pytest.skip("no avx512_bf16 or no C++ compiler")
    assert stored_bf16.available()


def test_amx_kernels_build_where_the_cpu_has_amx(kernels, monkeypatch):
    """The same for AMX: a CPU with its tiles and a compiler must get them (Linux lends the tiles)."""
    if kernels == "amx":
        pytest.skip("checked once, with the real `available` (the avx512 parameter's, restored)")
    monkeypatch.undo()
    if (not cpu_kernels.cpu_has(stored_amx.AMX) or shutil.which("c++") is None
            or os.environ.get("TRIFORCE_AMX") == "0"):
        pytest.skip("no AMX, no C++ compiler, or TRIFORCE_AMX=0")
    assert stored_amx.available()
