"""Eager decoding's one-call steps on CPU (model/layer_ops.py, decode_attention_f32.cache_attend): the
same bits as the torch ops they replace (the rotation, the cache write and attention), or float64's
value within float32 rounding (the norm), and what a decode step runs through them."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from triforce.model import attention, decode_attention, decode_attention_f32, layer_ops
from triforce.model.rope import apply_rotary

pytestmark = pytest.mark.skipif(not layer_ops.available(), reason="no C++ compiler for the CPU ops")
needs_avx2 = pytest.mark.skipif(not decode_attention_f32.available(), reason="the CPU lacks avx2/fma/f16c")
needs_bf16 = pytest.mark.skipif(not decode_attention.available(), reason="the CPU lacks avx512_bf16")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,heads,kv_heads,D", [(1, 9, 3, 64), (3, 4, 4, 128), (7, 14, 2, 64), (2, 2, 1, 16)])
@pytest.mark.parametrize("one_position", [False, True])
def test_rotary_qk_is_apply_rotary_bit_for_bit(dtype, T, heads, kv_heads, D, one_position):
    g = torch.Generator().manual_seed(T * D + heads)
    qkv = (torch.randn(T, (heads + 2 * kv_heads) * D, generator=g) * 3).to(dtype)  # v's columns too
    n = 1 if one_position else T
    cos, sin = (torch.randn(n, D, generator=g).to(dtype) for _ in range(2))
    q, k = layer_ops.rotary_qk(qkv, cos, sin, heads, kv_heads)
    want = apply_rotary(qkv[:, :(heads + kv_heads) * D].view(T, heads + kv_heads, D), cos, sin)
    assert q.shape == (T, heads, D) and k.shape == (T, kv_heads, D)
    assert torch.equal(q, want[:, :heads]) and torch.equal(k, want[:, heads:])


def test_rms_norm_is_float64_within_float32_rounding_and_rows_alone_give_their_bits():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 576, generator=g) * torch.logspace(-3, 3, 9)[:, None]
    w = torch.randn(576, generator=g)
    got = layer_ops.rms_norm(x, w, 1e-5)
    x64 = x.double()
    want = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    # two float32 products and a square root: a few units of the last place
    assert ((got.double() - want).abs() <= 4 * 2 ** -24 * want.abs() + 1e-30).all()
    for r in range(9):  # a verification pass normalizes each row as a one-token pass does
        assert torch.equal(layer_ops.rms_norm(x[r:r + 1], w, 1e-5)[0], got[r])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_rms_norm_rounds_as_transformers_but_for_the_statistics_sum_order(dtype):
    """The normalized value rounded to the dtype, then the weight's product rounded (transformers'
    Llama); against torch's float32 statistics, a unit of the last place on about 1 element in 10^5
    where the two sums' orders round the variance differently; rows alone give their bits."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 576, generator=g) * torch.logspace(-2, 2, 64)[:, None]).to(dtype)
    w = (1 + 0.3 * torch.randn(576, generator=g)).to(dtype)
    got = layer_ops.rms_norm(x, w, 1e-5)
    torch_ops = w * torch.nn.functional.rms_norm(x.float(), (576,), eps=1e-5).to(dtype)
    ulp = 2.0 ** -(7 if dtype == torch.bfloat16 else 10)
    assert got.dtype == dtype and ((got.float() - torch_ops.float()).abs() <= ulp * torch_ops.float().abs()).all()
    assert (got != torch_ops).sum() <= 64 * 576 * 1e-3
    # against float64 statistics, with the reference's two roundings: equal where the roundings agree
    x64 = x.double()
    normalized = (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    exact = (normalized.double() * w.double()).to(dtype)
    assert (got != exact).sum() <= (torch_ops != exact).sum()  # no further from float64 than torch's ops
    for r in (0, 17, 63):
        assert torch.equal(layer_ops.rms_norm(x[r:r + 1], w, 1e-5)[0], got[r])


def test_the_ops_serve_eager_cpu_only(monkeypatch):
    x = torch.zeros(2, 8)
    assert layer_ops.serves(x) and layer_ops.serves(x.bfloat16())
    assert not layer_ops.serves(x.double())  # float64 (the exactness tests) keeps torch's ops
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not layer_ops.serves(x)  # a compiled graph fuses the steps itself


def _store_then_attend(q, k, v, cache_k, cache_v, layer, start):
    """store_and_attend's path without the one call: copy_ into the cache, then attention.attend."""
    T = k.shape[0]
    cache_k[layer, :, start:start + T] = k.transpose(0, 1)
    cache_v[layer, :, start:start + T] = v.transpose(0, 1)
    return attention.attend(q, cache_k[layer, :, :start + T], cache_v[layer, :, :start + T])


def _cache_attend_case(kernels, dtype, cache_dtype, T, start, rep, D):
    g = torch.Generator().manual_seed(start + T)
    layers, H, slots = 3, 2, 4200
    cache_k = torch.randn(layers, H, slots, D, generator=g).to(cache_dtype)
    cache_v = torch.randn(layers, H, slots, D, generator=g).to(cache_dtype)
    qkv = (torch.randn(T, (H * rep + 2 * H) * D, generator=g) * 4).to(dtype)
    q = qkv[:, :H * rep * D].view(T, H * rep, D)  # strided views, as the layer hands them over
    k = qkv[:, H * rep * D:(H * rep + H) * D].view(T, H, D)
    v = qkv[:, (H * rep + H) * D:].view(T, H, D)
    want_k, want_v = cache_k.clone(), cache_v.clone()
    want = _store_then_attend(q, k, v, want_k, want_v, 1, start)
    got = kernels.cache_attend(q, k, v, cache_k, cache_v, 1, start, D ** -0.5)
    assert torch.equal(cache_k, want_k) and torch.equal(cache_v, want_v)  # the same rounding, the same slots
    assert got.shape == (T, H * rep * D) and torch.equal(got, want)


CASES = pytest.mark.parametrize("T,start,rep,D", [(1, 0, 3, 64), (1, 300, 1, 128), (5, 2046, 3, 64),  # 2046 + 5
                                                  (7, 4100, 1, 128), (3, 17, 2, 64)])               # crosses a span


@needs_avx2
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16, torch.float32])
@CASES
def test_cache_attend_is_the_write_then_attend_bit_for_bit(cache_dtype, T, start, rep, D):
    _cache_attend_case(decode_attention_f32, torch.float32, cache_dtype, T, start, rep, D)


