"""--compile: every level's small passes as one torch.compile'd graph each (fullgraph, so a graph
break fails the test instead of slowing the run), with the same tokens as eager decoding."""
import pytest
import torch

from triforce.model.loader import load_model
from triforce.speculative import GenerationConfig, Generator, Models
from triforce.speculative.graphs import enable_compiled_passes

from ..conftest import save_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("compiled")
    save_tiny(folder, seed=1, vocab=64, layers=2, hidden=32, heads=4, kv_heads=2, inter=48)
    return Models(load_model(folder, torch.float32), None)


@pytest.mark.parametrize("device_rounds", [False, True], ids=["host-rounds", "device-rounds"])
def test_compiled_levels_decode_the_eager_tokens(tiny, device_rounds):
    """With device rounds (rounds.py) the drafter and the middle level replay graphs of views whose
    slots and positions follow a device tensor: one graph per pass shape covers every round."""
    ids = [3 + (i * 7) % 60 for i in range(300)]
    cfg = GenerationConfig(max_new_tokens=24, budget=64, chunk_size=8, gamma1=2, gamma2=3, device_rounds=device_rounds)
    eager = Generator(tiny, cfg, "triforce", max_len=400)
    eager.prefill(ids)
    compiled = Generator(tiny, cfg, "triforce", max_len=400)
    wrappers = enable_compiled_passes(compiled)
    compiled.prefill(ids)
    assert compiled.generate() == eager.generate()
    # the drafter, the middle level and the full cache each ran compiled graphs, one per pass shape
    assert all(w.compiled for w in wrappers) and len(wrappers) == 3 and compiled.full.model.replays > 0
    if not device_rounds:
        assert compiled.drafter.model.replays > 24 and compiled.middle.model.replays >= 12
    else:  # each drafter->middle round one compiled graph (rounds.RoundGraph), compiled once
        graph = compiled.proposers["triforce"][0].graph
        assert graph.runs >= 12 and graph.builds == 1 and compiled.stats.passes["draft+middle"] >= 12


@pytest.mark.parametrize("lookup", [False, True], ids=["self-drafter", "lookup"])
def test_a_compiled_round_draws_what_the_eager_round_draws(tiny, lookup):
    """Sampled: a whole drafter->middle round compiled as one graph takes the same uniforms as the same
    round run eagerly (graphs.enable_cuda_graphs with eager_static), and makes the same tokens; with
    drafts looked up in the sequence (lookup.py) the lookup is inside the graph."""
    from triforce.speculative.graphs import enable_cuda_graphs
    from triforce.speculative.lookup import LookupDrafter

    models = Models(tiny.target, LookupDrafter()) if lookup else tiny

    ids = [3 + (i * 7) % 60 for i in range(300)]
    cfg = GenerationConfig(max_new_tokens=24, budget=64, chunk_size=8, gamma1=2, gamma2=3, device_rounds=True,
                           temperature=0.8, top_p=0.9, seed=4, adaptive=False)
    tokens = []
    for enable in (lambda g: enable_cuda_graphs(g, eager_static=True), enable_compiled_passes):
        gen = Generator(models, cfg, "triforce", max_len=400)
        enable(gen)
        gen.prefill(ids)
        tokens.append(gen.generate())
        graph = gen.proposers["triforce"][0].graph
        assert graph.runs > 0 and (enable is not enable_compiled_passes or graph.builds == 1)
    assert tokens[0] == tokens[1]


def test_compiled_passes_over_a_16_bit_cache_under_float32(tmp_path):
    """--compile with float32 compute and a float16 KV cache (model/kv_dtype.py) failed in attention
    (the static view wrote float32 keys into the 16-bit buffers and attended in mixed dtypes)."""
    save_tiny(tmp_path, seed=1, vocab=64, layers=2, hidden=32, heads=4, kv_heads=2, inter=48)
    target = load_model(tmp_path, torch.float32)
    target.kv_dtype = torch.float16
    ids = [3 + (i * 7) % 60 for i in range(300)]
    cfg = GenerationConfig(max_new_tokens=16, budget=64, chunk_size=8, gamma1=2, gamma2=3)
    eager = Generator(Models(target, None), cfg, "triforce", max_len=400)
    eager.prefill(ids)
    compiled = Generator(Models(target, None), cfg, "triforce", max_len=400)
    enable_compiled_passes(compiled)
    compiled.prefill(ids)
    assert compiled.full.cache.k.dtype == torch.float16
    assert compiled.generate() == eager.generate()


