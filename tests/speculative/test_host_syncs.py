"""The host waits for the device once per full-cache round (issue 22).

Counted on CPU at the call sites where a GPU host would wait (triforce/speculative/hostsync.py):
synchronize(), reads of tensor values (item, tolist, cpu, numpy, bool/int/float/index) and
torch.tensor(list). Before issue 22 a round paid 4 per pass of every level (autoregressive 4.0,
speculative 20.0, retrieval 28.0, triforce 72.0 greedy at gamma1 4, gamma2 6 in this setting);
now every mode pays the one read of the round's tokens; triforce with host-driven rounds (the CPU
default) one more per middle-level pass (its acceptance decides where the drafter goes next), with
device rounds (rounds.py, the GPU default) none. With the full cache offloaded, a round that
rebuilds the retrieval cache also waits for the write-backs before reading the host store, two per
layer; an absorb reads the last pass's K/V where it left them on the device and waits for nothing
(through a graph, the single-GPU default, since session 37; eagerly - tensor parallelism,
--no-cuda-graphs - since session 38, where it waited once). Counted here so they cannot grow.
"""
import itertools

import pytest
import torch

import triforce.speculative.engine as engine
from triforce.model.loader import load_model
from triforce.offload import full_cache_factory
from triforce.speculative import GenerationConfig, Generator, Models
from triforce.speculative.graphs import enable_cuda_graphs
from triforce.speculative.hostsync import HostSyncCounter

from ..conftest import save_tiny


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("target")
    save_tiny(folder, seed=11, vocab=48, layers=2)
    target, drafter = load_model(folder, torch.float32), load_model(folder, torch.float32)
    with torch.no_grad():  # a drafter close to the target: drafts are partly accepted
        for p in drafter.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(5)))
    return target, drafter


PROMPT = torch.randint(0, 48, (150,), generator=torch.Generator().manual_seed(3)).tolist()


def rounds(pair, mode, temperature, offload, adaptive=False, device_rounds=False, cycle=()):
    """[(host waits besides the offload's, middle-level verifications)] for each full-cache round of
    a generation, and the entry points seen. Checks the offload's own waits on the way. `cycle`:
    modes an adaptive run takes in turn, each at its longest gamma (instead of by timings)."""
    cfg = GenerationConfig(max_new_tokens=40, budget=64, chunk_size=8, gamma1=4, gamma2=6, draft_window=32,
                           sink_tokens=4, temperature=temperature, adaptive=adaptive,
                           device_rounds=bool(device_rounds))
    factory = full_cache_factory("cpu", 64, chunk_tokens=7) if offload else None
    gen = Generator(Models(*pair), cfg, mode, len(PROMPT) + 64, full_cache_factory=factory)
    if device_rounds == "whole":  # each drafter->middle round one graph (run eagerly on CPU)
        enable_cuda_graphs(gen, eager_static=True)
    if cycle:
        turns = itertools.cycle(cycle)
        gen.chooser._choose = lambda: gen.chooser.longest(next(turns))
    gen.prefill(PROMPT)
    out, layers = [], pair[0].kv_shape().num_layers
    with HostSyncCounter() as counter:
        while len(gen.context) < len(PROMPT) + cfg.max_new_tokens:
            waits, middle, triforce = counter.total, gen.stats.passes["middle"], gen.stats.modes["triforce"]
            offload_waits, rebuilds = counter.by_site["offload write-back wait"], gen.stats.rebuilds
            gen.step()
            offload_waits = counter.by_site["offload write-back wait"] - offload_waits
            # the retrieval upkeep reads the host store twice per layer on a rebuild; an absorb reads
            # the device, eager or graphed
            upkeep = 2 * layers if offload and gen.middle is not None and gen.stats.rebuilds > rebuilds else 0
            assert offload_waits == upkeep
            # the middle level verifies only in a triforce round (in a retrieval round it drafts)
            verifying = mode == "triforce" and (not adaptive or gen.stats.modes["triforce"] > triforce)
            middle = gen.stats.passes["middle"] - middle if verifying else 0
            out.append((counter.total - waits - offload_waits, middle))
        sites = set(counter.by_site) - {"offload write-back wait"}
    return out, sites


@pytest.mark.parametrize("offload", [False, True], ids=["resident", "offloaded"])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
@pytest.mark.parametrize("mode", ["autoregressive", "speculative", "retrieval"])
def test_one_wait_per_round(pair, mode, temperature, offload):
    per_round, sites = rounds(pair, mode, temperature, offload)
    assert len(per_round) > 5
    assert [w for w, _ in per_round] == [1] * len(per_round)
    assert sites == {"tolist"}  # the round's tokens, read together


@pytest.mark.parametrize("offload", [False, True], ids=["resident", "offloaded"])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
@pytest.mark.parametrize("device_rounds", [True, "whole"], ids=["pass-by-pass", "whole-rounds"])
def test_triforce_device_rounds_wait_once_per_round(pair, temperature, offload, device_rounds):
    """Drafter->middle rounds on the device (rounds.py, the GPU default): one read per full-cache round
    however many middle passes it made, whether each pass or each whole round is one graph."""
    per_round, sites = rounds(pair, "triforce", temperature, offload, device_rounds=device_rounds)
    assert [w for w, _ in per_round] == [1] * len(per_round)
    assert any(m > 1 for _, m in per_round) and sites == {"tolist"}


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_triforce_host_rounds_wait_once_per_round_and_once_per_middle_pass(pair, temperature):
    """The host-driven rounds (the CPU default, where a read costs nothing) read each middle pass's
    acceptance to place the next drafts."""
    per_round, sites = rounds(pair, "triforce", temperature, False, device_rounds=False)
    assert [w for w, _ in per_round] == [1 + m for _, m in per_round]
    assert all(m >= 1 for _, m in per_round) and sites == {"tolist", "__int__"}


@pytest.mark.parametrize("device_rounds", [False, True], ids=["host-rounds", "device-rounds"])
def test_adaptive_rounds_wait_as_their_mode_does(pair, device_rounds):
    per_round, _ = rounds(pair, "triforce", 0.0, False, adaptive=True, device_rounds=device_rounds,
                          cycle=("triforce", "autoregressive", "retrieval", "triforce", "speculative"))
    assert [w for w, _ in per_round] == [1 + (0 if device_rounds else m) for _, m in per_round]
    assert any(m == 0 for _, m in per_round) and any(m > 0 for _, m in per_round)  # modes were mixed


def test_the_counter_sees_each_kind_of_wait():
    """The counts above can fail: every entry point counts, a read inside a read counts once, and
    nothing counts once the counter is gone."""
    x = torch.arange(3)
    with HostSyncCounter() as counter:
        x.tolist(), x[0].item(), bool(x[1]), int(x[1]), float(x[1]), x.cpu(), x.numpy(), [0, 1][x[1]]
        torch.tensor([1, 2]), torch.as_tensor((1, 2)), torch.tensor(3)  # the last one is not a list
        engine.synchronize(torch.device("cpu"))
        with counter.paused():
            x.tolist()
    assert dict(counter.by_site) == {"tolist": 1, "item": 1, "__bool__": 1, "__int__": 1, "__float__": 1,
                                     "cpu": 1, "numpy": 1, "__index__": 1, "tensor(list)": 2, "synchronize": 1}
    x.tolist()
    assert counter.total == 11
