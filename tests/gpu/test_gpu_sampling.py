"""Sampled output has the target's distribution on the GPU path: passes captured as CUDA graphs,
device rounds, the full cache resident or in host memory (its passes captured with their copies).

tests/speculative/test_sampling.py checks the logic on CPU, where every tensor a call returns is new.
A captured graph returns the same output buffers on every replay, so a distribution kept from one
pass and overwritten by the next would go unnoticed there, and would show on a GPU only as lower
sampled acceptance (the H200's sampled middle->verify acceptance at 32K was 0.55 against this CPU's
0.72-0.82, with greedy agreement the same). One generator per case, resumed from its own prefill for
each of 2,000 seeds (captured once), samples the two tokens after the prefill's; a chi-square test
against their exact law (the target run on every prefix) must accept, and a wrong residual must be
rejected. On CPU the same engine runs its graphs' static views eagerly (a rehearsal of the CUDA case).
Compiled passes (--compile: inductor's kernels captured as CUDA graphs) are checked on CUDA too; on
CPU test_compiled.py shows a compiled round drawing what the eager one draws, uniform for uniform.
"""
import pytest
import torch

import triforce.speculative.sampling as sampling
from triforce.model.loader import load_model
from triforce.offload import full_cache_factory
from triforce.speculative import GenerationConfig, Generator, Models
from triforce.speculative.caches import FullCache
from triforce.speculative.graphs import enable_compiled_passes, enable_cuda_graphs
from triforce.speculative.sampling import Sampler

from ..conftest import save_tiny
from ..speculative.test_sampling import PROMPT, VOCAB, chi_square_rejects, wrong_residual

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")
pytestmark = pytest.mark.gpu
SEEDS = 2000
# two rounds per full pass (device rounds of 2 drafts), six positions verified by block
CFG = GenerationConfig(max_new_tokens=3, temperature=0.3, budget=16, chunk_size=4, gamma1=2, gamma2=6,
                       draft_window=8, sink_tokens=2, device_rounds=True, prefill_chunk=16)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    t, d = tmp_path_factory.mktemp("t"), tmp_path_factory.mktemp("d")
    save_tiny(t, seed=21, vocab=VOCAB, hidden=16, layers=1, heads=2, kv_heads=1, inter=24)
    save_tiny(d, seed=22, vocab=VOCAB, hidden=16, layers=1, heads=2, kv_heads=1, inter=24)
    return t, d


def exact_after(target, first: int, sampler: Sampler) -> torch.Tensor:
    """P(t2, t3 | the prompt, t1 = first) as a (V, V) table, from the target on every prefix."""
    def next_dist(seq):
        logits = target(torch.tensor(seq), FullCache(target.kv_shape(), len(seq)), last_only=True)
        return sampler.probs(logits)[0].double()

    head = PROMPT + [first]
    p2 = next_dist(head)
    return torch.stack([p2[t2] * next_dist(head + [t2]) for t2 in range(VOCAB)])


def sampled_after(folders, device: str, mode: str, offload: str, compiled: bool = False) -> tuple[int, torch.Tensor]:
    """(the prefill's token, counts of the next two over SEEDS resumed runs of one generator); with
    `compiled`, its passes and rounds torch.compile'd (on CUDA captured), as --compile runs them."""
    target, drafter = (load_model(f, torch.float32, device) for f in folders)
    factory = full_cache_factory(device, CFG.prefill_chunk, onchip_layers=0, chunk_tokens=7) if offload == "host" else None
    gen = Generator(Models(target, drafter if mode == "triforce" else None), CFG, mode, len(PROMPT) + 8,
                    full_cache_factory=factory)
    if compiled:
        enable_compiled_passes(gen)
    else:
        enable_cuda_graphs(gen, eager_static=device == "cpu")
    gen.prefill(PROMPT)
    start = gen.snapshot()
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for seed in range(SEEDS):
        gen.resume(start.prompt, start.queries, start.first)
        gen.sampling.generator.manual_seed(seed)
        tokens = gen.generate()
        counts[tokens[1], tokens[2]] += 1
    return start.first, counts


DEVICES = ["cpu", pytest.param("cuda", marks=cuda)]
# on CPU the resident case is test_sampling.py's; the store in host memory is rehearsed here
PLACES = [("cpu", "host"), pytest.param("cuda", "none", marks=cuda), pytest.param("cuda", "host", marks=cuda)]


@pytest.mark.parametrize("device,offload", PLACES)
@pytest.mark.parametrize("mode", ["retrieval", "triforce"])
def test_sampled_output_has_the_targets_distribution_on_the_gpu_path(folders, device, offload, mode):
    first, counts = sampled_after(folders, device, mode, offload)
    exact = exact_after(load_model(folders[0], torch.float64), first, Sampler(CFG.temperature))
    rejects, stat, critical = chi_square_rejects(counts, exact)
    assert not rejects, f"chi-square {stat:.1f} > {critical:.1f}: {mode} ({offload}) on {device} is not the target's law"


@cuda
@pytest.mark.parametrize("mode", ["retrieval", "triforce"])
def test_compiled_sampled_output_has_the_targets_distribution_on_cuda(folders, mode):
    """The next lease's `compiled kv host sampled` step (fixed triforce and retrieval compiled, the KV
    in host memory): its tokens must follow the target's law before its speed counts."""
    first, counts = sampled_after(folders, "cuda", mode, "host", compiled=True)
    exact = exact_after(load_model(folders[0], torch.float64), first, Sampler(CFG.temperature))
    rejects, stat, critical = chi_square_rejects(counts, exact)
    assert not rejects, f"chi-square {stat:.1f} > {critical:.1f}: compiled {mode} (host) on cuda is not the target's law"


@pytest.mark.parametrize("device", DEVICES)
def test_a_wrong_residual_is_caught_on_the_gpu_path(folders, device, monkeypatch):
    original = sampling.verify_sampled
    monkeypatch.setattr("triforce.speculative.levels.verify_sampled",
                        lambda *a, **k: original(*a, **k, residual=wrong_residual))
    first, counts = sampled_after(folders, device, "triforce", "host")
    exact = exact_after(load_model(folders[0], torch.float64), first, Sampler(CFG.temperature))
    rejects, stat, critical = chi_square_rejects(counts, exact)
    assert rejects, f"a wrong residual went unnoticed (chi-square {stat:.1f} <= {critical:.1f})"
