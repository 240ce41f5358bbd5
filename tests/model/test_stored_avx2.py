"""float32 products on stored blocks through stored_avx2's kernels (the avx2-only CPU's path): each
output is the float64 product with the GGUF's dequantized weights but for float32 sums, a row of a
batch is that row alone bit for bit, every weight reads back exactly, and PackedLinear takes the
kernels for float32 rows (compiled too)."""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from triforce.model import cpu_kernels, stored_avx2
from triforce.model.gguf_blocks import Blocks
from triforce.model.stored import packed_from_blocks

from .test_stored import random_q4_k
from .test_stored_bf16 import blocks_of

needs_kernels = pytest.mark.skipif(not stored_avx2.available(), reason="no avx2/FMA/F16C or no C++ compiler")
needs_avx512 = pytest.mark.skipif(not (stored_avx2.available() and cpu_kernels.cpu_has(cpu_kernels.AVX512F)),
                                  reason="no avx512f, or the kernels do not build")
F32_EPS = 2 ** -24


def float32_sum_ok(got: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, bias=None) -> torch.Tensor:
    """Per output: within a float32 summation error bound of the float64 product (K + 2 roundings of
    at most the sum of |x w|, the tolerance of any float32-accumulating GEMM)."""
    want = F.linear(x.double(), weights, None if bias is None else bias.double())
    magnitude = x.double().abs() @ weights.abs().t() + (0 if bias is None else bias.double().abs())
    return (got.double() - want).abs() <= (x.shape[1] + 2) * F32_EPS * magnitude


@needs_kernels
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q5_0+Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 37])
@pytest.mark.parametrize("shape", [(40, 96), (64, 512), (16, 1536)])  # 40: a partial group of 16
def test_kernel_is_the_float64_dequantized_product(kind, rows, shape):
    n, k = shape
    if kind == "Q4_K" and k % 256:
        k = 512
    blocks = blocks_of(kind, n, k, seed=rows + n)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1))
    layer = packed_from_blocks(blocks, torch.float32, bias)
    assert layer.block_kernel == ("q4" if kind in ("Q4_1", "Q4_K") else "q8") and not layer.compiled_f32
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k + rows))
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert float32_sum_ok(got, x, blocks.dequantize(), bias).all()


def kernel_code_fixture(module):
    """A fixture that runs a test through a float32 kernel module's avx2 code or its avx512f code
    (where the CPU has it; parametrized indirectly with the name), then puts back what the process runs."""
    @pytest.fixture
    def kernel_code(request):
        wide = request.param == "avx512"
        if wide and not (module.available() and cpu_kernels.cpu_has(cpu_kernels.AVX512F)):
            pytest.skip("no avx512f, or the kernels do not build")
        module.use_avx512(wide)
        yield request.param
        module.use_avx512(module.WIDE)
    return kernel_code


kernel_code = kernel_code_fixture(stored_avx2)


@needs_kernels
@pytest.mark.parametrize("kernel_code", ["avx2", "avx512"], indirect=True)
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q4_K"])
def test_a_row_of_a_batch_is_that_row_alone(kind, kernel_code):
    """A verification pass of R tokens computes each row as a one-token pass does, bit for bit (the
    sums run in one order whatever the number of rows): greedy verification cannot flip a near-tie
    that plain decoding resolves the other way."""
    k = 512
    layer = packed_from_blocks(blocks_of(kind, 40, k, seed=3), torch.float32)
    x = torch.randn(stored_avx2.MAX_ROWS, k, generator=torch.Generator().manual_seed(2))
    for rows in (2, 3, 4, 5, 7, 9, stored_avx2.MAX_ROWS):
        batch = layer(x[:rows])
        for r in range(rows):
            assert torch.equal(batch[r], layer(x[r:r + 1])[0]), (rows, r)


@needs_avx512
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q5_0+Q8_0"])
@pytest.mark.parametrize("shape", [(16, 96), (40, 96), (80, 512), (72, 1536)])  # 1, 3 (partial), 5 and 5 groups
def test_avx512_kernels_give_the_avx2_bits(kind, shape):
    """On a CPU with avx512f the products run 16 outputs a register, two groups at a time; each
    output's sum must still be the avx2 code's, bit for bit, at every row count and group count
    (a machine's tokens do not depend on which of the two ran, nor on TRIFORCE_AVX512)."""
    n, k = shape
    if kind == "Q4_K" and k % 256:
        k = 512
    layer = packed_from_blocks(blocks_of(kind, n, k, seed=n + k), torch.float32)
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(k))
    try:
        for rows in (1, 2, 3, 4, 5, 7, 8, 9, 37):
            stored_avx2.use_avx512(False)
            narrow = layer(x[:rows])
            stored_avx2.use_avx512(True)
            assert torch.equal(layer(x[:rows]), narrow), rows
    finally:
        stored_avx2.use_avx512(stored_avx2.WIDE)