def test_a_compiled_pass_writes_its_slots_in_place(tmp_path):
    """A compiled pass writes its tokens' K/V into the cache in place. Written through a view of the
    one (layers, heads, slots, dim) buffer, inductor copied a layer's whole cache at every layer: on
    SmolLM2 at 4K a pass took 1 s instead of 17 ms. No generated loop may span a layer's buffer
    (the attention reads it through a library call)."""
    from torch._inductor.utils import run_and_get_code

    from triforce.speculative.caches import FullCache
    from triforce.speculative.graphs import HOT_AFTER, GraphedModel

    save_tiny(tmp_path, seed=1, vocab=64, layers=3, hidden=32, heads=2, kv_heads=1, inter=48)
    model = load_model(tmp_path, torch.float32)
    cache = FullCache(model.kv_shape(), 1000, prefill_chunk=64)
    model(torch.arange(60) + 3, cache)
    compiled = GraphedModel(model, eager_static=True, compiled=True)
    torch._dynamo.reset()
    for _ in range(HOT_AFTER - 1):  # eager until the width is hot
        compiled(torch.tensor([5]), cache)
    _, code = run_and_get_code(lambda: compiled(torch.tensor([5]), cache))
    layer = cache.k[0].numel()
    assert code and not any(f"<static_cast<int64_t>({layer}L)" in c for c in code)
    assert cache.length == 60 + HOT_AFTER


def compiled_beside_eager(tmp_path, seed: int):
    """A tiny float64 model, two full caches holding the same 40 tokens, and the model compiled."""
    from triforce.speculative.caches import FullCache
    from triforce.speculative.graphs import GraphedModel

    save_tiny(tmp_path, seed=seed, vocab=64, layers=2, hidden=32, heads=2, kv_heads=1, inter=48)
    model = load_model(tmp_path, torch.float64)
    cache, reference = (FullCache(model.kv_shape(), 200, prefill_chunk=64) for _ in range(2))
    for c in (cache, reference):
        model(torch.arange(40) + 3, c)
    compiled = GraphedModel(model, eager_static=True, compiled=True)
    torch._dynamo.reset()
    return model, cache, reference, compiled


def test_a_width_is_compiled_only_once_it_recurs(tmp_path):
    """A level catching up on tokens it did not see feeds widths that may never recur: they run
    eagerly; a width called HOT_AFTER times is compiled once (and that call is not a cost sample),
    and every pass gives the eager model's logits (within float32-level rounding)."""
    from triforce.speculative.graphs import HOT_AFTER

    model, cache, reference, compiled = compiled_beside_eager(tmp_path, seed=2)
    widths = [7, 5] + [1] * (HOT_AFTER + 2)
    for i, T in enumerate(widths):
        tokens = (torch.arange(T) * 3 + i) % 60 + 3
        torch.testing.assert_close(compiled(tokens, cache), model(tokens, reference), rtol=1e-5, atol=1e-6)
    assert compiled.captures == 1 and [key[1] for key in compiled.views] == [1]
    assert compiled.replays == 3  # the third call of width 1 and the two after it


def test_a_watched_pass_runs_eagerly(tiny):
    """The prefill's progress bar hooks every layer (cli.progress.watch_layers); a drafter's window
    prefill inside it made passes small enough to be compiled, and the compiled graph traced the
    hooks (`generate --compile` failed on time.perf_counter). Watched passes run eagerly."""
    from triforce.cli.progress import watch_layers

    class Advance:
        layers = 0

        def layer(self, *args):
            self.layers += 1

    ids = [3 + (i * 7) % 60 for i in range(300)]
    cfg = GenerationConfig(max_new_tokens=8, budget=64, chunk_size=8, gamma1=2, gamma2=3, draft_window=16,
                           sink_tokens=4)
    gen = Generator(Models(tiny.target, None), cfg, "triforce", max_len=400)  # the target drafts for itself
    enable_compiled_passes(gen)
    advance = Advance()
    with watch_layers(gen.full.model, advance):
        gen.prefill(ids)
    assert advance.layers > 0 and len(gen.generate()) == 8


def test_models_of_one_cache_shape_are_never_served_each_others_graph(tmp_path):
    """compile_static drops dynamo's guards on the model (thousands: 0.66 ms a call). Two models whose
    caches have one shape but whose layers differ (hidden and MLP widths) would then pass each other's
    guards if their passes shared a code object; each pass has its own, so each runs its own graph."""
    from triforce.speculative.caches import FullCache
    from triforce.speculative.graphs import HOT_AFTER, GraphedModel

    torch._dynamo.reset()
    for i, (hidden, heads, inter) in enumerate(((32, 4, 48), (48, 6, 80))):
        folder = tmp_path / str(i)
        save_tiny(folder, seed=i, vocab=64, layers=2, hidden=hidden, heads=heads, kv_heads=2, inter=inter)
        model = load_model(folder, torch.float64)
        cache, reference = (FullCache(model.kv_shape(), 200, prefill_chunk=64) for _ in range(2))
        for c in (cache, reference):
            model(torch.arange(40) + 3, c)
        compiled = GraphedModel(model, eager_static=True, compiled=True)
        for step in range(HOT_AFTER + 1):
            tokens = torch.tensor([3 + step])
            torch.testing.assert_close(compiled(tokens, cache), model(tokens, reference), rtol=1e-5, atol=1e-6)
        assert compiled.replays == 2  # compiled at the third call, replayed at the fourth


