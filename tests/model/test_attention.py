"""model.attention on CPU against attention written out per head in float64: every kernel path
(grouped matmuls for a few queries, one causal piece, a later piece against a cached past)."""
import pytest
import torch

from triforce.model import attention


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
