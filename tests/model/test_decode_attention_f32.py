"""model/decode_attention_f32.py: float32 rows against a float16/bfloat16/float32 cache, the two
products against float64, and attention through them (eager, masked, compiled)."""
import shutil

import pytest
import torch

from triforce.model import attention, cpu_kernels
from triforce.model import decode_attention as bf16
from triforce.model import decode_attention_f32 as f32
from tests.model.test_attention import reference
from tests.model.test_stored_avx2 import kernel_code_fixture

needs_kernels = pytest.mark.skipif(not f32.available(), reason="no avx2/fma/f16c or no C++ compiler: attention keeps its GEMMs")
needs_bf16_kernels = pytest.mark.skipif(not bf16.available(), reason="no avx512_bf16 or no C++ compiler")

U = 2.0 ** -24  # float32's unit roundoff
# Each output is a float32 sum of exact products (widening 16-bit values is exact) in some order. Its
# error against float64, relative to the sum of the products' magnitudes, came to at most 4.1 U for
# random data (64-1000 terms; torch.bmm on the widened cache 4.8 U) and 8.6 U for softmax weights over
# 200 values (bmm 6.9 U): 16 U leaves room for the order of the sums, and a wrong term does not fit.
BOUND = 16 * U


def within_rounding(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
    """got ~ a @ b computed in float64, error relative to |a| @ |b|."""
    want = a.double() @ b.double()
    scale = a.double().abs() @ b.double().abs()
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.isfinite(got).all()
    ratio = ((got.double() - want).abs() / scale.clamp_min(1e-300)).max().item()
    assert ratio <= BOUND, ratio


@needs_kernels
@pytest.mark.parametrize("dtype", f32.CACHE_DTYPES)
@pytest.mark.parametrize("D", f32.HEAD_DIMS)
@pytest.mark.parametrize("S", [1, 7, 77, 1000])
@pytest.mark.parametrize("R", [1, 2, 3, 5, 9, 21, 42])
def test_products_equal_float64(R, S, D, dtype):
    g = torch.Generator().manual_seed(R * 10000 + S * 10 + D)
    H = 2
    rows = torch.randn(H, R, D, generator=g)
    keys = torch.randn(H, S, D, generator=g).to(dtype)
    values = torch.randn(H, S, D, generator=g).to(dtype)
    probs = torch.rand(H, R, S, generator=g)
    within_rounding(f32.scores(rows, keys), rows, keys.float().transpose(1, 2))
    within_rounding(f32.mix(probs, values), probs, values.float())


@needs_kernels
@pytest.mark.parametrize("D", f32.HEAD_DIMS)
@pytest.mark.parametrize("R", [1, 3, 12])
def test_long_heads_in_spans_over_threads(R, D):
    """Past 2,048 keys a head's keys go in spans shared by torch's threads (the values product adding
    its spans' sums): still the float64 product to rounding, and bit for bit the same on 1 thread
    as on 2 (the spans follow the keys alone), and with heads laid apart in a longer cache."""
    g = torch.Generator().manual_seed(R + D)
    S = 5000  # two full spans and a part one
    rows = torch.randn(3, R, D, generator=g)
    cache = torch.randn(2, 3, S + 100, D, generator=g).half()
    keys, values = cache[0, :, :S], cache[1, :, :S]
    probs = torch.softmax(torch.randn(3, R, S, generator=g), dim=-1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = f32.scores(rows, keys), f32.mix(probs, values)
        torch.set_num_threads(1)
        one = f32.scores(rows, keys), f32.mix(probs, values)
    finally:
        torch.set_num_threads(threads)
    within_rounding(two[0], rows, keys.float().transpose(1, 2))
    within_rounding(two[1], probs, values.float())
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


@needs_kernels
@pytest.mark.parametrize("dtype", f32.CACHE_DTYPES)
def test_a_strided_batch_of_heads_and_zero_weights(dtype):
    """Heads apart by more than their tokens (a layer of a preallocated cache, partly filled), and
    weights of 0 where softmax met -inf: the masked keys count for nothing."""
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(3, 300, 64, generator=g).to(dtype)
    keys, values = cache[:, :200], cache.flip(1)[:, :200].contiguous()
    rows = torch.randn(3, 6, 64, generator=g)
    scores = f32.scores(rows, keys)
    within_rounding(scores, rows, keys.float().transpose(1, 2))
    scores[..., 150:] = float("-inf")
    probs = torch.softmax(scores, dim=-1)
    assert (probs[..., 150:] == 0).all()
    out = f32.mix(probs, values)
    within_rounding(out, probs, values.float())
    within_rounding(out, probs[..., :150], values[:, :150].float())


@needs_kernels
def test_each_dim_and_key_lands_in_place():
    """One-hot weights and rows pick single values and keys: any permutation of dims or keys shows."""
    S, D = 77, 128
    values = torch.arange(S * D, dtype=torch.float32).reshape(1, S, D)
    for R in (1, 3, 9):
        probs = torch.zeros(1, R, S)
        picks = [(7 * r + 3) % S for r in range(R)]
        for r, s in enumerate(picks):
            probs[0, r, s] = 1
        assert torch.equal(f32.mix(probs, values)[0], values[0, picks])
        rows = torch.zeros(1, R, D)
        for r in range(R):
            rows[0, r, (5 * r) % D] = 1
        assert torch.equal(f32.scores(rows, values)[0], values[0, :, [(5 * r) % D for r in range(R)]].T)


def test_serves_float32_rows_on_cpu_only():
    rows = torch.zeros(3, 3, 64)
    cache = torch.zeros(3, 10, 64, dtype=torch.float16)
    assert f32.serves(rows, cache) == f32.available()
    assert not f32.serves(rows.bfloat16(), cache.bfloat16())
    assert not f32.serves(rows.double(), cache.double())
    assert not f32.serves(torch.zeros(3, 3, 48), torch.zeros(3, 10, 48, dtype=torch.float16))


def test_the_kernels_build_where_the_cpu_has_avx2_fma_f16c():
    """Where they can build they must build and pass their own check: a kernel that computes wrongly
    would otherwise turn into a silent fallback to the GEMMs (and the tests above into skips)."""
    from triforce.model.kv_dtype import cpu_flags

    if not {"avx2", "fma", "f16c"} <= cpu_flags() or shutil.which("c++") is None:
        pytest.skip("no avx2/fma/f16c or no C++ compiler")
    assert f32.available()


def attention_inputs(T, heads, D, dtype, S=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    Hq, Hkv = heads
    q = torch.randn(T, Hq, D, generator=g)
    keys = torch.randn(Hkv, S, D, generator=g).to(dtype)
    values = torch.randn(Hkv, S, D, generator=g).to(dtype)
    return q, keys, values


ATTENTION_TOLERANCE = 1e-5  # outputs of magnitude ~1: float32 sums of a few hundred terms


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("heads,D", [((9, 3), 64), ((12, 2), 128)])
def test_attend_through_the_kernels_equals_float64(T, heads, D, dtype, monkeypatch):
    q, keys, values = attention_inputs(T, heads, D, dtype, seed=T)
    calls = []
    kernel = f32.attend
    monkeypatch.setattr(f32, "attend", lambda rows, *args: calls.append(rows.shape) or kernel(rows, *args))
    got = attention.attend(q, keys, values)
    assert calls == [(heads[1], heads[0] // heads[1] * T, D)]  # every KV head in one call
    assert got.dtype == torch.float32
    assert (got.double() - reference(q, keys.float(), values.float())).abs().max().item() < ATTENTION_TOLERANCE


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 4])
def test_masked_attention_through_the_kernels_equals_float64(T, dtype, monkeypatch):
    """attend_masked (the static-shape path): the last T slots hold the new tokens, a causal mask."""
    q, keys, values = attention_inputs(T, (9, 3), 64, dtype, S=120, seed=10 + T)
    S = keys.shape[1]
    mask = torch.zeros(T, S).masked_fill_(torch.ones(T, S, dtype=torch.bool).tril(S - T).logical_not(), float("-inf"))
    calls = []
    kernel = f32.attend
    monkeypatch.setattr(f32, "attend", lambda rows, *args: calls.append(rows.shape) or kernel(rows, *args))
    got = attention.attend_masked(q, keys, values, mask, torch.arange(S - T + 1, S + 1))
    assert calls
    assert (got.double() - reference(q, keys.float(), values.float())).abs().max().item() < ATTENTION_TOLERANCE


@needs_kernels
def test_compiled_attention_calls_the_ops(monkeypatch):
    """torch.compile (fullgraph) traces through the ops by their registered shapes and runs them."""
    q, keys, values = attention_inputs(4, (9, 3), 64, torch.float16, S=100, seed=3)
    S = keys.shape[1]
    mask = torch.zeros(4, S).masked_fill_(torch.ones(4, S, dtype=torch.bool).tril(S - 4).logical_not(), float("-inf"))
    calls = []
    kernel = f32.attend
    monkeypatch.setattr(f32, "attend", lambda rows, *args: calls.append(rows.shape) or kernel(rows, *args))
    compiled = cpu_kernels.compile(attention.attend_masked, fullgraph=True, dynamic=False)
    # inductor's FX graph cache does not key on ATEN_CPU_CAPABILITY: a graph cached under avx2 (8-wide
    # loops) reloaded without it compiles with avx512's 16-wide vectors and stores past its buffers
    with torch._inductor.config.patch(fx_graph_cache=False):
        got = compiled(q, keys, values, mask, torch.arange(S - 3, S + 1))
    assert calls  # traced through the op
    assert (got.double() - reference(q, keys.float(), values.float())).abs().max().item() < ATTENTION_TOLERANCE


# ---------------------------------------------------------------- attention whole in one call (attend)

def attend_reference(rows, keys, values, limits, scale):
    """softmax(scale * rows . keys^T) . values in float64 under the prefix limits, and the same with
    every value's magnitude (what rounding errors scale with)."""
    T = limits.numel()
    token = torch.arange(rows.shape[1]) % T
    scores = rows.double() @ keys.double().transpose(1, 2) * scale
    hidden = torch.arange(keys.shape[1])[None, :] >= limits[token][:, None]
    probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
    return probs @ values.double(), probs @ values.double().abs()


# The error of attend's output against float64, relative to softmax . |values|: the scores' float32
# sums (a few U of sum |q k| each, moved into the weights by exp), exp's polynomial (about 1 U), the
# weights' and values' sums and the spans' merge. Measured at most 6.9 U over the cases below (S up to
# 5,000, 1-42 rows, every cache dtype), where torch's float32 softmax and bmm came to 8.4 U; 64 U
# leaves room for orders of summation, and a wrong or missing term (a weight off by 1/5,000) does not fit.
ATTEND_BOUND = 64 * U


def attend_inputs(H, R, S, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(H, R, D, generator=g)
    keys = torch.randn(H, S, D, generator=g).to(dtype)
    values = torch.randn(H, S, D, generator=g).to(dtype)
    return rows, keys, values


@needs_kernels
@pytest.mark.parametrize("dtype", f32.CACHE_DTYPES)
@pytest.mark.parametrize("D", f32.HEAD_DIMS)
@pytest.mark.parametrize("S", [1, 9, 77, 1000, 2051, 5000])
@pytest.mark.parametrize("rep,T", [(1, 1), (3, 1), (3, 4), (3, 7), (6, 7)])
def test_attend_equals_float64(rep, T, S, D, dtype):
    """Every token sees the keys up to its own (the last T are the new tokens); at 2,051 keys and 7
    tokens the earliest of them see nothing of the second span."""
    if T > S:
        pytest.skip("fewer keys than new tokens")
    rows, keys, values = attend_inputs(2, rep * T, S, D, dtype, seed=rep * 1000 + T * 100 + S + D)
    limits = torch.arange(S - T + 1, S + 1)
    got = f32.attend(rows, keys, values, limits, D ** -0.5)
    want, scale = attend_reference(rows, keys, values, limits, D ** -0.5)
    assert got.dtype == torch.float32 and got.shape == want.shape and torch.isfinite(got).all()
    ratio = ((got.double() - want).abs() / scale).max().item()
    assert ratio <= ATTEND_BOUND, ratio / U


@pytest.mark.parametrize("kernels,dtype", [*(pytest.param(f32, dtype, marks=needs_kernels) for dtype in f32.CACHE_DTYPES),
                                            pytest.param(bf16, torch.bfloat16, marks=needs_bf16_kernels)])
def test_attend_reads_nothing_past_the_limits(kernels, dtype):
    """A static view's layer: slots past each token's own hold stale keys and values (huge here) and
    must count for nothing; the output is bit for bit that of the cache cut at the limits. Float32
    rows over any cache dtype, and bf16 rows over a bf16 cache (decode_attention.attend)."""
    rows, keys, values = attend_inputs(3, 9, 6000, 64, dtype, seed=7)
    rows = rows.to(torch.bfloat16 if kernels is bf16 else torch.float32)
    keys[:, 4100:] = 300.0
    values[:, 4100:] = 1e4
    limits = torch.tensor([4098, 4099, 4100])  # 3 tokens, slots 4097-4099
    got = kernels.attend(rows, keys, values, limits, 0.125)
    cut = kernels.attend(rows, keys[:, :4100].contiguous(), values[:, :4100].contiguous(), limits, 0.125)
    assert torch.equal(got, cut) and got.abs().max() < 10


kernel_code = kernel_code_fixture(f32)
needs_avx512 = pytest.mark.skipif(not (f32.available() and cpu_kernels.cpu_has(cpu_kernels.AVX512F)),
                                  reason="no avx512f, or the kernels do not build")


@needs_avx512
@pytest.mark.parametrize("dtype", f32.CACHE_DTYPES)
@pytest.mark.parametrize("D", f32.HEAD_DIMS)
def test_avx512_code_gives_the_avx2_bits(D, dtype):
    """On a CPU with avx512f both products run two rows a register (scores) and 16 dims a register
    (mix); each output must still be the avx2 code's, bit for bit, at every row count (tiles of 6
    rows, pairs, an odd row) and key count (a part group of 8, a part block, several spans), and so
    must the whole attention (a machine's tokens do not depend on which code ran)."""
    g = torch.Generator().manual_seed(D)
    for S in (1, 7, 77, 1000, 2051):
        keys, values = (torch.randn(2, S, D, generator=g).to(dtype) for _ in range(2))
        for R in (*range(1, 15), 21, 23, 42):
            rows = torch.randn(2, R, D, generator=g)
            probs = torch.rand(2, R, S, generator=g)
            T = 3 if R % 3 == 0 and S >= 3 else 1  # 3 tokens: rows that see 1-2 keys fewer
            limits = torch.arange(S - T + 1, S + 1)
            try:
                f32.use_avx512(False)
                narrow = f32.scores(rows, keys), f32.mix(probs, values), f32.attend(rows, keys, values, limits, 0.125)
                f32.use_avx512(True)
                wide = f32.scores(rows, keys), f32.mix(probs, values), f32.attend(rows, keys, values, limits, 0.125)
            finally:
                f32.use_avx512(f32.WIDE)
            for name, a, b in zip(("scores", "mix", "attend"), narrow, wide):
                assert torch.equal(a, b), (name, S, R)


@needs_kernels
@pytest.mark.parametrize("kernel_code", ["avx2", "avx512"], indirect=True)
@pytest.mark.parametrize("rep,T", [(3, 4), (3, 7), (6, 7)])
def test_attend_gives_each_row_its_one_token_bits(rep, T, kernel_code):
    """A verification pass of T tokens gives each token exactly what a pass of that token alone gives
    (greedy speculative decoding equals plain decoding only if they agree bit for bit), and 1 and 2
    threads agree (the spans follow the keys alone)."""
    S = 5000
    rows, keys, values = attend_inputs(3, rep * T, S, 64, torch.float16, seed=T)
    limits = torch.arange(S - T + 1, S + 1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = f32.attend(rows, keys, values, limits, 0.125)
        torch.set_num_threads(1)
        one = f32.attend(rows, keys, values, limits, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    grouped = rows.view(3, rep, T, 64)
    for t in range(T):
        alone = f32.attend(grouped[:, :, t].contiguous(), keys, values, limits[t:t + 1], 0.125)
        assert torch.equal(alone, two.view(3, rep, T, 64)[:, :, t])
