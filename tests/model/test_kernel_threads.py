"""The CPU kernels over torch's threads give the bits of one thread: bfloat16 attention (decode_attention)
and products over stored blocks (stored_bf16), float32 attention (decode_attention_f32), at key
counts whose last span is partial (the tasks a thread takes then differ in size)."""
import pytest
import torch

from triforce.model import decode_attention, decode_attention_f32, stored_bf16


@pytest.fixture
def threads():
    """Runs the test body at 1 and then 2 threads; torch's count is restored after."""
    before = torch.get_num_threads()

    def at(n: int, fn):
        torch.set_num_threads(n)
        try:
            return fn()
        finally:
            torch.set_num_threads(before)
    return lambda fn: (at(1, fn), at(2, fn))


def _cache(S: int, D: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, S, D, generator=g).to(dtype) for _ in range(2)]


@pytest.mark.skipif(not decode_attention.available(), reason="the CPU lacks avx512_bf16")
@pytest.mark.parametrize("S", [4097, 6000])
@pytest.mark.parametrize("R", [3, 12])
@pytest.mark.parametrize("D", [64, 128])
def test_bf16_attention_is_the_same_on_two_threads(threads, S, R, D):
    keys, values = _cache(S, D, torch.bfloat16, S + R + D)
    rows = torch.randn(3, R, D, generator=torch.Generator().manual_seed(R)).bfloat16()
    probs = torch.softmax(torch.randn(3, R, S, generator=torch.Generator().manual_seed(S)), -1).bfloat16()
    one, two = threads(lambda: (decode_attention.scores(rows, keys), decode_attention.mix(probs, values)))
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


@pytest.mark.skipif(not decode_attention_f32.available(), reason="the CPU lacks avx2/fma/f16c")
@pytest.mark.parametrize("S", [4097, 6000])
@pytest.mark.parametrize("T", [1, 4])
def test_f32_cache_attend_is_the_same_on_two_threads(threads, S, T):
    g = torch.Generator().manual_seed(S + T)
    ck, cv = (torch.randn(2, 3, S + 8, 64, generator=g).half() for _ in range(2))
    q, k, v = torch.randn(T, 9, 64, generator=g), torch.randn(T, 3, 64, generator=g), torch.randn(T, 3, 64, generator=g)
    one, two = threads(lambda: decode_attention_f32.cache_attend(q, k, v, ck.clone(), cv.clone(), 1, S - T, 0.125))
    assert torch.equal(one, two)


@pytest.mark.skipif(not stored_bf16.available(), reason="the CPU lacks avx512_bf16")
@pytest.mark.parametrize("N,K", [(3072, 576), (576, 1536)])
@pytest.mark.parametrize("R", [1, 7])
def test_bf16_stored_products_are_the_same_on_two_threads(threads, N, K, R):
    g = torch.Generator().manual_seed(N + K + R)
    codes = torch.randint(0, 16, (N, K), generator=g)
    d, m = (torch.rand(N, K // 32, generator=g).half() for _ in range(2))
    records = stored_bf16.q4_records(codes, d, m)
    x = torch.randn(R, K, generator=g).bfloat16()
    one, two = threads(lambda: stored_bf16.q4_product(x, records, N))
    assert torch.equal(one, two)
    dense = ((codes.double() - 0) * d.double().repeat_interleave(32, 1) + m.double().repeat_interleave(32, 1))
    assert (one.double() - x.double() @ dense.T).abs().max() <= 2 ** -6 * (x.double().abs() @ dense.abs().T).max()
