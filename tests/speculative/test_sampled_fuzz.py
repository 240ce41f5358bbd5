"""A few fixed draws of sampled_fuzz.py: every token of long sampled runs against the target's exact
conditional law, through rebuilds, evictions and capped rounds; and a planted wrong residual must be
rejected, so the check is known to have teeth."""
import pytest

import triforce.speculative.sampling as sampling

from .sampled_fuzz import ALPHA, Pair, draw, p_value

SEEDS, NEW_TOKENS = 100, 30


def first_draw(**wanted):
    """The first case from seed 57000 on whose fields (or its config's) hold the wanted values (a
    value, a tuple of values, or a test)."""
    for seed in range(57000, 58000):
        case = draw(seed)
        fields = {**case["config"], **case}
        if all(v(fields[k]) if callable(v) else fields[k] in (v if isinstance(v, tuple) else (v,))
               for k, v in wanted.items()):
            return case
    raise LookupError(wanted)


CASES = {
    "triforce, a model drafter, each round one graph": first_draw(mode="triforce", drafter="model", whole_rounds=True),
    "triforce drafting for itself, offloaded, host rounds": first_draw(mode="triforce", drafter="self", offload=True,
                                                                       device_rounds=False),
    "adaptive with lookups": first_draw(adaptive=True, drafter="lookup", mode=("speculative", "triforce")),
    "retrieval, top-k": first_draw(mode="retrieval", top_k=(3, 5)),
    "triforce, a conversation of three answers": first_draw(mode="triforce", drafter=("model", "self"),
                                                            turns=lambda turns: len(turns) == 2),
}


@pytest.fixture(scope="module")
def pair():
    return Pair()


@pytest.mark.parametrize("name", CASES)
def test_every_sampled_token_has_the_targets_law(pair, name):
    p = p_value(CASES[name], pair, SEEDS, NEW_TOKENS)
    assert p is not None, "the engine refused the case's settings"
    assert p > ALPHA, f"{name}: p = {p:.2e} {CASES[name]}"


def test_a_wrong_residual_is_rejected(pair, monkeypatch):
    original = sampling.verify_sampled
    monkeypatch.setattr("triforce.speculative.levels.verify_sampled",
                        lambda *a, **k: original(*a, **k, residual=lambda p, q: p))
    case = first_draw(mode="speculative", drafter="model", verification="token", adaptive=False, temperature=(0.3, 0.6))
    p = p_value(case, pair, SEEDS, NEW_TOKENS)
    assert p is not None and p < ALPHA, f"a wrong residual went unnoticed: p = {p}"
