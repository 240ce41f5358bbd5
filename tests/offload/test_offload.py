"""The offloaded full cache: store/stream round trips, rollback, byte counters, planner, and greedy
output identical to the resident cache for every engine (CPU: the "device" is the CPU)."""
from dataclasses import replace

import pytest
import torch

from triforce.offload import OffloadedCache, full_cache_factory, graphed
from triforce.speculative.graphs import GraphedModel, StaticView, enable_cuda_graphs
from triforce.offload.planner import GiB, Request, plan, shape_request
from triforce.speculative import GenerationConfig, Models
from triforce.model.kv import KVShape
from triforce.speculative.caches import FullCache
from triforce.speculative.engine import CacheSizes, Generator
from triforce.model.errors import UserError
from triforce.model.loader import load_model

from ..conftest import save_tiny

SHAPE = KVShape(num_layers=5, num_kv_heads=2, head_dim=4, dtype=torch.float64, device=torch.device("cpu"))
HQ = 4


def feed(caches, T, gen):
    """One forward of T random tokens through every cache, layer by layer; returns the outputs."""
    positions = [c.begin(T) for c in caches]
    assert all(torch.equal(p, positions[0]) for p in positions)
    outs = [[] for _ in caches]
    for layer in range(SHAPE.num_layers):
        q = torch.randn(T, HQ, SHAPE.head_dim, dtype=torch.float64, generator=gen)
        k, v = (torch.randn(T, SHAPE.num_kv_heads, SHAPE.head_dim, dtype=torch.float64, generator=gen) for _ in "kv")
        for c, o in zip(caches, outs):
            o.append(c.attend(layer, q, k, v))
    for c in caches:
        c.end(T)
    return outs


def assert_same_state(full: FullCache, off: OffloadedCache):
    """Every live value of every layer, wherever it rests (device-resident layers or host store)."""
    n = full.length
    assert off.length == n
    for layer in range(SHAPE.num_layers):
        j = layer - off.onchip
        k, v = (off.resident_k[layer], off.resident_v[layer]) if j < 0 else (off.store.k[j], off.store.v[j])
        assert torch.equal(k[:n].transpose(0, 1), full.k[layer, :, :n])
        assert torch.equal(v[:n].transpose(0, 1), full.v[layer, :, :n])


