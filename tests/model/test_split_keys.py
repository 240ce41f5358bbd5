"""Verification attention with the keys split into pieces (model/split_keys.py): the same attention,
merged from each piece's log-sum-exp, as one pass over all keys. On CPU the pieces go through torch's
CPU flash kernel (the form's arithmetic); tests/gpu checks the CUDA kernel's."""
import pytest
import torch

from triforce.model import split_keys
from triforce.model.attention import aligned_mask


def reference(q, keys, values, mask):
    T, Hq, D = q.shape
    group = Hq // keys.shape[0]
    k, v = keys.double().repeat_interleave(group, 0), values.double().repeat_interleave(group, 0)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) / D ** 0.5 + mask.double()
    return (torch.softmax(scores, -1) @ v).transpose(0, 1).reshape(T, Hq * D)


def static_view_mask(T: int, S: int, end: int, dtype) -> torch.Tensor:
    """The static views' mask: query t sees slots up to end - T + t; later slots (unused) are masked."""
    mask = aligned_mask(T, S, dtype, "cpu")
    slots = torch.arange(end - T, end)
    return mask.masked_fill_(torch.arange(S)[None, :] > slots[:, None], float("-inf"))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("T,heads,S,end,piece", [
    (7, (9, 3), 4096, 2500, 512),   # pieces past the end: every row masks them whole
    (2, (4, 4), 1000, 1000, 128),   # a ragged last piece (1000 = 7 x 128 + 104)
    (5, (8, 2), 3000, 40, 512),     # all but the first piece masked
    (1, (9, 3), 2048, 2048, 256),
])
def test_split_keys_is_the_attention_over_all_keys(dtype, tol, T, heads, S, end, piece):
    g = torch.Generator().manual_seed(T * S)
    Hq, Hkv = heads
    q = torch.randn(T, Hq, 64, generator=g).to(dtype)
    keys, values = (torch.randn(Hkv, S, 64, generator=g).to(dtype) for _ in "kv")
    mask = static_view_mask(T, S, end, dtype)
    got = split_keys.split_keys_attention(q, keys, values, mask, piece=piece)
    want = reference(q, keys, values, mask)
    assert got.dtype == dtype and got.shape == (T, Hq * 64) and torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_split_keys_serves_verification_over_long_caches_on_cuda_only():
    from types import SimpleNamespace

    assert not split_keys.serves(7, 32768, torch.zeros(7, 9, 64))  # CPU: the engine's own kernels
    on_cuda = SimpleNamespace(is_cuda=True)  # all serves() reads of the queries
    assert split_keys.serves(7, 32768, on_cuda) and split_keys.serves(17, 4096, on_cuda)
    # one query: asked only where cuDNN's grouped call (which splits the keys itself) refused it
    assert split_keys.serves(1, 32768, on_cuda)
    assert not split_keys.serves(7, split_keys.MIN_KEYS - 1, on_cuda)
    assert not split_keys.serves(2048, 32768, on_cuda)  # a prefill piece: blocks enough already


def test_a_prefill_pieces_causal_bias_never_takes_the_split_form(monkeypatch):
    """CausalBias (a later prefill piece's mask) is a Tensor subclass: the split form, which copies a
    dense mask, must not take it even where serves() would."""
    from torch.nn.attention.bias import causal_lower_right

    from triforce.model import attention

    monkeypatch.setattr(split_keys, "serves", lambda T, S, q: True)
    taken = []
    monkeypatch.setattr(split_keys, "split_keys_attention", lambda *a, **k: taken.append(1))
    q, keys = torch.randn(4, 4, 8), torch.randn(2, 16, 8)
    out = attention.attend_shared_heads(q, keys, keys, causal_lower_right(4, 16))
    assert not taken and out.shape == (4, 32)
    attention.attend_shared_heads(q, keys, keys, torch.zeros(4, 16))
    assert taken == [1]


