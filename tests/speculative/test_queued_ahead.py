"""Plain decoding with one full pass queued ahead of the host (engine.Generator._queued_tokens, the
default on a GPU): the same tokens as step() by step(), the same state after a stop, one host read a
token, and the next pass queued before that read."""
import pytest
import torch

from triforce.model.loader import load_model
from triforce.offload import full_cache_factory
from triforce.speculative import GenerationConfig, Generator, Models
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
    left behind (the full cache, the sampler's generator)."""
    first = gen.generate(stop_ids=stop_ids)
    second = [gen.extend(TURN)] + gen.generate(stop_ids=stop_ids)[1:]
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


def test_one_host_read_a_token_and_the_next_pass_queued_before_it(target, monkeypatch):
    gen = generator(target, True, 1.0, "offloaded, graphed", new=20)
    gen.prefill(PROMPT)
    events = []
    read, run = TokenReads.read, gen.full.run

    def reading(self, slot):
        events.append("read")
        return read(self, slot)

    def running(seq, end, n_out, progress=None):
        events.append(("pass", end))
        return run(seq, end, n_out, progress)

    monkeypatch.setattr(TokenReads, "read", reading)
    monkeypatch.setattr(gen.full, "run", running)
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
