"""Sampled output has exactly the target's distribution, checked against enumeration.

Vocabulary of 8 tokens: the exact joint distribution of the 2nd and 3rd generated tokens (the
first ones that speculation produces) is computed by running the target on every prefix. Each
engine then samples it 2,000 times with different seeds, and a chi-square test at a
fixed seed must accept it. The same test with a deliberately wrong residual (resampling from the
target instead of norm(max(0, p - q))) must reject, so the test is known to have teeth.
"""
import math

import pytest
import torch

import triforce.speculative.sampling as sampling
from triforce.speculative import GenerationConfig, Generator, Models
from triforce.speculative.caches import FullCache
from triforce.speculative.graphs import enable_cuda_graphs
from triforce.speculative.lookup import LookupDrafter
from triforce.model.loader import load_model
from triforce.speculative.sampling import Sampler

from ..conftest import save_tiny

VOCAB = 8
# At 2,000 seeds the wrong residuals below score 158-517 against the critical 98.9 (1.6x at the
# least, the lookup drafter's), the correct engines 5-67; 3,000 cost a third more of the suite's
# slowest module for margins of 2.1x (measured 2026-11-28, every case at 1,000-3,000 seeds)
SAMPLES = 2000


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    t, d = tmp_path_factory.mktemp("t"), tmp_path_factory.mktemp("d")
    save_tiny(t, seed=21, vocab=VOCAB, hidden=16, layers=1, heads=2, kv_heads=1, inter=24)
    save_tiny(d, seed=22, vocab=VOCAB, hidden=16, layers=1, heads=2, kv_heads=1, inter=24)
    return load_model(t, torch.float64), load_model(d, torch.float64)


PROMPT = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3)).tolist()
SETTINGS = dict(max_new_tokens=3, temperature=0.3, budget=16, chunk_size=4, gamma1=2, gamma2=3,
                draft_window=8, sink_tokens=2)


def exact_joint(target, sampler: Sampler) -> torch.Tensor:
    """P(t2, t3) as a (V, V) table, summing over t1, by running the target on every prefix."""
    def next_dist(seq):
        logits = target(torch.tensor(seq), FullCache(target.kv_shape(), len(seq)), last_only=True)
        return sampler.probs(logits)[0]

    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    p1 = next_dist(PROMPT)
    for t1 in range(VOCAB):
        p2 = next_dist(PROMPT + [t1])
        for t2 in range(VOCAB):
            joint[t2] += p1[t1] * p2[t2] * next_dist(PROMPT + [t1, t2])
    return joint


def sample_joint(models: Models, mode: str, cfg: dict) -> torch.Tensor:
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    cfg = dict(cfg)
    whole = cfg.pop("whole_rounds", False)
    for seed in range(SAMPLES):
        gen = Generator(models, GenerationConfig(**cfg, seed=seed), mode, max_len=len(PROMPT) + 8)
        if whole:  # each drafter->middle round one graph (rounds.RoundGraph, run eagerly on CPU)
            enable_cuda_graphs(gen, eager_static=True)
        gen.prefill(PROMPT)
        tokens = gen.generate()
        counts[tokens[1], tokens[2]] += 1
        assert not whole or gen.proposers[mode][0].graph.runs > 0  # the rounds did run as graphs
    return counts


def chi_square_rejects(counts: torch.Tensor, probs: torch.Tensor, alpha_z: float = 3.72) -> tuple[bool, float, float]:
    """Pearson chi-square with cells of expected count < 5 pooled; Wilson-Hilferty critical value
    at z = 3.72 (one-sided p = 1e-4). Returns (rejects, statistic, critical value)."""
    expected = probs.flatten() * counts.sum()
    observed = counts.flatten()
    small = expected < 5
    exp_cells = torch.cat((expected[~small], expected[small].sum()[None]))
    obs_cells = torch.cat((observed[~small], observed[small].sum()[None]))
    keep = exp_cells > 0
    stat = float(((obs_cells[keep] - exp_cells[keep]) ** 2 / exp_cells[keep]).sum())
    k = int(keep.sum()) - 1
    critical = k * (1 - 2 / (9 * k) + alpha_z * math.sqrt(2 / (9 * k))) ** 3
    return stat > critical, stat, critical