@pytest.mark.parametrize("cudnn,route", [((True, True), "grouped"), ((False, True), "view"), ((False, False), "split")])
def test_one_query_takes_cudnn_in_either_form_before_the_split_keys(monkeypatch, cudnn, route):
    """One query: cuDNN's grouped-heads call, else cuDNN through the shared-heads view, and only where
    cuDNN takes neither (float32) the split keys, not the memory-efficient kernel's few blocks."""
    from triforce.model import attention

    monkeypatch.setattr(split_keys, "serves", lambda T, S, q: True)
    monkeypatch.setattr(attention, "takes_cudnn", lambda q, k, v, m, grouped: cudnn[not grouped])
    monkeypatch.setattr(attention, "grouped_takes_cudnn", lambda q, k, v, m: cudnn[0])
    taken = []
    for name, target in (("grouped", "attend_grouped_flag"), ("view", "shared_heads_sdpa")):
        monkeypatch.setattr(attention, target, lambda *a, name=name: taken.append(name))
    monkeypatch.setattr(split_keys, "split_keys_attention", lambda *a, **k: taken.append("split"))
    attention.attend_shared_heads(torch.randn(1, 4, 8), torch.randn(2, 16, 8), torch.randn(2, 16, 8), torch.zeros(1, 16))
    assert taken == [route]


VIEWS = {"view", "_unsafe_view", "permute", "transpose", "expand", "unsqueeze", "alias", "slice", "empty"}


def kernels(fn) -> list[str]:
    """The aten ops fn dispatches that compute (views and allocations left out): on CUDA, kernels."""
    from bench.kernels import OpCounter

    with OpCounter() as count:
        fn()
    return [name for name, n in count.names.items() if name not in VIEWS for _ in range(n)]


def test_the_layers_of_a_pass_share_one_bias_and_a_rewritten_mask_gets_a_new_one():
    """Every layer of a pass gets the same mask tensor: the first builds the folded, clamped bias
    and the rest reuse it (two kernels fewer a layer). The next pass rewrites the mask in place, as
    the static views' begin() does, and must not be served the old bias."""
    g = torch.Generator().manual_seed(5)
    T, S = 4, 2048
    q = torch.randn(T, 9, 64, generator=g)
    keys, values = (torch.randn(3, S, 64, generator=g) for _ in "kv")
    mask = static_view_mask(T, S, 1500, torch.float32)
    first, later = (kernels(lambda: split_keys.split_keys_attention(q, keys, values, mask, piece=256))
                    for _ in range(2))
    # the rows' copy, the bias's copy and clamp, the attention, the pieces' weights, their product and
    # sum, the result's cast and permute as one copy (10 kernels before on CUDA); then no bias
    assert len(first) == 8 and "clamp_" in first
    assert len(later) == 6 and "clamp_" not in later
    # the next pass: the same buffer, refilled for a longer sequence
    mask.fill_(0).masked_fill_(torch.arange(S)[None, :] > torch.arange(1996, 2000)[:, None], float("-inf"))
    got = split_keys.split_keys_attention(q, keys, values, mask, piece=256)
    torch.testing.assert_close(got.double(), reference(q, keys, values, mask), atol=2e-6, rtol=2e-6)
    # another mask of the same shape and version, or another group, is not served the last bias either
    split_keys.split_keys_attention(q, keys, values, static_view_mask(T, S, 1500, torch.float32), piece=256)
    other = static_view_mask(T, S, 700, torch.float32)
    got = split_keys.split_keys_attention(q, keys, values, other, piece=256)
    torch.testing.assert_close(got.double(), reference(q, keys, values, other), atol=2e-6, rtol=2e-6)
    q12 = torch.randn(T, 12, 64, generator=g)
    got = split_keys.split_keys_attention(q12, keys, values, other, piece=256)
    torch.testing.assert_close(got.double(), reference(q12, keys, values, other), atol=2e-6, rtol=2e-6)


def test_a_capture_never_reuses_a_bias_built_outside_it(monkeypatch):
    """A CUDA graph that read an eagerly built bias would read memory the cache lets go of at the
    next mask: a capture builds its own bias (its first layer), then its later layers reuse that."""
    T, S = 3, 1024
    q, keys = torch.randn(T, 4, 32), torch.randn(2, S, 32)
    mask = static_view_mask(T, S, 900, torch.float32)
    run = lambda: kernels(lambda: split_keys.split_keys_attention(q, keys, keys, mask, piece=128))  # noqa: E731
    assert "clamp_" in run() and "clamp_" not in run()
    monkeypatch.setattr(split_keys, "capturing_graph", lambda mask: True)
    assert "clamp_" in run() and "clamp_" not in run()
    monkeypatch.setattr(split_keys, "capturing_graph", lambda mask: False)
    assert "clamp_" not in run()  # built inside a capture: eager calls may read it
