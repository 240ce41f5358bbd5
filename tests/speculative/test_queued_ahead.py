"""Plain decoding with one full pass queued ahead of the host (engine.Generator._queued_tokens, the
default on a GPU): the same tokens as step() by step(), the same state after a stop, one host read a
token, and the next pass queued before that read."""
import random

import pytest
import torch

from triforce.model.loader import load_model
from triforce.offload import full_cache_factory
from triforce.speculative import GenerationConfig, Generator, Models
from triforce.speculative.adaptive import Chooser, Plan
from triforce.speculative.graphs import enable_cuda_graphs
from triforce.speculative.hostsync import HostSyncCounter
from triforce.speculative.levels import TokenReads

from ..conftest import save_tiny

VOCAB = 24  # few ids: a stop id comes soon, sampled or greedy


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("target")
    save_tiny(folder, seed=4, vocab=VOCAB, layers=2)
    return load_model(folder, torch.float64)


PROMPT = torch.randint(0, VOCAB, (90,), generator=torch.Generator().manual_seed(8)).tolist()
TURN = torch.randint(0, VOCAB, (7,), generator=torch.Generator().manual_seed(9)).tolist()


def generator(target, ahead, temperature, cache, new=24):
    cfg = GenerationConfig(max_new_tokens=new, temperature=temperature, seed=3, queue_ahead=ahead)
    factory = full_cache_factory("cpu", 32, chunk_tokens=5) if cache != "resident" else None
    gen = Generator(Models(target, None), cfg, "autoregressive", len(PROMPT) + 3 * new, full_cache_factory=factory)
    if cache == "offloaded, graphed":  # the graphed pass's view (offload/graphed.py), run eagerly
        enable_cuda_graphs(gen, eager_static=True)
    assert (gen.reads is not None) == ahead
    return gen


def conversation(gen, stop_ids=frozenset()):
    """Two answers with a user turn between them, as a chat runs: the second shows what the first
    left behind (the full cache, the sampler's generator). Each answer is cut where it was shown, as a
    chat cuts it: a round commits past a stop id or the budget."""
    start = len(gen.context) - 1
    first = gen.generate(stop_ids=stop_ids)
    gen.truncate(start + len(first))
    start = len(gen.context) + len(TURN)
    second = [gen.extend(TURN)] + gen.generate(stop_ids=stop_ids)[1:]
    gen.truncate(start + len(second))
    return first, second, gen.full.held, len(gen.context)


CACHES = ["resident", "offloaded", "offloaded, graphed"]


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_queued_ahead_makes_the_tokens_step_makes(target, temperature, cache):
    runs = []
    for ahead in (False, True):
        gen = generator(target, ahead, temperature, cache)
        gen.prefill(PROMPT)
        runs.append(conversation(gen))
    assert runs[0] == runs[1]
    assert len(runs[0][0]) == 24


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_a_stop_leaves_what_step_leaves(target, temperature, cache):
    """A stop id ends an answer with a pass already queued past it: forgotten, the cache and the
    generator stand where step() leaves them, so the next answer is the same too."""
    free = generator(target, False, temperature, cache, new=40)
    free.prefill(PROMPT)
    tokens = free.generate()
    stop = frozenset({tokens[5]})  # a token the answer makes early
    runs = []
    for ahead in (False, True):
        gen = generator(target, ahead, temperature, cache, new=40)
        gen.prefill(PROMPT)
        runs.append(conversation(gen, stop))
    assert runs[0] == runs[1]
    assert len(runs[0][0]) < 40 and runs[0][0][-1] in stop


def watch(gen, monkeypatch, name_pass) -> list:
    """The order of the host's token reads ("read") and the full level's passes (name_pass(end, n_out))."""
    events = []
    read, run = TokenReads.read, gen.full.run
    monkeypatch.setattr(TokenReads, "read", lambda self, slot: (events.append("read"), read(self, slot))[1])
    monkeypatch.setattr(gen.full, "run", lambda seq, end, n_out, progress=None: (
        events.append(name_pass(end, n_out)), run(seq, end, n_out, progress))[1])
    return events


