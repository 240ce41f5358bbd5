"""A few queries as one-query heads (model/folded_heads.py): the same attention as one pass over all
keys, and the form chosen per shape by what the device times. On CPU the folded call goes through
SDPA's math; tests/gpu checks cuDNN's kernel and the engine's tokens with it."""
import pytest
import torch

from triforce.model import attention, folded_heads

from .test_split_keys import reference, static_view_mask


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("T,heads,S,end", [
    (2, (9, 3), 4096, 2500),  # SmolLM2's heads, the middle level's check of one draft
    (7, (8, 2), 1000, 1000),  # the last slot seen by the last query
    (5, (4, 4), 300, 40),     # most slots unused: masked for every row
    (32, (9, 3), 512, 200),   # the widest padded pass
])
def test_folded_heads_are_the_attention_over_all_keys(dtype, tol, T, heads, S, end):
    g = torch.Generator().manual_seed(T * S)
    Hq, Hkv = heads
    q = torch.randn(T, Hq, 64, generator=g, dtype=torch.float64).to(dtype)
    keys, values = (torch.randn(Hkv, S, 64, generator=g, dtype=torch.float64).to(dtype) for _ in "kv")
    mask = static_view_mask(T, S, end, dtype)
    got = folded_heads.folded_heads_attention(q, keys, values, mask)
    assert got.dtype == dtype and got.shape == (T, Hq * 64) and torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), reference(q, keys, values, mask), atol=tol, rtol=tol)


class Timed:
    """A stand-in for the device's clock: each form's seconds by which function is timed."""

    def __init__(self, folded: float, other: float):
        self.seconds, self.calls = {"folded": folded, "other": other}, []

    def __call__(self, fn):
        fn()
        name = "other" if getattr(fn, "__name__", "") == "other" else "folded"
        self.calls.append(name)
        return self.seconds[name]


@pytest.fixture
def decided(monkeypatch):
    monkeypatch.setattr(folded_heads, "_FOLDED_SERVES", {})
    return folded_heads._FOLDED_SERVES


@pytest.mark.parametrize("folded,other,serves", [(1e-5, 4e-5, True), (6e-5, 4e-5, False)])
def test_the_faster_form_serves_a_shape_decided_once(monkeypatch, decided, folded, other, serves):
    monkeypatch.setattr(folded_heads, "cudnn_takes", lambda *a: True)
    q, keys = torch.zeros(2, 9, 64), torch.zeros(3, 8192, 64)
    mask = torch.zeros(2, 8192)

    def other_form():
        return torch.zeros(2, 9 * 64)
    other_form.__name__ = "other"
    timer = Timed(folded, other)
    assert folded_heads.serves(q, keys, keys, mask, other_form, timer) is serves
    assert sorted(timer.calls) == ["folded", "other"]
    assert folded_heads.serves(q, keys, keys, mask, other_form, timer) is serves and len(timer.calls) == 2
    assert list(folded_heads.decisions().values()) == [serves]


def test_no_timing_where_the_kernel_refuses_or_one_query_or_too_many(monkeypatch, decided):
    timer = Timed(1e-6, 1.0)
    keys, other = torch.zeros(3, 8192, 64), lambda: None
    assert not folded_heads.cudnn_takes(torch.zeros(2, 9, 64), keys, keys, torch.zeros(2, 8192))  # CPU
    monkeypatch.setattr(folded_heads, "cudnn_takes", lambda *a: False)
    assert not folded_heads.serves(torch.zeros(2, 9, 64), keys, keys, torch.zeros(2, 8192), other, timer)
    monkeypatch.setattr(folded_heads, "cudnn_takes", lambda *a: True)
    for T in (1, folded_heads.MAX_QUERIES + 1):
        assert not folded_heads.serves(torch.zeros(T, 9, 64), keys, keys, torch.zeros(T, 8192), other, timer)
    assert timer.calls == []


def test_a_kernel_that_fails_after_the_probe_leaves_the_other_form(monkeypatch, decided):
    monkeypatch.setattr(folded_heads, "cudnn_takes", lambda *a: True)

    def refusing(fn):
        raise RuntimeError("cuDNN Frontend error: no valid engine configs")
    q, keys = torch.zeros(3, 9, 64), torch.zeros(3, 4096, 64)
    assert not folded_heads.serves(q, keys, keys, torch.zeros(3, 4096), lambda: None, refusing)
    assert decided and not any(decided.values())


def test_a_shape_first_seen_under_a_trace_is_decided_later(monkeypatch, decided):
    monkeypatch.setattr(folded_heads, "cudnn_takes", lambda *a: True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    q, keys = torch.zeros(2, 9, 64), torch.zeros(3, 4096, 64)
    assert not folded_heads.serves(q, keys, keys, torch.zeros(2, 4096), lambda: None, Timed(0.0, 1.0))
    assert decided == {}


def test_attend_shared_heads_asks_on_cuda_only(monkeypatch, decided):
    """On CPU the engine's static views take attend_masked; attend_shared_heads (the CUDA form) called
    on CPU never asks the folded form, so nothing is decided there."""
    g = torch.Generator().manual_seed(0)
    q, keys, values = torch.randn(3, 9, 64, generator=g), torch.randn(3, 600, 64, generator=g), torch.randn(3, 600, 64, generator=g)
    mask = static_view_mask(3, 600, 500, torch.float32)
    got = attention.attend_shared_heads(q, keys, values, mask)
    torch.testing.assert_close(got.double(), reference(q, keys, values, mask), atol=2e-6, rtol=2e-6)
    assert decided == {}
