"""model.attention on CPU against attention written out per head in float64: every kernel path
(grouped matmuls for a few queries, one causal piece, a later piece against a cached past)."""
import shutil

import pytest
import torch

from triforce.model import attention, decode_attention


def reference(q, keys, values):
    """Causal attention of the last T positions, per query head, plain softmax in float64."""
    T, Hq, D = q.shape
    Hkv, S, _ = keys.shape
    out = torch.empty(T, Hq, D, dtype=torch.float64)
    for h in range(Hq):
        k, v = keys[h // (Hq // Hkv)].double(), values[h // (Hq // Hkv)].double()
        scores = q[:, h].double() @ k.T / D ** 0.5
        scores.masked_fill_(torch.ones(T, S, dtype=torch.bool).tril(S - T).logical_not(), float("-inf"))
        out[:, h] = torch.softmax(scores, dim=-1) @ v
    return out.reshape(T, Hq * D)


SHAPES = [(1, 50), (5, 50), (31, 31), (40, 40), (40, 100), (33, 34), (64, 1000), (300, 301)]
TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize("T,S", SHAPES)
def test_every_path_matches_the_written_out_attention(T, S, heads, dtype):
    g = torch.Generator().manual_seed(T * 1000 + S)
    Hq, Hkv = heads
    q = torch.randn(T, Hq, 16, generator=g, dtype=torch.float64).to(dtype)
    keys = torch.randn(Hkv, S, 16, generator=g, dtype=torch.float64).to(dtype)
    values = torch.randn(Hkv, S, 16, generator=g, dtype=torch.float64).to(dtype)
    got = attention.attend(q, keys, values)
    assert got.dtype == dtype and got.shape == (T, Hq * 16)
    assert (got.double() - reference(q, keys, values)).abs().max().item() < TOLERANCE[dtype]


@pytest.mark.parametrize("T,S", [(40, 100), (64, 1000)])
def test_the_merged_past_and_piece_equals_the_masked_call(T, S, monkeypatch):
    """The CPU split (past without a mask + the piece causal, merged by log-sum-exp) is taken for a
    later piece and gives what one masked SDPA call gives."""
    assert attention._CPU_FLASH is not None  # torch's CPU flash kernel: the split path exists here
    g = torch.Generator().manual_seed(7)
    q, keys, values = (torch.randn(*shape, generator=g, dtype=torch.float64)
                       for shape in ((T, 9, 16), (3, S, 16), (3, S, 16)))
    split = attention.attend(q, keys, values)
    monkeypatch.setattr(attention, "_CPU_FLASH", None)
    masked = attention.attend(q, keys, values)
    torch.testing.assert_close(split, masked, rtol=0, atol=1e-12)



@pytest.mark.parametrize("layout", ["head-major", "token-major"])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize("T,S", [(1, 50), (7, 50), (7, 7), (40, 100)])
def test_shared_heads_attention_takes_a_mask_or_the_lower_right_diagonal(T, S, heads, layout):
    """The CUDA form (zero-stride views of each KV head, no grouped-heads flag) under the static
    views' additive mask and under torch's lower-right causal bias (a later prefill piece) computes
    the written-out attention; over the offloaded store's token-major layer as well."""
    from torch.nn.attention.bias import causal_lower_right
    g = torch.Generator().manual_seed(T * 100 + S)
    Hq, Hkv = heads
    q = torch.randn(T, Hq, 16, generator=g, dtype=torch.float64)
    keys, values = (torch.randn(Hkv, S, 16, generator=g, dtype=torch.float64) for _ in "kv")
    if layout == "token-major":  # (S, Hkv, D) storage seen as (Hkv, S, D)
        keys, values = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in (keys, values))
    mask = attention.aligned_mask(T, S, torch.float64, "cpu")
    mask.masked_fill_(torch.ones(T, S, dtype=torch.bool).tril(S - T).logical_not(), float("-inf"))
    want = reference(q, keys, values)
    for bias in (mask, causal_lower_right(T, S)):
        got = attention.attend_shared_heads(q, keys, values, bias)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_a_refused_shared_heads_form_falls_back_to_the_grouped_heads_call(monkeypatch):
    """Where a CUDA kernel refused the zero-stride form, the grouped-heads call computes the same."""
    from torch.nn.attention.bias import causal_lower_right
    g = torch.Generator().manual_seed(5)
    q = torch.randn(7, 9, 16, generator=g, dtype=torch.float64)
    keys, values = (torch.randn(3, 40, 16, generator=g, dtype=torch.float64) for _ in "kv")
    mask = torch.zeros(7, 40, dtype=torch.float64).masked_fill(torch.ones(7, 40, dtype=torch.bool).tril(33).logical_not(),
                                                              float("-inf"))
    monkeypatch.setattr(attention, "_REFUSED", {(torch.float64, True), (torch.float64, False)})
    monkeypatch.setattr(attention, "shared_heads_sdpa", None)  # not called
    for bias in (mask, causal_lower_right(7, 40)):
        torch.testing.assert_close(attention.attend_shared_heads(q, keys, values, bias), reference(q, keys, values),
                                   rtol=0, atol=1e-12)