LOOKUP = "lookup"
DEVICE = {"device_rounds": True}  # triforce's drafter->middle rounds on the device (rounds.py)
WHOLE = {**DEVICE, "whole_rounds": True}
CASES = [("speculative", True, {}), ("retrieval", False, {}), ("triforce", True, {}),
         ("triforce", False, {}), ("triforce", True, {"top_k": 5, "top_p": 0.8}),
         ("triforce", True, DEVICE), ("triforce", False, DEVICE), ("triforce", True, {**DEVICE, "top_k": 5, "top_p": 0.8}),
         # two rounds per full pass: the full level verifies six positions, capped at what the middle made
         ("triforce", True, {**DEVICE, "gamma2": 6}),
         # each round one graph, its uniforms drawn before it: one and two rounds per full pass
         ("triforce", True, WHOLE), ("triforce", True, {**WHOLE, "gamma2": 6, "top_k": 5, "top_p": 0.8}),
         # speculative sampling's token-by-token rule (the default verifies by block)
         ("triforce", True, {**DEVICE, "gamma2": 6, "verification": "token"}),
         # drafts looked up in the sequence: point masses, accepted with probability p(x)
         ("speculative", LOOKUP, {}), ("triforce", LOOKUP, {}), ("triforce", LOOKUP, {**DEVICE, "gamma2": 6}),
         ("triforce", LOOKUP, {**WHOLE, "top_k": 5, "top_p": 0.8})]


def drafter_of(models, use_drafter):
    """Models with the case's drafter: the drafter model (True), the target itself (False), a lookup."""
    target, drafter = models
    return Models(target, LookupDrafter() if use_drafter == LOOKUP else drafter if use_drafter else None)


@pytest.mark.parametrize("mode,use_drafter,extra", CASES)
def test_distribution_is_exact(models, mode, use_drafter, extra):
    cfg = {**SETTINGS, **extra}
    sampler = Sampler(cfg["temperature"], cfg.get("top_p", 1.0), cfg.get("top_k", 0))
    exact = exact_joint(models[0], sampler)
    counts = sample_joint(drafter_of(models, use_drafter), mode, cfg)
    rejects, stat, critical = chi_square_rejects(counts, exact)
    assert not rejects, f"chi-square {stat:.1f} > {critical:.1f}: {mode} does not sample the target's distribution"


def wrong_residual(p, q):
    return p  # the reference implementation's mistake: resample from the target, not the residual


@pytest.mark.parametrize("mode,use_drafter,extra", [("speculative", True, {}), ("triforce", True, {}),
                                                    ("triforce", True, DEVICE), ("triforce", True, WHOLE),
                                                    ("speculative", LOOKUP, {})])
def test_wrong_residual_is_caught(models, monkeypatch, mode, use_drafter, extra):
    original = sampling.verify_sampled
    monkeypatch.setattr("triforce.speculative.levels.verify_sampled",
                        lambda *a, **k: original(*a, **k, residual=wrong_residual))
    exact = exact_joint(models[0], Sampler(SETTINGS["temperature"]))
    counts = sample_joint(drafter_of(models, use_drafter), mode, {**SETTINGS, **extra})
    rejects, stat, critical = chi_square_rejects(counts, exact)
    assert rejects, f"a wrong residual went unnoticed (chi-square {stat:.1f} <= {critical:.1f})"


def test_capped_verification_without_its_correction_is_caught(models, monkeypatch):
    """Device rounds verify more positions than the middle level may have made; at that cap the next
    token must come from the target itself, not from the residual against the middle's row there
    (a rejected draft's). Dropping that correction must fail the distribution test."""
    target, drafter = models
    monkeypatch.setattr(sampling, "at_the_cap", lambda q_next, accepted, limit: q_next)
    cfg = {**SETTINGS, **DEVICE}  # one round of 2 drafts: the cap binds whenever the middle rejects one
    exact = exact_joint(target, Sampler(cfg["temperature"]))
    counts = sample_joint(Models(target, drafter), "triforce", cfg)
    rejects, stat, critical = chi_square_rejects(counts, exact)
    assert rejects, f"a stale row at the cap went unnoticed (chi-square {stat:.1f} <= {critical:.1f})"
