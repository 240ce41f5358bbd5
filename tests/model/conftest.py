"""Fixtures of the model's tests."""
import pytest

from triforce.model import decode_attention


@pytest.fixture(params=["tiles", "avx512"])
def products(request):
    """Each path the products can take in a process: AMX tiles (where the CPU has them) and the avx512
    kernels; the process's own choice comes back after the test."""
    before = decode_attention.tiles()
    if not decode_attention.switch_tiles(request.param == "tiles") and request.param == "tiles":
        decode_attention.switch_tiles(before)
        pytest.skip("no AMX tiles here: the avx512 kernels serve every row count")
    yield request.param
    decode_attention.switch_tiles(before)