def assert_outputs_equal(outs):
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("onchip", [0, 2])
@pytest.mark.parametrize("chunk", [1, 4, 7, 64])
@pytest.mark.parametrize("pieces", [[13, 1, 1, 3], [8, 8, 1], [5, 2, 9, 4, 1]])
def test_round_trip_every_chunk_boundary(onchip, chunk, pieces):
    """Prompts of lengths off and on the chunk grid: what attention sees and what the store keeps is
    exactly what the resident cache has, and the staged slots hold exact copies."""
    gen = torch.Generator().manual_seed(sum(pieces) + chunk)
    full = FullCache(SHAPE, 64, prefill_chunk=16)
    off = OffloadedCache(SHAPE, 64, prefill_chunk=16, onchip_layers=onchip, chunk_tokens=chunk)
    for T in pieces:
        assert_outputs_equal(feed([full, off], T, gen))
        assert_same_state(full, off)
    n = full.length
    for s, held in enumerate(off.streamer.held):
        if held is not None:  # staging never diverges from the store below its valid count
            layer, valid = held
            assert torch.equal(off.streamer.k[s][:valid], off.store.k[layer, :valid])
            assert torch.equal(off.streamer.v[s][:valid], off.store.v[layer, :valid])
    # what the retrieval cache reads
    index = torch.randint(0, n, (SHAPE.num_kv_heads, 6), generator=gen)
    for layer in range(SHAPE.num_layers):
        for a, b in zip(full.gather(layer, index), off.gather(layer, index)):
            assert torch.equal(a, b)
        torch.testing.assert_close(off.chunk_key_means(layer, 4, n // 4), full.chunk_key_means(layer, 4, n // 4))
    for a, b in zip(full.slice(3, n), off.slice(3, n)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("prefetch_next", [False, True])
def test_rollback_then_append_overwrites_exactly_the_rejected(prefetch_next):
    gen = torch.Generator().manual_seed(0)
    full = FullCache(SHAPE, 64, prefill_chunk=16)
    off = OffloadedCache(SHAPE, 64, prefill_chunk=16, chunk_tokens=3, prefetch_next=prefetch_next)
    feed([full, off], 11, gen)
    feed([full, off], 6, gen)  # six speculative tokens...
    before_k, before_v = off.store.k.clone(), off.store.v.clone()
    full.rollback(13)
    off.rollback(13)  # ...four of them rejected
    assert_outputs_equal(feed([full, off], 2, gen))  # two new tokens take slots 13 and 14
    assert_same_state(full, off)
    # the store is torch.empty: a never-written slot may hold NaN bits, which differ from themselves
    same = (off.store.k == before_k) | (off.store.k.isnan() & before_k.isnan())
    changed = (~same).any(dim=(0, 2, 3))
    assert changed.nonzero().flatten().tolist() == [13, 14]
    assert torch.equal(off.store.v[:, 15:17], before_v[:, 15:17])  # rejected, not yet overwritten, unread
    assert_outputs_equal(feed([full, off], 5, gen))  # streamed passes after the rollback see the new tokens
    assert_same_state(full, off)


def test_bytes_equal_the_arithmetic():
    """Four offloaded layers rotating through two slots: each pass streams every offloaded layer's
    live prefix in and writes its new tokens back."""
    gen = torch.Generator().manual_seed(1)
    off = OffloadedCache(SHAPE, 64, prefill_chunk=16, onchip_layers=1, chunk_tokens=5)
    token = SHAPE.num_kv_heads * SHAPE.head_dim * 8  # one token of K (or of V) in one layer, float64
    expected_h2d = expected_d2h = 0
    for T, rollback in [(10, None), (3, None), (7, 15), (1, None), (4, 20)]:
        length = off.length
        feed([off], T, gen)
        expected_h2d += 4 * 2 * length * token
        expected_d2h += 4 * 2 * T * token
        p = off.counters.passes[-1]
        assert (p.h2d, p.d2h, p.length, p.tokens) == (4 * 2 * length * token, 4 * 2 * T * token, length, T)
        if rollback is not None:
            off.rollback(rollback)
    assert (off.counters.h2d, off.counters.d2h) == (expected_h2d, expected_d2h)
    assert off.bytes_moved == expected_h2d + expected_d2h
    s = off.timings()
    assert s["bandwidth_gbps"] > 0 and s["wait_seconds"] == pytest.approx(s["copy_seconds"])  # CPU: no overlap
    assert s["pass_seconds"] >= s["wait_seconds"] and s["compute_seconds"] >= 0
    # retrieval reads count too, apart: a slice of 6 tokens of the 4 offloaded layers
    off.slice(2, 8)
    assert off.counters.retrieval_h2d == 2 * 4 * 6 * token


def test_double_buffer_schedule():
    """Layer j computes from slot j % 2 while layer j+1's copy is already issued into the other slot."""
    off = OffloadedCache(SHAPE, 64, prefill_chunk=16, onchip_layers=1, chunk_tokens=4)
    log = []
    for name in ("fetch", "acquire", "write_back", "release"):
        method = getattr(off.streamer, name)
        setattr(off.streamer, name, lambda j, *a, _m=method, _n=name: (log.append((_n, j)), _m(j, *a))[1])
    feed([off], 5, torch.Generator().manual_seed(3))
    expected = [("fetch", 0)]
    for j in range(4):
        expected += [("acquire", j)] + ([("fetch", j + 1)] if j < 3 else []) + [("write_back", j), ("release", j)]
    assert log == expected
    assert [h[0] for h in off.streamer.held] == [2, 3]  # slots alternate: layers 0, 2 | 1, 3


def test_staged_layers_are_not_copied_again():
    """Two offloaded layers fit the two slots: after the first pass nothing is streamed but the new tokens."""
    gen = torch.Generator().manual_seed(2)
    off = OffloadedCache(SHAPE, 64, prefill_chunk=16, onchip_layers=3, chunk_tokens=4)
    feed([off], 9, gen)
    feed([off], 2, gen)
    off.rollback(10)
    feed([off], 3, gen)
    assert [p.h2d for p in off.counters.passes] == [0, 0, 0]


# ---------------------------------------------------------------------- planner
def req(**kw):
    base = dict(num_layers=32, layer_token_bytes=16 * 2**10, max_len=128 * 2**10, weights=13 * GiB,
                retrieval_cache=4 * GiB, workspace=GiB, onchip_layers=None)  # Llama2-7B-like, 2 GiB per layer
    base.update(kw)
    return Request(**base)


def test_planner_fills_free_memory_with_onchip_layers():
    p = plan(req(), free=30 * GiB)  # 18 fixed + 2 x 2 staging leaves 8: four layers
    assert (p.onchip_layers, p.staging, p.onchip_kv) == (4, 4 * GiB, 8 * GiB)
    assert p.headroom == 0
    assert plan(req(onchip_layers=2), free=30 * GiB).onchip_layers == 2
    everything = plan(req(), free=90 * GiB)  # all 32 layers resident: no staging needed
    assert (everything.onchip_layers, everything.staging) == (32, 0)
    assert plan(req(), free=22 * GiB).onchip_layers == 0


def test_planner_errors_say_what_is_missing_and_what_to_change():
    with pytest.raises(UserError, match=r"5\.00 GiB missing.*Settings.onchip_layers 4"):
        plan(req(onchip_layers=7), free=31 * GiB)
    with pytest.raises(UserError, match=r"1\.00 GiB missing.*lower Settings.context to about 98304 tokens"):
        plan(req(), free=21 * GiB)
    with pytest.raises(UserError, match=r"missing.*GenerationConfig.budget"):
        plan(req(), free=10 * GiB)
    with pytest.raises(UserError, match=r"outside 0\.\.32"):
        plan(req(onchip_layers=33), free=100 * GiB)
    with pytest.raises(UserError, match=r"whole KV cache does not fit.*Settings.offload host"):
        plan(req(offload=False), free=30 * GiB)
    assert plan(req(offload=False), free=82 * GiB).onchip_layers == 32


def test_factory_plans_before_allocating():
    shape = KVShape(32, 32, 128, torch.bfloat16, torch.device("cpu"))
    # ten billion tokens would fail to allocate: the planner's error must come first
    with pytest.raises(UserError, match="missing"):
        full_cache_factory("cpu", 512, free_bytes=64 * GiB)(shape, 10**10)
    seen = []
    cache = full_cache_factory("cpu", 512, onchip_layers="auto", free_bytes=3 * GiB, on_plan=seen.append)(
        SHAPE, 1000)
    assert cache.onchip == SHAPE.num_layers == seen[0].onchip_layers
    r = shape_request(shape, 1024, reserve=5)
    assert r.layer_bytes == 1024 * 2 * 32 * 128 * 2 and r.retrieval_cache == 5
    sizes = CacheSizes.of(GenerationConfig(budget=4096, gamma1=4, gamma2=6, sink_tokens=4, draft_window=256),
                          "triforce", max_len=1000)
    assert sizes.after_full_bytes(shape, None) == shape.bytes_per_token * (4096 + 33 + 4 + 256 + 64)
    # lookups weighed alone widen a full pass to lookup_gamma where that is wider than the mode's own
    cfg = GenerationConfig(budget=4096, gamma1=1, gamma2=3, lookup_gamma=8)
    assert CacheSizes.of(cfg, "triforce", 1000).widest == 6 and CacheSizes.of(cfg, "triforce", 1000, lookups=True).widest == 8
    assert CacheSizes.of(cfg, "speculative", 1000, lookups=True).margin == 8 + 2


# ---------------------------------------------------------------------- engines
@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("target4")
    save_tiny(folder, seed=11, vocab=48, layers=4)
    target = load_model(folder, torch.float64)
    drafter = load_model(folder, torch.float64)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.02 * torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(5)))
    return target, drafter


def run(models, mode, ids, cfg, factory=None, graphs=False):
    gen = Generator(models, cfg, mode, len(ids) + cfg.max_new_tokens, full_cache_factory=factory)
    wrapped = enable_cuda_graphs(gen, eager_static=True) if graphs else []
    gen.prefill(ids)
    return gen.generate(), gen, wrapped


CFG = GenerationConfig(max_new_tokens=50, budget=40, chunk_size=8, gamma1=3, gamma2=5, draft_window=16,
                       sink_tokens=4, prefill_chunk=24)


def test_generator_reserves_its_other_caches(pair):
    """The full cache is made first; the factory is told what the retrieval and drafter caches will take."""
    seen = []

    def factory(shape, slots, reserve_bytes):
        seen.append(reserve_bytes)
        return full_cache_factory("cpu", CFG.prefill_chunk)(shape, slots, reserve_bytes)

    target = pair[0]
    gen = Generator(Models(target, None), CFG, "triforce", 400, full_cache_factory=factory)
    assert seen == [gen.sizes.after_full_bytes(target.kv_shape(), None)]
    assert seen[0] == gen.middle.cache.nbytes() + gen.drafter.cache.nbytes()


@pytest.mark.parametrize("mode,use_drafter", [("autoregressive", False), ("speculative", True),
                                              ("retrieval", False), ("triforce", True), ("triforce", False)])
@pytest.mark.parametrize("onchip,prefetch_next", [(0, False), (1, True)])
def test_greedy_identical_with_offloading(pair, mode, use_drafter, onchip, prefetch_next):
    """Same tokens as the resident cache, and the same acceptance at every level (so the retrieval
    cache was built and refreshed from identical KV)."""
    target, drafter = pair
    models = Models(target, drafter if use_drafter else None)
    ids = torch.randint(0, 48, (101,), generator=torch.Generator().manual_seed(3)).tolist()
    ref, ref_gen, _ = run(models, mode, ids, CFG)
    factory = full_cache_factory("cpu", CFG.prefill_chunk, onchip_layers=onchip, chunk_tokens=7,
                                 prefetch_next=prefetch_next)
    out, gen, _ = run(models, mode, ids, CFG, factory)
    assert out == ref
    assert dict(gen.stats.accepted) == dict(ref_gen.stats.accepted)
    assert gen.stats.rebuilds == ref_gen.stats.rebuilds
    assert ref_gen.stats.bytes_moved is None and gen.stats.bytes_moved > 0
    if mode == "autoregressive" and not prefetch_next:
        # decode pass i feeds one token at length P + i: every offloaded layer in, its new KV back out
        token = 2 * 2 * 8 * 8  # K and V, 2 KV heads, head_dim 8, float64
        off = 4 - onchip
        expected = sum(off * token * (len(ids) + i) + off * token for i in range(CFG.max_new_tokens - 1))
        assert gen.stats.bytes_moved == expected


def test_fewer_bytes_per_token_with_triforce(pair):
    target, _ = pair
    ids = torch.randint(0, 48, (101,), generator=torch.Generator().manual_seed(4)).tolist()
    per_token = {}
    for mode in ("autoregressive", "triforce"):
        _, gen, _ = run(Models(target, None), mode, ids, CFG, full_cache_factory("cpu", CFG.prefill_chunk))
        per_token[mode] = gen.stats.bytes_moved / gen.stats.decode_tokens
    assert per_token["triforce"] < per_token["autoregressive"] / 1.5


# ---------------------------------------------------------------------- the CUDA-graph path, run eagerly
def test_static_view_computes_what_the_cache_does(pair):
    target, _ = pair
    gen = torch.Generator().manual_seed(6)
    a, b = FullCache(target.kv_shape(), 64, 16), FullCache(target.kv_shape(), 64, 16)
    graphed = GraphedModel(target, eager_static=True)
    for T in (9, 3, 1, 1, 4):
        ids = torch.randint(0, 48, (T,), generator=gen)
        # the eager grouped-matmul path scores in float32 even for float64 models: rounding differs
        torch.testing.assert_close(graphed(ids, b), target(ids, a), rtol=0, atol=1e-5)
        assert a.length == b.length and a.used == b.used
        torch.testing.assert_close(a.k[:, :, :a.used], b.k[:, :, :b.used], rtol=0, atol=1e-5)
        assert torch.equal(a.k[0, :, :a.used], b.k[0, :, :b.used])  # layer 0's keys do not depend on attention
    assert graphed.replays == 5 and isinstance(next(iter(graphed.captured.values())).view, StaticView)


@pytest.mark.parametrize("offloaded", [False, True])
def test_a_padded_pass_hands_back_only_its_own_tokens(pair, offloaded):
    """pad_widths: a pass of 3 runs at width 4 and a pass of 5 at 8, yet the logits, the queries the
    retrieval level scores with and the cache's length are those of the real tokens (queries[-1] is
    what a rebuild and a saved chat read), equal to an unpadded pass's."""
    target, _ = pair
    make = (lambda: full_cache_factory("cpu", 24)(target.kv_shape(), 64, 0)) if offloaded else \
        (lambda: FullCache(target.kv_shape(), 64, 16))
    plain, padded = make(), make()
    eager, wide = GraphedModel(target, eager_static=True), GraphedModel(target, eager_static=True, pad_widths=True)
    gen = torch.Generator().manual_seed(7)
    for T in (9, 3, 5, 1):
        ids = torch.randint(0, 48, (T,), generator=gen)
        want, got = eager(ids, plain), wide(ids, padded)
        # float64: wider GEMMs may round the last bits differently
        assert got.shape == want.shape == (T, 48) and torch.allclose(got, want, rtol=0, atol=1e-12)
        assert padded.length == plain.length and all(q.shape[0] == T for q in padded.queries)
        assert all(torch.allclose(a, b, rtol=0, atol=1e-12) for a, b in zip(padded.queries, plain.queries))
    assert {key[1] for key in wide.views} == {16, 4, 8, 1}  # 9 -> 16, 3 -> 4, 5 -> 8


def staged(factory):
    """`factory`'s offloaded caches with the store unmapped: a graphed pass's new K/V go back through
    pinned staging (OffloadedCache.graph_end), as on a GPU where the store cannot be mapped."""
    def make(*args):
        cache = factory(*args)
        cache.mapped = None
        return cache
    return make


@pytest.mark.parametrize("mode", ["autoregressive", "speculative", "retrieval", "triforce"])
@pytest.mark.parametrize("offloaded,onchip,writes", [(False, 0, None), (True, 0, "mapped"), (True, 1, "mapped"),
                                                     (True, 0, "staged")])
def test_graph_path_gives_the_same_tokens(pair, mode, offloaded, onchip, writes, monkeypatch):
    """Every level runs its static view, the offloaded full level too (offload/graphed.py): the same
    tokens and acceptance as the caches' own path, and the retrieval level, scored with the queries
    the static full pass kept, rebuilt alike; an offloaded store ends as the caches' own path leaves
    it, whether the graphs wrote it themselves (mapped, the CPU's and the GPU's default) or through
    staging. Buckets of 16 tokens: the offloaded passes cross several spans, each a view of its own."""
    monkeypatch.setattr(graphed, "BUCKET", 16)
    target, drafter = pair
    models = Models(target, drafter if mode in ("speculative", "triforce") else None)
    ids = torch.randint(0, 48, (101,), generator=torch.Generator().manual_seed(8)).tolist()
    factory = full_cache_factory("cpu", CFG.prefill_chunk, onchip_layers=onchip) if offloaded else None
    ref, ref_gen, _ = run(models, mode, ids, CFG, factory)
    out, gen, wrapped = run(models, mode, ids, CFG, staged(factory) if writes == "staged" else factory, graphs=True)
    if offloaded:
        cache, ref_cache = gen.full.cache, ref_gen.full.cache
        assert (cache.mapped is not None) == (writes == "mapped") and cache.length == ref_cache.length
        assert cache.store_writes() == writes and ref_cache.store_writes() == "eager"  # never mapped: never graphed
        for layer in range(onchip, target.cfg.num_layers):
            for a, b in zip(cache.read(layer, 0, cache.length), ref_cache.read(layer, 0, cache.length)):
                assert torch.equal(a, b)
    assert out == ref and dict(gen.stats.accepted) == dict(ref_gen.stats.accepted)
    assert gen.stats.rebuilds == ref_gen.stats.rebuilds
    levels = [lvl for lvl in (gen.drafter, gen.middle, gen.full) if isinstance(lvl.model if lvl else None, GraphedModel)]
    expected = {"autoregressive": 1, "speculative": 2, "retrieval": 2, "triforce": 3}[mode]
    assert len(wrapped) == len(levels) == expected and all(w.replays > 0 for w in wrapped)
    if offloaded:
        spans = sorted({view.span for view in gen.full.model.views.values() if isinstance(view, graphed.OffloadedView)})
        assert len(spans) >= 2 and all(s % 16 == 0 or s == gen.full.cache.capacity for s in spans), spans


@pytest.mark.parametrize("graphed", [True, False], ids=["graphed", "eager"])
@pytest.mark.parametrize("onchip", [0, 1])
def test_the_retrieval_cache_absorbs_a_passs_tokens_from_the_device(pair, onchip, graphed, monkeypatch):
    """After each pass the retrieval cache takes the committed tokens' K/V from the device, where the
    pass left them (a graph's buffers; an eager pass's own tensors, as under tensor parallelism), not
    from the store: on CUDA the store's copy cost a wait on the write-back and a blocking
    host-to-device copy every pass. The same tokens and acceptance as the resident cache (float64),
    and the store is read for rebuilds only (a gather per layer; the chunks' attention mass is
    computed where the keys are)."""
    from triforce.offload.store import OffloadedCache

    target, _ = pair
    ids = torch.randint(0, 48, (101,), generator=torch.Generator().manual_seed(8)).tolist()
    ref, ref_gen, _ = run(Models(target, None), "retrieval", ids, CFG)
    reads = []
    real = OffloadedCache._to_device
    monkeypatch.setattr(OffloadedCache, "_to_device", lambda self, t, host: reads.append(host) or real(self, t, host))
    factory = full_cache_factory("cpu", CFG.prefill_chunk, onchip_layers=onchip)
    gen = Generator(Models(target, None), CFG, "retrieval", len(ids) + CFG.max_new_tokens, full_cache_factory=factory)
    if graphed:
        enable_cuda_graphs(gen, eager_static=True)
    gen.prefill(ids)
    reads.clear()  # the prefill's first retrieval build
    built = gen.stats.rebuilds
    assert gen.generate() == ref and dict(gen.stats.accepted) == dict(ref_gen.stats.accepted)
    assert gen.stats.rebuilds == ref_gen.stats.rebuilds > built
    # a rebuild gathers keys and values of each offloaded layer; absorbing reads nothing
    assert sum(reads) == 2 * (4 - onchip) * (gen.stats.rebuilds - built)  # host=True: a copy from the store


def test_a_graphed_offloaded_pass_moves_whole_buckets(pair, monkeypatch):
    """Autoregressive decoding through the offloaded view: every pass brings each offloaded layer's
    bucket of tokens and sends its one new token back, counted where the copies are issued."""
    monkeypatch.setattr(graphed, "BUCKET", 16)
    target, _ = pair
    ids = torch.randint(0, 48, (101,), generator=torch.Generator().manual_seed(4)).tolist()
    ref, _, _ = run(Models(target, None), "autoregressive", ids, CFG)
    factory = full_cache_factory("cpu", CFG.prefill_chunk, onchip_layers=1, prefetch_next=False)
    out, gen, _ = run(Models(target, None), "autoregressive", ids, CFG, factory, graphs=True)
    assert out == ref
    spans = {v.span for v in gen.full.model.views.values()}  # older buckets' views were dropped
    assert len(spans) <= 2 and max(spans) - min(spans) <= 16 and len(gen.full.model.captured) <= 2, spans
    token, off = 2 * 2 * 8 * 8, 3  # K and V, 2 KV heads, head_dim 8, float64; layers 1-3 offloaded
    spans = [min(gen.full.cache.capacity, -(-(len(ids) + i + 1) // 16) * 16) for i in range(CFG.max_new_tokens - 1)]
    assert gen.stats.bytes_moved == sum(off * token * s + off * token for s in spans)


def test_an_offloaded_pass_that_cannot_be_captured_runs_eagerly(pair, monkeypatch, capsys):
    """A capture that raises (a driver that cannot capture the copies, say) leaves that pass and every
    later one to the eager path, with one warning, and the same tokens."""
    target, _ = pair
    ids = torch.randint(0, 48, (101,), generator=torch.Generator().manual_seed(4)).tolist()
    ref, _, _ = run(Models(target, None), "autoregressive", ids, CFG)

    def refuse(self, T):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")
    monkeypatch.setattr(graphed.OffloadedView, "begin", refuse)
    out, gen, wrapped = run(Models(target, None), "autoregressive", ids, CFG, full_cache_factory("cpu", 24), graphs=True)
    assert out == ref and wrapped[0].offload_failure.endswith("operation not permitted when stream is capturing")
    assert capsys.readouterr().err.count("warning: the offloaded cache's passes run eagerly") == 1


@pytest.mark.parametrize("piece", [16, 64])
@pytest.mark.parametrize("onchip", [0, 1])
def test_a_prefill_streams_each_pieces_past_once(piece, onchip):
    """Each prefill piece brings every offloaded layer's past to the device once (the two staging
    slots take turns between 4 or more layers; with 3, the second would stay in its slot), so a prompt of N tokens moves sum(past) = piece * n (n - 1) / 2
    tokens a layer for n pieces: why a GPU prefills in pieces of 2,048, not 512 (speculative/config.py)."""
    N = 256
    cache = OffloadedCache(SHAPE, N, prefill_chunk=piece, onchip_layers=onchip)
    gen = torch.Generator().manual_seed(piece)
    for _ in range(N // piece):
        feed([cache], piece, gen)
    n, token_bytes = N // piece, 2 * SHAPE.num_kv_heads * SHAPE.head_dim * 8  # K and V, float64
    offloaded = SHAPE.num_layers - onchip
    assert cache.counters.h2d == piece * n * (n - 1) // 2 * offloaded * token_bytes
    assert cache.counters.d2h == N * offloaded * token_bytes  # each new token written back once


@pytest.mark.parametrize("mode,adaptive", [("speculative", False), ("retrieval", False), ("triforce", False),
                                           ("triforce", True)])
@pytest.mark.parametrize("offloaded", [False, True])
def test_padded_widths_give_the_same_tokens(pair, mode, adaptive, offloaded, monkeypatch):
    """Captured on CUDA, a full pass runs at its width rounded up to graphs.WIDTHS, the positions past
    it fed copies of the last token and dropped: one graph a bucket, not one a width. The same tokens,
    acceptance and rebuilds as the caches' own path, only bucket widths captured, and (offloaded) the
    store holding just the real tokens' K/V."""
    from triforce.speculative.models import WIDTHS, padded_width

    monkeypatch.setattr(graphed, "BUCKET", 16)
    target, drafter = pair
    models = Models(target, drafter if mode in ("speculative", "triforce") else None)
    ids = torch.randint(0, 48, (101,), generator=torch.Generator().manual_seed(8)).tolist()
    cfg = replace(CFG, adaptive=adaptive)
    factory = full_cache_factory("cpu", CFG.prefill_chunk) if offloaded else None
    ref, ref_gen, _ = run(models, mode, ids, cfg, factory)
    gen = Generator(models, cfg, mode, len(ids) + cfg.max_new_tokens, full_cache_factory=factory)
    enable_cuda_graphs(gen, eager_static=True)
    assert not gen.full.model.pad_widths  # eager_static (CPU): off unless asked, as here
    gen.full.model.pad_widths = True
    gen.prefill(ids)
    out = gen.generate()
    assert out == ref
    if not adaptive:  # the chooser's choices follow its timings
        assert dict(gen.stats.accepted) == dict(ref_gen.stats.accepted) and gen.stats.rebuilds == ref_gen.stats.rebuilds
        if gen.middle is not None:  # rebuilt from the real tokens' queries, not the padding's
            assert torch.equal(gen.middle.cache.k, ref_gen.middle.cache.k)
    # verifications (a resident view's key ends in last_only False; an offloaded view's in its span)
    widths = {key[1] for key in gen.full.model.views if offloaded or key[2] is False}
    assert max(widths) > 1 and (offloaded or widths <= set(WIDTHS))
    if offloaded and not adaptive:  # the store holds what the unpadded run's does, up to the length
        n = gen.full.cache.length
        assert n == ref_gen.full.cache.length
        assert torch.equal(gen.full.cache.store.k[:, :n], ref_gen.full.cache.store.k[:, :n])
        assert torch.equal(gen.full.cache.store.v[:, :n], ref_gen.full.cache.store.v[:, :n])
    assert padded_width(5, room=100) == 8 and padded_width(5, room=6) == 5 and padded_width(1, room=1) == 1
    assert padded_width(17, room=100) == 32 and padded_width(129, room=1000) == 129


@pytest.mark.parametrize("mode", ["retrieval", "triforce"])
def test_offloaded_passes_through_split_keys_give_the_same_tokens(pair, mode, monkeypatch):
    """The offloaded view's attention goes through attention.attend_shared_heads on any device; with
    the split-keys form forced on (CUDA's form for verification over long caches, here through the
    CPU flash kernel) and pieces of 32 keys, every verification runs pieces, ragged and masked whole:
    the caches' own path's tokens."""
    from triforce.model import split_keys

    monkeypatch.setattr(graphed, "BUCKET", 16)
    monkeypatch.setattr(split_keys, "serves", lambda T, S, q: 1 < T <= split_keys.MAX_QUERIES and S >= 64)
    monkeypatch.setattr(split_keys, "PIECE", 32)
    calls = []
    real = split_keys.split_keys_attention
    monkeypatch.setattr(split_keys, "split_keys_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    target, drafter = pair
    models = Models(target, drafter if mode == "triforce" else None)
    ids = torch.randint(0, 48, (101,), generator=torch.Generator().manual_seed(8)).tolist()
    factory = full_cache_factory("cpu", CFG.prefill_chunk)
    ref, _, _ = run(models, mode, ids, CFG, factory)
    out, _, _ = run(models, mode, ids, CFG, factory, graphs=True)
    assert out == ref and len(calls) > 0


def test_on_cpu_the_store_is_its_own_mapping():
    """HostStore.mapped: on CPU the device is the host, so a graphed pass writes the store tensors
    themselves (on CUDA, tests/gpu checks a mapping over the pinned memory)."""
    from triforce.offload.store import HostStore

    store = HostStore(2, 16, 3, 4, torch.float32, pin=False)
    k, v = store.mapped(torch.device("cpu"))
    assert k is store.k and v is store.v
    shape = KVShape(num_layers=2, num_kv_heads=3, head_dim=4, dtype=torch.float32, device="cpu")
    cache = OffloadedCache(shape, 16)
    assert cache.store_writes() == "eager"  # probed by the first graphed pass, not before
    assert cache.mapped[0] is not None and cache.store_writes() == "mapped"
    every_layer_resident = OffloadedCache(shape, 16, onchip_layers=2)
    assert every_layer_resident.mapped is None and every_layer_resident.store_writes() is None


@pytest.mark.parametrize("lands", [True, False])
def test_the_mapping_probe_leaves_the_store_as_it_found_it(lands):
    """store.probe_write, which HostStore.mapped runs on CUDA after the prompt's K/V are in the store:
    it says whether the write landed and puts the probed bytes back either way (an H200 found layer 0's
    first key zeroed by the probe). On CPU the alias is the store itself, or a copy where it misses."""
    from triforce.offload.store import HostStore, probe_write

    store = HostStore(2, 16, 3, 4, torch.bfloat16, pin=False)
    store.k.copy_(torch.randn(store.k.shape, generator=torch.Generator().manual_seed(1)))
    before = store.k.clone()
    alias = store.k if lands else store.k.clone()
    waits = []
    assert probe_write(store.k, alias, lambda: waits.append(1)) is lands
    assert torch.equal(store.k, before) and len(waits) == 2