def test_one_host_read_a_token_and_the_next_pass_queued_before_it(target, monkeypatch):
    gen = generator(target, True, 1.0, "offloaded, graphed", new=20)
    gen.prefill(PROMPT)
    events = watch(gen, monkeypatch, lambda end, n_out: ("pass", end))
    with HostSyncCounter() as counter:
        out = gen.generate()
    assert len(out) == 20 and counter.total == 19  # the first token came from prefill
    c = len(PROMPT) + 1
    # the passes for the first two tokens, then each read followed by the next pass but the last two
    expected = [("pass", c), ("pass", c + 1)]
    for i in range(2, 19):
        expected += ["read", ("pass", c + i)]
    expected += ["read", "read"]
    assert events == expected


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_an_interrupted_answer_leaves_what_step_leaves(target, temperature):
    """Ctrl-C inside an answer (here raised by the token callback, as a chat's display would see it):
    the pass queued ahead is forgotten at once, before the caller truncates and goes on."""
    runs = []
    for ahead in (False, True):
        gen = generator(target, ahead, temperature, "offloaded, graphed")
        gen.prefill(PROMPT)
        seen = []

        def show(new, levels):
            seen.extend(new)
            if len(seen) == 6:
                raise KeyboardInterrupt

        try:
            gen.generate(on_tokens=show)
        except KeyboardInterrupt:  # as a chat handles it: the traceback, and generate's frame, still alive
            gen.truncate(len(gen.context) - 2)
        runs.append((seen, conversation(gen)))
    assert runs[0] == runs[1]


# ------------------------------------------------------------------------------ adaptive runs


def plain_or_random(monkeypatch, seed: int) -> None:
    """The chooser picks plain decoding two passes in three, else any plan: runs of plain passes
    queued ahead, between rounds of every mode (whichever the timings would have chosen)."""
    rng = random.Random(seed)
    monkeypatch.setattr(Chooser, "_choose", lambda self: Plan("autoregressive", 0) if rng.random() < 0.67
                        else rng.choice(self.plans))


def adaptive(target, ahead, temperature, cache, new=40, device_rounds=False):
    """An adaptive run over triforce's levels, the target drafting for itself."""
    cfg = GenerationConfig(max_new_tokens=new, temperature=temperature, seed=3, queue_ahead=ahead, adaptive=True,
                           budget=32, chunk_size=8, gamma1=2, gamma2=4, draft_window=16, sink_tokens=4,
                           device_rounds=device_rounds)
    factory = full_cache_factory("cpu", 32, chunk_tokens=5) if cache != "resident" else None
    gen = Generator(Models(target, None), cfg, "triforce", len(PROMPT) + 3 * new, full_cache_factory=factory)
    if cache == "offloaded, graphed":
        enable_cuda_graphs(gen, eager_static=True)
    assert gen.chooser is not None and (gen.reads is not None) == ahead
    return gen


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("device_rounds", [False, True], ids=["host rounds", "device rounds"])
def test_adaptive_queued_ahead_makes_plain_decodings_tokens(target, monkeypatch, cache, device_rounds):
    """Greedy in float64: two answers with a turn between them, and answers cut by a stop id, are
    plain decoding's tokens, with plain passes queued ahead between rounds of every mode."""
    plain = generator(target, False, 0.0, "resident", new=40)
    plain.prefill(PROMPT)
    reference = conversation(plain)[:2]
    stop = frozenset({max(reference[0][1:], key=reference[0].index)})  # the one that comes last
    stopped = generator(target, False, 0.0, "resident", new=40)
    stopped.prefill(PROMPT)
    reference_stopped = conversation(stopped, stop)[:2]
    plain_or_random(monkeypatch, seed=len(cache))
    for stop_ids, expected in ((frozenset(), reference), (stop, reference_stopped)):
        gen = adaptive(target, True, 0.0, cache, device_rounds=device_rounds)
        ran = {"queued": 0, "rounds": 0}
        queue_pass, step = gen._queue_pass, gen.step
        gen._queue_pass = lambda c: (ran.__setitem__("queued", ran["queued"] + 1), queue_pass(c))[1]
        gen.step = lambda plan=None: (ran.__setitem__("rounds", ran["rounds"] + 1), step(plan))[1]
        gen.prefill(PROMPT)
        assert conversation(gen, stop_ids)[:2] == expected
        # plain passes queued, other modes' rounds (a stop id may come after a token or two)
        assert stop_ids or (ran["queued"] >= 10 and ran["rounds"] >= 5), ran
        assert sum(gen.stats.modes.values()) == gen.stats.full_passes  # the passes queued past a stop uncounted


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_adaptive_queued_ahead_survives_an_interrupted_answer(target, monkeypatch, temperature):
    """Ctrl-C with a plain pass queued: the answer goes on after truncate() as a chat's would, with a
    seed's tokens the same run after run (sampled) and plain decoding's (greedy)."""
    runs = []
    for _ in range(2):
        plain_or_random(monkeypatch, seed=5)
        gen = adaptive(target, True, temperature, "offloaded, graphed")
        gen.prefill(PROMPT)
        seen = []

        def show(new, levels):
            seen.extend(new)
            if len(seen) >= 6:
                raise KeyboardInterrupt

        try:
            gen.generate(on_tokens=show)
        except KeyboardInterrupt:
            gen.truncate(len(gen.context) - 2)
        runs.append((seen, conversation(gen)[:2]))
    assert runs[0] == runs[1]
    if temperature == 0.0:
        plain = generator(target, False, 0.0, "resident", new=40)
        plain.prefill(PROMPT)
        assert runs[0][0][:6] == plain.generate()[:6]


