"""bench.kernels: kernels per layer of one pass, as the difference between two layer counts. Eager ops
per layer come out a whole number, the same between any two depths; the compiled graph runs fewer
kernels per layer than eager dispatches ops, with norm, RoPE and SiLU*up fused, and a verification
pass builds its causal mask once, not per layer."""
import pytest
import torch

from bench import kernels

GAMMA1, GAMMA2 = 2, 3  # verification passes of T = 3 and 4: small graphs to compile


@pytest.fixture(scope="module")
def generators():
    """Prefilled triforce generators by (layers, kind)."""
    made = {}

    def get(layers: int, kind: str):
        if (layers, kind) not in made:
            made[layers, kind] = kernels.prefilled(kernels.tiny_target(layers, hidden=32), GAMMA1, GAMMA2, kind)
        return made[layers, kind]
    return get


def per_layer(count, generators, kind, level, T, a, b):
    return kernels.per_layer(count(generators(a, kind), level, T), count(generators(b, kind), level, T), (a, b))


def test_passes_of_each_mode():
    passes = kernels.mode_passes(4, 6)
    assert passes[("verify", 1)] == ["autoregressive"]
    assert passes[("verify", 7)] == ["retrieval", "triforce"]
    assert passes[("middle", 5)] == ["triforce"] and passes[("draft", 1)] == ["speculative", "triforce"]


@pytest.mark.parametrize("level,T", [("draft", 1), ("verify", GAMMA2 + 1)])
def test_eager_ops_per_layer_whole_and_depth_independent(generators, level, T):
    first = per_layer(kernels.eager_ops, generators, "eager", level, T, 2, 4)
    second = per_layer(kernels.eager_ops, generators, "eager", level, T, 4, 6)
    assert first == second and first == int(first) > 0


def test_mask_built_once_per_pass_not_per_layer(generators):
    T = GAMMA2 + 1
    for kind in ("eager", "static"):  # the caches' own path; the compiled graph's source
        small, large = (kernels.eager_ops(generators(n, kind), "verify", T) for n in (2, 4))
        builds = kernels.mask_builds(small, large, (2, 4))
        assert builds["per_layer"] == 0, kind
    assert builds["per_pass"] == 1  # the static view's, in its begin(); attention.py's is cached per shape


def test_compiled_fewer_kernels_per_layer_and_fused(generators):
    T = GAMMA2 + 1
    with kernels.compile_settings():
        small, large = (kernels.graph_kernels(generators(n, "compiled"), "verify", T) for n in (3, 5))
    compiled = kernels.per_layer(small, large, (3, 5))
    eager = per_layer(kernels.eager_ops, generators, "eager", "verify", T, 2, 4)
    assert compiled == int(compiled) > 0 and compiled < eager / 4
    assert kernels.fusions(large) == {"rmsnorm": True, "rope": True, "silu_mul": True}
    assert kernels.mask_kernels(large) == 1  # one per pass, of any depth
    torch._dynamo.reset()
