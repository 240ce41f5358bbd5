"""A fixed draw of random engine settings (settings_fuzz.py): greedy cases make autoregressive's
tokens, sampled ones run to their budget, refused ones say why (UserError)."""
import pytest

from .settings_fuzz import TinyModels, check, draw

CASES = 100


@pytest.fixture(scope="module")
def models_of():
    return TinyModels()


@pytest.mark.parametrize("seed", range(CASES))
def test_random_settings_keep_autoregressive_tokens(models_of, seed):
    case = draw(570000 + seed)
    problem = check(case, models_of)
    assert problem is None, f"{case}\n{problem}"