def test_a_static_view_hands_the_cpu_kernels_the_16_bit_cache(tmp_path, monkeypatch):
    """The static view widened a 16-bit layer to float32 before attending, though the CPU attention reads
    16-bit keys itself: a float32 copy of every layer each pass (compiled on avx2, SmolLM2 at 4K: 6 ms
    of a 15 ms token, 2x eager at 16K). The view passes the cache as it is, and attends as the eager
    path does."""
    import triforce.speculative.graphs as graphs
    from triforce.speculative.caches import FullCache

    seen = []

    def recording(q, keys, values, *rest):
        seen.append((keys.dtype, values.dtype))
        return attend_masked(q, keys, values, *rest)

    from triforce.model.attention import attend_masked
    monkeypatch.setattr(graphs, "attend_masked", recording)
    save_tiny(tmp_path, seed=1, vocab=64, layers=2, hidden=32, heads=4, kv_heads=2, inter=48)
    model = load_model(tmp_path, torch.float32)
    model.kv_dtype = torch.float16
    cache, reference = (FullCache(model.kv_shape(), 200, prefill_chunk=64) for _ in range(2))
    for c in (cache, reference):
        model(torch.arange(40) + 3, c)
    static = graphs.GraphedModel(model, eager_static=True)
    tokens = torch.tensor([9])
    torch.testing.assert_close(static(tokens, cache), model(tokens, reference), rtol=1e-5, atol=1e-5)
    assert seen == [(torch.float16, torch.float16)] * 2  # each layer, as the cache holds it


def test_a_compiled_pass_is_made_again_when_the_rope_table_grows(tmp_path):
    """A CPU RoPE table grows when a position falls past it (rope.py); a pass compiled over the old
    table was handed the new one, of another shape, and failed inductor's size check (a sampled
    adaptive run with compiled passes: session 33). The pass is compiled again, and gives the eager
    model's logits."""
    from triforce.speculative.graphs import HOT_AFTER

    model, cache, reference, compiled = compiled_beside_eager(tmp_path, seed=3)
    for i in range(HOT_AFTER + 3):
        if i == HOT_AFTER + 1:  # as a position past the table does
            model.rotary.length *= 2
            model.rotary._tables.clear()
        tokens = torch.tensor([(i * 7) % 60 + 3])
        torch.testing.assert_close(compiled(tokens, cache), model(tokens, reference), rtol=1e-5, atol=1e-6)
    assert compiled.captures == 2


def test_compiled_passes_over_a_generator_with_graphs_already_on(tiny):
    """On CUDA a bench's compiled system is built as generate.py builds it (CUDA graphs on), then
    compiled: the first H200 run wrapped a wrapper, whose inner pass made a view of a view
    ("'StaticView' object has no attribute 'k'"). Here the same order, graphs on (eager_static, as
    on CPU) then compiled: each level wraps its model once and decodes the eager tokens."""
    from triforce.speculative.graphs import GraphedModel, enable_cuda_graphs

    ids = [3 + (i * 7) % 60 for i in range(300)]
    cfg = GenerationConfig(max_new_tokens=12, budget=64, chunk_size=8, gamma1=2, gamma2=3)
    eager = Generator(tiny, cfg, "retrieval", max_len=400)
    eager.prefill(ids)
    gen = Generator(tiny, cfg, "retrieval", max_len=400)
    enable_cuda_graphs(gen, eager_static=True)
    wrappers = enable_compiled_passes(gen)
    assert all(w.compiled and not isinstance(w.model, GraphedModel) for w in wrappers)
    gen.prefill(ids)
    assert gen.generate() == eager.generate() and gen.middle.model.replays > 0