@needs_bf16
@CASES
def test_bf16_cache_attend_is_the_write_then_attend_bit_for_bit(T, start, rep, D):
    _cache_attend_case(decode_attention, torch.bfloat16, torch.bfloat16, T, start, rep, D)


@pytest.mark.parametrize("kernels,dtype", [pytest.param(decode_attention_f32, torch.float32, marks=needs_avx2),
                                            pytest.param(decode_attention, torch.bfloat16, marks=needs_bf16)])
def test_cache_attend_refuses_what_does_not_fit(kernels, dtype):
    cache = torch.zeros(2, 1, 8, 64, dtype=torch.bfloat16)
    q, kv = torch.zeros(2, 3, 64, dtype=dtype), torch.zeros(2, 1, 64, dtype=dtype)
    with pytest.raises(RuntimeError, match="out of the cache"):
        kernels.cache_attend(q, kv, kv, cache, cache.clone(), 0, 7, 0.125)
    with pytest.raises(RuntimeError, match="out of the cache"):
        kernels.cache_attend(q, kv, kv, cache, cache.clone(), 2, 0, 0.125)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@needs_avx2
def test_an_eager_float32_decode_step_runs_a_layer_in_a_few_calls():
    """SmolLM2's layout (head_dim 64, 3 query heads a KV head) on a float16 cache: each layer writes
    and attends in one call, rotates in one and normalizes in one each; ~50 ops a layer before."""
    from transformers import LlamaConfig

    from triforce.model.config import ModelConfig
    from triforce.model.transformer import Transformer
    from triforce.speculative.caches import FullCache

    hf = LlamaConfig(vocab_size=64, hidden_size=192, intermediate_size=256, num_hidden_layers=3,
                     num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=256)
    model = Transformer(ModelConfig.from_hf(hf.to_dict())).eval()
    model.kv_dtype = torch.float16
    cache = FullCache(model.kv_shape(), 64)
    with torch.inference_mode():
        model(torch.arange(9), cache)
        with _Ops() as ops:
            model(torch.tensor([5]), cache, last_only=True)
    per_layer = {name: ops.names.count(name) / 3 for name in set(ops.names)}
    assert per_layer["triforce_decode_f32.cache_attend"] == 1
    assert per_layer["triforce_layer.rotary_qk"] == 1
    assert per_layer["triforce_layer.rms_norm"] == pytest.approx(2 + 1 / 3)  # and the final norm
    first = ops.names.index("triforce_layer.rms_norm")
    last = len(ops.names) - ops.names[::-1].index("aten.slice") - 1  # last_only: the final row's slice
    assert (last - first) / 3 <= 16  # 4 products, 3 calls of ours, 2 adds, the MLP's split, silu and mul...


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prefill_s_rows_split_over_threads_give_one_thread_s_bits(dtype):
    """Hundreds of rows (a prefill piece) go to the pool in ranges; each row is still one task's, so
    the bits do not depend on the threads, and equal the row's alone."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(300, 576, generator=g).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    qkv = torch.randn(300, 5 * 64, generator=g).to(dtype)
    cos, sin = (torch.randn(300, 64, generator=g).to(dtype) for _ in range(2))
    threads = torch.get_num_threads()
    try:
        out = {}
        for n in (1, 2):
            torch.set_num_threads(n)
            out[n] = (layer_ops.rms_norm(x, w, 1e-5), *layer_ops.rotary_qk(qkv, cos, sin, 3, 1))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(out[1], out[2]))
    assert torch.equal(layer_ops.rms_norm(x[137:138], w, 1e-5)[0], out[2][0][137])
    want = apply_rotary(qkv[:, :4 * 64].view(300, 4, 64), cos, sin)
    assert torch.equal(out[2][1], want[:, :3]) and torch.equal(out[2][2], want[:, 3:])