def test_adaptive_plain_passes_are_queued_before_the_last_token_is_read(target, monkeypatch):
    """The chooser's plans, scripted: three plain passes, a retrieval round, plain passes. Each plain
    pass but a run's first is queued before the token of the one before it is read; the retrieval
    round starts with nothing in flight, the retrieval cache caught up on the plain tokens first."""
    script = [Plan("autoregressive", 0)] * 3 + [Plan("retrieval", 2)]
    monkeypatch.setattr(Chooser, "_choose", lambda self: script[self.passes] if self.passes < len(script)
                        else Plan("autoregressive", 0))
    gen = adaptive(target, True, 0.0, "offloaded, graphed", new=9)  # the first from prefill
    gen.prefill(PROMPT)
    events = watch(gen, monkeypatch, lambda end, n_out: ("pass", n_out))
    absorb = gen.middle.cache.absorb
    monkeypatch.setattr(gen.middle.cache, "absorb", lambda full, n: (events.append(("absorb", n)), absorb(full, n))[1])
    with HostSyncCounter() as counter:
        out = gen.generate()
    c = len(PROMPT) + 1  # the first generated token's position
    assert len(out) == 9 and out == gen.context[c - 1:]
    rest = gen.stats.modes["autoregressive"] - 3  # plain tokens after the retrieval round
    made = 8 - 3 - rest  # the retrieval round's
    assert 1 <= made <= 3
    plain = [("pass", 1)] + [("pass", 1), "read"] * (rest - 1) + ["read"]
    assert events == [("pass", 1), ("pass", 1), "read", ("pass", 1), "read",  # retrieval chosen: no pass queued
                      "read", ("absorb", c + 2),  # the middle level takes in the three plain tokens
                      ("pass", 3),  # retrieval's verification (the middle level's passes are its own)
                      ("absorb", c + 2 + made)] + plain  # the plain tokens wait for the next round
    assert gen.stats.modes == {"autoregressive": 3 + rest, "retrieval": 1}
    # a read a token for the plain passes, one for the retrieval round (its middle passes read nothing),
    # and the catch-up's wait for the store (on a GPU: for copies that landed before the last read)
    assert counter.by_site == {"__int__": 3 + rest, "tolist": 1, "offload write-back wait": 1}
