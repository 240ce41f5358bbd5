"""The nucleus (top-p) without a sort of the vocabulary on CPU (sampling.nucleus): the set the rule
defines, the same whether found among a few candidates or from a full sort, ties kept together."""
import pytest
import torch

from triforce.speculative import sampling
from triforce.speculative.hostsync import HostSyncCounter


def by_definition(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Token x stays when the mass of the tokens strictly more probable than x, summed in descending
    order as the rule sums it, is below top_p; then renormalised. One row at a time, in Python."""
    out = torch.zeros_like(probs)
    for r, row in enumerate(probs):
        values = torch.sort(row, descending=True).values
        before = values.cumsum(0) - values
        for x in range(row.shape[0]):
            first = int((values > row[x]).sum())  # where x's ties begin
            out[r, x] = row[x] if before[first] < top_p else 0.0
    return out / out.sum(dim=-1, keepdim=True)


def old_rule(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Sessions 1-18: a full sort, each token's mass above it in the sort's own order of ties."""
    values, order = torch.sort(probs, dim=-1, descending=True)
    before = values.cumsum(dim=-1) - values
    values = values.masked_fill(before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, values)
    return kept / kept.sum(dim=-1, keepdim=True)


def full_sort(probs: torch.Tensor, top_p: float, monkeypatch) -> torch.Tensor:
    """The GPU's and a compiled graph's path: the candidates are the whole vocabulary."""
    monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", probs.shape[-1])
    try:
        return sampling.nucleus(probs, top_p)
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("top_p", [0.3, 0.8, 0.95])
@pytest.mark.parametrize("candidates", [2, 7, 256])
def test_the_nucleus_is_the_rule_s_set_however_many_candidates(dtype, top_p, candidates, monkeypatch):
    g = torch.Generator().manual_seed(int(top_p * 100) + candidates)
    logits = torch.randn(4, 300, generator=g, dtype=torch.float64) * torch.tensor([0.3, 1.0, 3.0, 10.0],
                                                                                   dtype=torch.float64)[:, None]
    probs = torch.softmax(logits.to(dtype), dim=-1)
    want = full_sort(probs, top_p, monkeypatch)
    monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", candidates)  # the search grows from here
    got = sampling.nucleus(probs, top_p)
    assert torch.equal(got, want)
    assert torch.equal(got, old_rule(probs, top_p))  # no ties: the set sessions 1-18 kept
    torch.testing.assert_close(got, by_definition(probs, top_p), rtol=0, atol=0)


@pytest.mark.parametrize("top_p", [0.5, 0.9])
def test_ties_are_kept_or_dropped_together(top_p, monkeypatch):
    """bfloat16 logits take few values, so equal probabilities are common: the set is the rule's
    whatever order a sort or topk gives the ties."""
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(6, 500, generator=g) * 2).bfloat16().float()
    probs = torch.softmax(logits, dim=-1)
    assert any(len(torch.unique(row)) < 500 for row in probs)  # there are ties
    want = by_definition(probs, top_p)
    monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", 3)
    assert torch.equal(sampling.nucleus(probs, top_p), want)
    assert torch.equal(full_sort(probs, top_p, monkeypatch), want)
    out = sampling.nucleus(probs, top_p)
    for row, kept in zip(probs, out):  # each probability kept on all its tokens or on none
        for value in torch.unique(row):
            tied = row == value
            assert bool((kept[tied] > 0).all()) or bool((kept[tied] == 0).all())


def test_the_cpu_search_is_not_a_wait_a_gpu_would_pay():
    probs = torch.softmax(torch.randn(3, 5000, generator=torch.Generator().manual_seed(1)), dim=-1)
    with HostSyncCounter() as counter:
        sampling.nucleus(probs, 0.99)  # flat: the search grows several times
    assert counter.total == 0