def test_avx512_is_taken_where_the_cpu_has_it(monkeypatch):
    """WIDE follows the CPU's flags and TRIFORCE_AVX512."""
    for flags, env, want in ((frozenset({"avx2", "avx512f"}), None, True),
                             (frozenset({"avx2", "avx512f"}), "0", False),
                             (frozenset({"avx2"}), None, False)):
        monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda flags=flags: flags)
        if env is None:
            monkeypatch.delenv("TRIFORCE_AVX512", raising=False)
        else:
            monkeypatch.setenv("TRIFORCE_AVX512", env)
        assert cpu_kernels.wide_default() is want, (flags, env)


@needs_kernels
def test_every_q8_code_reads_back_exactly():
    """One-hot rows read single weights back: -128..127 at every column position of a block (a byte
    taken from the wrong place of its word, or a wrong sign, shows here)."""
    q = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8).view(8, 32)
    q = torch.cat([q, q.roll(5, dims=1), q.flip(1)])  # each code at several columns
    d = torch.full((24, 1), 0.5)
    layer = packed_from_blocks(Blocks("Q8_0", q, d, None), torch.float32)
    assert torch.equal(layer(torch.eye(32)).t(), q.float() * 0.5)
    assert torch.equal(layer.dequantized(torch.float32), q.float() * 0.5)


@needs_kernels
def test_q4_weights_read_back_exactly():
    """Q4_1 and Q4_K: one-hot rows through the kernel give d * q + m rounded once to float32, which
    is also the layer's dense float32 form (prefill pieces); both are the GGUF's weights rounded."""
    q4_1 = blocks_of("Q4_1", 24, 96, seed=8)
    parts, _ = random_q4_k(16, 256, seed=9)
    from triforce.model.gguf_blocks import decode_q4_k, encode_q4_k

    for blocks in (q4_1, decode_q4_k(encode_q4_k(**parts), 16, 256)):
        layer = packed_from_blocks(blocks, torch.float32)
        k = blocks.q.shape[1]
        weights = blocks.dequantize().float()  # float64 d * q + m, rounded once
        assert torch.equal(layer.dequantized(torch.float32), weights)
        for start in range(0, k, stored_avx2.MAX_ROWS):
            eye = torch.eye(k)[start:start + stored_avx2.MAX_ROWS]
            assert torch.equal(layer(eye).t(), weights[:, start:start + eye.shape[0]])


@needs_kernels
def test_no_rows_give_no_outputs():
    layer = packed_from_blocks(blocks_of("Q4_1", 40, 96, seed=4), torch.float32)
    assert layer(torch.zeros(0, 96)).shape == (0, 40)


@needs_kernels
def test_many_rows_take_the_dense_weights():
    blocks = blocks_of("Q4_1", 40, 96, seed=4)
    layer = packed_from_blocks(blocks, torch.float32)
    x = torch.randn(stored_avx2.MAX_ROWS + 3, 96, generator=torch.Generator().manual_seed(5))
    assert not stored_avx2.serves(x)
    assert float32_sum_ok(layer(x), x, blocks.dequantize()).all()


@needs_kernels
def test_compiled_pass_calls_the_kernel():
    """torch.compile (fullgraph) traces through the op (its fake shape registered): same output."""
    layer = packed_from_blocks(blocks_of("Q8_0", 40, 96, seed=6), torch.float32)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(7))
    compiled = cpu_kernels.compile(layer, fullgraph=True)
    assert torch.equal(compiled(x), layer(x))


def test_kernels_build_where_the_cpu_has_avx2():
    """Where they can build they must build and pass their own check: a kernel that computed wrongly
    would otherwise turn into a silent fallback (and the tests above into skips)."""
    if not cpu_kernels.cpu_has(cpu_kernels.AVX2) or shutil.which("c++") is None:
        pytest.skip("no avx2/FMA/F16C or no C++ compiler")
    assert stored_avx2.available()


@needs_kernels
def test_float32_auto_takes_the_stored_weights_without_timing(monkeypatch):
    """`--weights auto` in float32 is stored wherever these kernels build: no timing that a busy
    machine could flip (the compiled product, timed, is never asked)."""
    from triforce.model import gguf_loader, stored_f32

    monkeypatch.setattr(stored_f32, "available", lambda: pytest.fail("timed the compiled route"))
    gguf_loader.stored_kernel_pays.cache_clear()
    try:
        assert gguf_loader.stored_kernel_pays(torch.float32) is True
    finally:
        gguf_loader.stored_kernel_pays.cache_clear()
