"""A fixed draw of random engine settings under two gloo ranks (tp_fuzz.py): each case's tokens on
both ranks are one process's (autoregressive's where greedy), refusals alike; a planted fault (the
row-parallel sums skipped) fails most cases."""
import pytest

from ..speculative.settings_fuzz import TinyModels
from .tp_fuzz import compare, run_ranks

SEEDS = [580000 + i for i in range(40)]


@pytest.fixture(scope="module")
def models_of():
    return TinyModels()


@pytest.fixture(scope="module")
def ranks(models_of):
    return run_ranks(SEEDS, models_of)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_settings_under_tp2_are_one_process(ranks, models_of, seed):
    problem = compare(seed, ranks, models_of)
    assert problem is None, problem


def test_a_planted_fault_is_found(models_of):
    seeds = SEEDS[:8]
    ranks = run_ranks(seeds, models_of, fault=True)
    assert all(sorted(r) == seeds for r in ranks), ranks  # every case ran on both ranks, to its end
    assert not any(isinstance(o, str) and o.startswith("error: ") for r in ranks for o in r.values()), ranks
    refused = [seed for seed in seeds if isinstance(ranks[0][seed], str)]
    failed = [seed for seed in seeds if compare(seed, ranks, models_of)]
    assert len(failed) == len(seeds) - len(refused) >= 5, (failed, refused)