def test_a_whole_round_never_compares_its_pass_function(tiny):
    """torch 2.11's dynamo cannot compare bound methods: `forward != self.raw_pass` inside the
    compiled lookup round failed on the H200 (session 36) where torch 2.13 here traced it. The round
    learns it runs inside a graph from a flag; a pass function that refuses comparison proves it."""
    from triforce.speculative.graphs import enable_cuda_graphs
    from triforce.speculative.lookup import LookupDrafter

    class Incomparable:
        def __init__(self, run):
            self.run = run

        def __call__(self, *args):
            return self.run(*args)

        def __eq__(self, other):
            raise AssertionError("a round compared its pass function")

        __ne__ = __eq__
        __hash__ = object.__hash__

    ids = [3 + (i * 7) % 60 for i in range(300)]
    cfg = GenerationConfig(max_new_tokens=12, budget=64, chunk_size=8, gamma1=2, gamma2=3, device_rounds=True,
                           adaptive=False)
    gen = Generator(Models(tiny.target, LookupDrafter()), cfg, "triforce", max_len=400)
    enable_cuda_graphs(gen, eager_static=True)
    proposer = gen.proposers["triforce"][0]
    proposer.raw_pass = Incomparable(proposer.raw_pass)
    gen.prefill(ids)
    assert len(gen.generate()) == 12 and proposer.graph.runs > 0


def test_a_full_cache_width_compiles_one_graph(tmp_path):
    """A full cache's view keeps the last queries for the retrieval level in buffers its first call
    allocated: compiled, that first call traced a graph without them and the second another with
    them. On CUDA the second compile landed inside the graph capture (warmed up once) and failed
    ("operation not permitted when stream is capturing", bench.kernels on the H200, session 37)."""
    from torch._dynamo.utils import counters

    from triforce.speculative.graphs import HOT_AFTER

    model, cache, reference, compiled = compiled_beside_eager(tmp_path, seed=3)
    before = counters["stats"]["unique_graphs"]
    for i in range(HOT_AFTER + 3):
        tokens = (torch.arange(5) * 3 + i) % 60 + 3
        torch.testing.assert_close(compiled(tokens, cache), model(tokens, reference), rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] - before == 1
    assert compiled.captures == 1
    view = next(iter(compiled.views.values()))
    assert all(q is not None for q in view.queries)
    torch.testing.assert_close(cache.queries[0], reference.queries[0], rtol=1e-5, atol=1e-6)


def test_a_rope_table_the_first_pass_grows_is_compiled_over_once(tmp_path):
    """The eager pass that allocates a full cache's query buffers may grow a CPU RoPE table (a position
    past its end): the graph is traced over the grown table, not compiled again on the next call."""
    from triforce.speculative.graphs import HOT_AFTER

    model, cache, reference, compiled = compiled_beside_eager(tmp_path, seed=4)
    for i in range(HOT_AFTER + 2):
        if i == HOT_AFTER - 1:  # the call that compiles: its positions run past the table
            model.rotary.length = cache.length + 2
            model.rotary._tables.clear()
        tokens = (torch.arange(5) * 3 + i) % 60 + 3
        torch.testing.assert_close(compiled(tokens, cache), model(tokens, reference), rtol=1e-5, atol=1e-6)
    assert model.rotary.length > cache.length - 10 and compiled.captures == 1


def test_prompts_turns_and_drafter_refills_make_no_graphs(tiny):
    """A prompt's last piece, a chat turn and the drafter's window refill feed widths that seldom
    recur: they run eagerly, never captured. On a GPU each capture costs a warm-up pass, the capture
    and a memory pool of its own, kept for good (a chat of short turns made one per new turn length;
    every generator one for its drafter's refill). Decode passes still run their graphs, and the
    tokens are those of the same calls without graphs."""
    from triforce.speculative import Models
    from triforce.speculative.graphs import enable_cuda_graphs

    ids = [3 + (i * 7) % 60 for i in range(101)]
    cfg = GenerationConfig(max_new_tokens=16, budget=32, chunk_size=8, gamma1=2, gamma2=3, draft_window=16,
                           prefill_chunk=48, adaptive=False)  # pieces 48, 48, 5; a refill of 4 + 16 tokens
    models = Models(tiny.target, tiny.target)  # a separate drafter: the refill is a feed of its own
    runs = []
    for graphs in (False, True):
        gen = Generator(models, cfg, "triforce", max_len=400)
        wrappers = enable_cuda_graphs(gen, eager_static=True) if graphs else []
        views = lambda: [sorted(w.views) for w in wrappers]  # noqa: E731
        tokens = [gen.prefill(ids)]
        assert views() == [[] for _ in wrappers]  # the prompt's pieces and the drafter's refill: none
        tokens += gen.generate()
        decoding = views()
        tokens.append(gen.extend([5, 9, 11, 2, 7]))  # a chat turn of 5 tokens
        assert views() == decoding
        tokens += gen.generate()
        runs.append(tokens)
    assert runs[0] == runs[1]
    assert sum(w.replays for w in wrappers) > 0 and all(decoding)