def test_the_shared_heads_form_traces_whole():
    """Compiled passes (fullgraph) trace it: the refusal check and the zero-stride call, no break."""
    g = torch.Generator().manual_seed(6)
    q = torch.randn(7, 9, 16, generator=g, dtype=torch.float64)
    keys, values = (torch.randn(3, 40, 16, generator=g, dtype=torch.float64) for _ in "kv")
    mask = torch.zeros(7, 40, dtype=torch.float64).masked_fill(torch.ones(7, 40, dtype=torch.bool).tril(33).logical_not(),
                                                              float("-inf"))
    traced = torch.compile(attention.attend_shared_heads, fullgraph=True, backend="eager")
    torch.testing.assert_close(traced(q, keys, values, mask), reference(q, keys, values), rtol=0, atol=1e-12)


@pytest.mark.parametrize("S", [1, 15, 16, 300])
def test_aligned_masks_start_each_row_16_elements_apart(S):
    mask = attention.aligned_mask(7, S, torch.bfloat16, "cpu")
    assert mask.shape == (7, S) and mask.stride() == (-(-S // 16) * 16, 1) and not mask.any()

needs_kernels = pytest.mark.skipif(not decode_attention.available(),
                                   reason="no avx512_bf16 or no C++ compiler: attention keeps bmm")
BF16_ULP = 2 ** -7  # one rounding of a bfloat16 result apart, relative


def close_to_one_rounding(got, want):
    """Equal but for the order of float32 sums: at most one bf16 rounding apart."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=BF16_ULP, atol=BF16_ULP * want.float().abs().max().item() * 1e-2)


@needs_kernels
@pytest.mark.parametrize("D", decode_attention.HEAD_DIMS)
@pytest.mark.parametrize("R", [1, 3, 4, 5, 6, 7, 16, 17, 21, 42, 64])
@pytest.mark.parametrize("S", [1, 2, 15, 16, 17, 33, 64, 65, 300, 1000])
def test_decode_kernels_compute_bmm(D, R, S):
    """Each kernel is bmm but for its sums' order, over a layer's view of a longer cache (the head
    stride is the capacity's, not S): the few-row loops (scores up to 3 rows, values up to one tile)
    and the tiled ones with part tiles, key counts odd and even, in and past whole blocks."""
    g = torch.Generator().manual_seed(R * 1000 + S + D)
    rows = torch.randn(3, R, D, generator=g).bfloat16()
    keys = torch.randn(3, S + 21, D, generator=g).bfloat16()[:, :S]
    values = torch.randn(3, S + 21, D, generator=g).bfloat16()[:, :S]
    probs = torch.softmax(torch.randn(3, R, S, generator=g), dim=-1).bfloat16()
    close_to_one_rounding(decode_attention.scores(rows, keys), torch.bmm(rows, keys.transpose(1, 2)))
    close_to_one_rounding(decode_attention.mix(probs, values), torch.bmm(probs, values))


def prefix_reference(q, keys, values, limits):
    """Attention of q (T, Hq, D) over the first limits[t] slots of keys/values (Hkv, S, D) in float64
    -> (T, Hq * D), and the same with every value's magnitude (what rounding errors scale with)."""
    T, Hq, D = q.shape
    Hkv, S, _ = keys.shape
    out, scale = torch.empty(T, Hq, D, dtype=torch.float64), torch.empty(T, Hq, D, dtype=torch.float64)
    hidden = torch.arange(S)[None, :] >= limits[:, None]
    for h in range(Hq):
        k, v = keys[h // (Hq // Hkv)].double(), values[h // (Hq // Hkv)].double()
        probs = torch.softmax((q[:, h].double() @ k.T / D ** 0.5).masked_fill(hidden, float("-inf")), dim=-1)
        out[:, h], scale[:, h] = probs @ v, probs @ v.abs()
    return out.reshape(T, Hq * D), scale.reshape(T, Hq * D)


# bf16 attention's error against float64, relative to softmax . |values|: the output's rounding (2^-8),
# the weights' (2^-8 each) and, for bmm's path, the scores rounded to bf16 before the softmax
BF16_ATTENTION_BOUND = 2 ** -6


@needs_kernels
@pytest.mark.parametrize("T", [1, 4, 7])
@pytest.mark.parametrize("heads,D", [((9, 3), 64), ((6, 2), 64), ((4, 4), 64), ((12, 2), 128)])
def test_masked_attention_through_the_kernels_equals_float64(T, heads, D, monkeypatch):
    """attend_masked (the compiled static view's attention) takes the kernel for a bf16 cache and is
    float64's attention within bf16 rounding, as its bmm path is: GQA groups, stale slots under the
    mask (filled with large values they must not leak), several new tokens each seeing up to its own
    slot. T=7 is a verification pass of gamma 6: 21 rows per KV head for SmolLM2's 3 heads per KV
    head, 42 for Qwen's 6."""
    Hq, Hkv = heads
    g = torch.Generator().manual_seed(T * 10 + Hq)
    capacity, used = 333, 200
    q = torch.randn(T, Hq, D, generator=g).bfloat16()
    keys, values = (torch.randn(Hkv, capacity, D, generator=g).bfloat16() for _ in range(2))
    keys[:, used + T:] *= 1000  # stale slots: nothing of them may reach the output
    values[:, used + T:] = 1e4
    slots = torch.arange(used, used + T)
    mask = torch.zeros(T, capacity).masked_fill_(torch.arange(capacity)[None] > slots[:, None], float("-inf"))
    mask = mask.bfloat16()
    assert decode_attention.serves(q[:, :Hkv].transpose(0, 1).contiguous(), keys)
    calls = []
    kernel = decode_attention.attend
    monkeypatch.setattr(decode_attention, "attend", lambda rows, *args: calls.append(rows.shape) or kernel(rows, *args))
    got = attention.attend_masked(q, keys, values, mask, slots + 1)
    assert calls == [(Hkv, Hq // Hkv * T, D)]
    monkeypatch.setattr(decode_attention, "serves", lambda rows, cache: False)
    bmm = attention.attend_masked(q, keys, values, mask, slots + 1)
    want, scale = prefix_reference(q, keys, values, slots + 1)
    for out in (got, bmm):  # both kept the stale slots out, both within rounding
        assert ((out.double() - want).abs() / scale).max().item() <= BF16_ATTENTION_BOUND


@needs_kernels
@pytest.mark.parametrize("T", [1, 3, 5])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4)])
def test_eager_attention_through_the_kernels(T, heads, monkeypatch):
    """Eager decode and verification (`attend`, a few bf16 queries, 64-wide heads) take the kernels
    over a layer's view of a longer cache, and match attention written out in float64 as the GEMM
    path does; a token-major layer (the offloaded store's) keeps the GEMMs."""
    Hq, Hkv = heads
    g = torch.Generator().manual_seed(T * 10 + Hq)
    q = torch.randn(T, Hq, 64, generator=g).bfloat16()
    keys, values = (torch.randn(Hkv, 400, 64, generator=g).bfloat16()[:, :333] for _ in range(2))
    calls = []
    kernel = decode_attention.attend
    monkeypatch.setattr(decode_attention, "attend", lambda rows, *args: calls.append(rows.shape) or kernel(rows, *args))
    got = attention.attend(q, keys, values)
    assert calls == [(Hkv, Hq // Hkv * T, 64)]
    want, scale = prefix_reference(q, keys, values, torch.arange(333 - T + 1, 334))
    assert ((got.double() - want).abs() / scale).max().item() <= BF16_ATTENTION_BOUND
    token_major = [x.transpose(0, 1).contiguous().transpose(0, 1) for x in (keys, values)]
    gemm = attention.attend(q, *token_major)
    assert len(calls) == 1
    assert ((gemm.double() - want).abs() / scale).max().item() <= BF16_ATTENTION_BOUND


@needs_kernels
@pytest.mark.parametrize("D", decode_attention.HEAD_DIMS)
@pytest.mark.parametrize("R", [1, 5, 6, 7, 21])
@pytest.mark.parametrize("S", [1, 63, 64, 65, 130])
def test_value_kernel_keeps_each_dim_and_key_in_place(D, R, S):
    """The value kernel pairs keys in each 32-bit lane and its interleave moves dims within a chunk:
    with integer values (exact in bf16), row r weighting one key alone must give that key's value row
    exactly, dim for dim. Fails if the dims' order were not undone, or a weight met the wrong key of
    its pair (the odd last key, alone in its pair, among them)."""
    values = (torch.arange(D).repeat(S, 1) + 128 * (torch.arange(S)[:, None] % 2)).bfloat16()[None]
    values = values.expand(2, S, D).contiguous()
    picked = [(r * 7) % S for r in range(R - 1)] + [S - 1]
    probs = torch.zeros(2, R, S)
    probs[:, torch.arange(R), torch.tensor(picked)] = 1.0
    got = decode_attention.mix(probs.bfloat16(), values)
    assert torch.equal(got, values[:, picked])


@needs_kernels
def test_decode_kernels_serve_any_number_of_rows():
    cache = torch.zeros(3, 10, 64, dtype=torch.bfloat16)
    for rows in (1, 16, 17, 42, 300):
        assert decode_attention.serves(torch.zeros(3, rows, 64, dtype=torch.bfloat16), cache)


def test_decode_kernels_serve_bf16_only():
    """float32 compute over a 16-bit cache (kv_dtype.py) and float32 caches keep bmm: the kernels
    take bfloat16 rows only, which float32 queries are not."""
    cache = torch.zeros(3, 10, 64, dtype=torch.bfloat16)
    assert not decode_attention.serves(torch.zeros(3, 3, 64), cache)
    assert not decode_attention.serves(torch.zeros(3, 3, 64), cache.float())
    assert not decode_attention.serves(torch.zeros(3, 3, 48, dtype=torch.bfloat16), torch.zeros(3, 10, 48, dtype=torch.bfloat16))


def test_decode_kernels_build_where_the_cpu_has_avx512_bf16():
    """Where they can build they must build and pass their own check: a kernel that computes wrongly
    would otherwise turn into a silent fallback to bmm (and the tests above into skips)."""
    from triforce.model.kv_dtype import cpu_flags

    if not {"avx512f", "avx512bw", "avx512_bf16"} <= cpu_flags() or shutil.which("c++") is None:
        pytest.skip("no avx512_bf16 or no C++ compiler")
    assert decode_attention.available()


@needs_kernels
def test_compiled_bf16_decoding_through_the_kernels_keeps_the_eager_tokens(tmp_path):
    """--compile on a bf16 model with 64-wide heads (GQA) attends through the kernels and decodes
    the tokens of eager decoding, whose attention is torch's own GEMMs."""
    from tests.conftest import save_tiny
    from triforce.model.loader import load_model
    from triforce.speculative import GenerationConfig, Generator, Models
    from triforce.speculative.graphs import enable_compiled_passes

    save_tiny(tmp_path, seed=3, vocab=64, layers=2, hidden=192, heads=3, kv_heads=1, inter=96)
    models = Models(load_model(tmp_path, torch.bfloat16), None)
    ids = [3 + (i * 7) % 60 for i in range(150)]
    cfg = GenerationConfig(max_new_tokens=16)
    eager = Generator(models, cfg, "autoregressive", max_len=200)
    eager.prefill(ids)
    compiled = Generator(models, cfg, "autoregressive", max_len=200)
    enable_compiled_passes(compiled)
    compiled.prefill(ids)
    with pytest.MonkeyPatch.context() as patch:  # eager attends through torch's GEMMs
        patch.setattr(decode_attention, "serves", lambda rows, cache: False)
        want = eager.generate()
    calls = []
    kernel = decode_attention.attend
    with pytest.MonkeyPatch.context() as patch:  # count the kernel's calls while the graph is traced
        patch.setattr(decode_attention, "attend", lambda rows, *args: calls.append(rows.shape) or kernel(rows, *args))
        assert compiled.generate() == want
    assert calls  # the graph called the kernel (traced through the counting wrapper)
