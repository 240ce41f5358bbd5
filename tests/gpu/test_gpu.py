"""GPU-only checks: the offloaded cache on CUDA (side stream, events, pinned store), flash-attn vs
SDPA, and CUDA graphs vs eager. Every test skips on a machine without CUDA."""
import warnings

import pytest
import torch

from triforce.offload import full_cache_factory
from triforce.speculative.graphs import enable_cuda_graphs
from triforce.speculative import GenerationConfig, Models
from triforce.model import attention
from triforce.speculative.engine import Generator
from triforce.model.loader import load_model

from ..conftest import save_tiny
from ..model.test_attention import reference as written_out

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")
flash = pytest.mark.skipif(torch.cuda.is_available() and attention._FLASH is None,
                           reason="flash-attn not importable (install the 'gpu' extra)")
pytestmark = pytest.mark.gpu

CFG = GenerationConfig(max_new_tokens=48, budget=40, chunk_size=8, gamma1=3, gamma2=5, draft_window=16,
                       sink_tokens=4, prefill_chunk=24)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpu-target")
    save_tiny(folder, seed=11, vocab=48, layers=4)
    target = load_model(folder, torch.float32, "cuda")
    drafter = load_model(folder, torch.float32, "cuda")
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.02 * torch.randn(p.shape, dtype=p.dtype, device=p.device,
                                      generator=torch.Generator(p.device).manual_seed(5)))
    return target, drafter


def run(models, mode, factory=None, graphs=None, cfg=CFG, room=0):
    """Prefill 101 ids and generate; `room` more positions for a turn after the answer."""
    ids = torch.randint(0, 48, (101,), generator=torch.Generator().manual_seed(3)).tolist()
    gen = Generator(models, cfg, mode, len(ids) + cfg.max_new_tokens + room, full_cache_factory=factory)
    wrapped = enable_cuda_graphs(gen, eager_static=graphs == "static") if graphs else []
    gen.prefill(ids)
    return gen.generate(), gen, wrapped


@cuda
@pytest.mark.parametrize("mode", ["autoregressive", "speculative", "retrieval", "triforce"])
@pytest.mark.parametrize("onchip", [0, 1])
def test_offloaded_greedy_identical_on_cuda(models, mode, onchip):
    target, drafter = models
    pair = Models(target, drafter if mode in ("speculative", "triforce") else None)
    ref, _, _ = run(pair, mode)
    out, gen, _ = run(pair, mode, full_cache_factory("cuda", CFG.prefill_chunk, onchip_layers=onchip, chunk_tokens=7))
    assert out == ref
    cache = gen.full.cache
    assert cache.store.k.is_pinned() and gen.stats.bytes_moved > 0
    s = cache.timings()
    assert s["copy_seconds"] > 0 and 0 <= s["wait_seconds"]


@cuda
@pytest.mark.parametrize("mode", ["autoregressive", "speculative", "retrieval", "triforce"])
@pytest.mark.parametrize("onchip", [0, 1])
def test_captured_offloaded_passes_give_the_same_tokens(models, mode, onchip, monkeypatch):
    """The offloaded full level's passes captured with their copies (offload/graphed.py): the eager
    tokens, graphs replayed, and the graphs' new K/V back in the pinned store as an eager run leaves
    it. Buckets of 32 tokens: the passes cross several captures."""
    from triforce.offload import graphed

    monkeypatch.setattr(graphed, "BUCKET", 32)
    target, drafter = models
    pair = Models(target, drafter if mode in ("speculative", "triforce") else None)
    factory = full_cache_factory("cuda", CFG.prefill_chunk, onchip_layers=onchip, chunk_tokens=7)
    ref, ref_gen, _ = run(pair, mode, factory)
    out, gen, _ = run(pair, mode, factory, graphs="cuda")
    assert out == ref
    captured = [c for c in gen.full.model.captured.values() if isinstance(c.view, graphed.OffloadedView)]
    assert len({c.view.span for c in captured}) >= 2 and all(c.graph is not None for c in captured)
    a, b = gen.full.cache, ref_gen.full.cache
    assert a.mapped is not None and a.mapped[0].is_cuda  # the graphs wrote the pinned store themselves
    n = min(a.length, b.length)
    for layer in range(onchip, target.cfg.num_layers):  # read() waits for the graphs' writes
        for x, y in zip(a.read(layer, 0, n), b.read(layer, 0, n)):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


@cuda
def test_compiled_passes_capture_the_offloaded_pass_uncompiled(models):
    """--compile on a GPU: the offloaded full level's passes are captured as they are (their copies
    and streams do not trace), not run eagerly."""
    from triforce.offload import graphed
    from triforce.speculative.graphs import enable_compiled_passes

    target, _ = models
    factory = full_cache_factory("cuda", CFG.prefill_chunk, chunk_tokens=7)
    ref, _, _ = run(Models(target, None), "autoregressive", factory)
    ids = torch.randint(0, 48, (101,), generator=torch.Generator().manual_seed(3)).tolist()
    gen = Generator(Models(target, None), CFG, "autoregressive", len(ids) + CFG.max_new_tokens, full_cache_factory=factory)
    (full,) = enable_compiled_passes(gen)
    gen.prefill(ids)
    assert gen.generate() == ref
    captured = [c for c in full.captured.values() if isinstance(c.view, graphed.OffloadedView)]
    assert captured and all(c.graph is not None for c in captured) and full.offload_failure is None


@cuda
def test_compiled_resident_triforce_captures_every_full_cache_width(models):
    """--compile with the KV on the GPU: the full level's views of widths after the first compiled
    twice (their query buffers allocated on the first call), the second compile inside the capture,
    which CUDA refuses (bench.kernels on the H200, session 37). Each width compiles once now."""
    from triforce.speculative.graphs import enable_compiled_passes

    target, drafter = models
    pair = Models(target, drafter)
    eager, _, _ = run(pair, "triforce")
    ids = torch.randint(0, 48, (101,), generator=torch.Generator().manual_seed(3)).tolist()
    gen = Generator(pair, CFG, "triforce", len(ids) + CFG.max_new_tokens)
    wrappers = enable_compiled_passes(gen)
    gen.prefill(ids)
    assert gen.generate() == eager
    full = gen.full.model
    assert full in wrappers and sum(c.graph is not None for c in full.captured.values()) >= 1


@cuda
@flash
@pytest.mark.parametrize("T", [1, 7, 64])
def test_flash_matches_sdpa_within_bf16(T):
    g = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(T, 8, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    keys, values = (torch.randn(2, 300, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in "kv")
    assert attention.backend(q) == "flash-attn"
    torch.testing.assert_close(attention._attend_flash(q, keys, values), attention._attend_sdpa(q, keys, values),
                               atol=2e-2, rtol=2e-2)


@cuda
def test_cuda_graphs_give_the_same_tokens(models):
    target, drafter = models
    pair = Models(target, drafter)
    eager, _, _ = run(pair, "triforce")
    static, static_gen, _ = run(pair, "triforce", graphs="static")
    graphed, graph_gen, wrapped = run(pair, "triforce", graphs="cuda")
    assert graphed == static == eager
    full = graph_gen.full.model
    assert full.replays > 0 and any(c.graph is not None for c in full.captured.values())
    # device rounds (the CUDA default): each drafter->middle round replays one captured graph
    rounds = graph_gen.proposers["triforce"][0].graph
    assert rounds.graph is not None and rounds.runs > 5 and rounds.builds == 1
    # a replay runs exactly the kernels of the static view: acceptance is identical, not just close
    assert dict(graph_gen.stats.accepted) == dict(static_gen.stats.accepted)


@cuda
def test_prompts_turns_and_refills_capture_nothing_on_cuda(models):
    """The prompt's pieces (101 ids: 24 x 4 + 5), the drafter's window refill (4 + 16) and a chat turn
    of 5 tokens run eagerly: no graph is captured for them (graphs.GraphedModel.once); decoding
    captures its passes and rounds, and the tokens are the eager generator's."""
    from triforce.speculative.graphs import made

    pair = Models(*models)
    ids = torch.randint(0, 48, (101,), generator=torch.Generator().manual_seed(3)).tolist()
    runs = []
    for graphs in (False, True):
        gen = Generator(pair, CFG, "triforce", len(ids) + 2 * CFG.max_new_tokens + 5)
        if graphs:
            enable_cuda_graphs(gen)
        before = made["graphs"]
        tokens = [gen.prefill(ids)]
        assert made["graphs"] == before
        tokens += gen.generate()
        decoding = made["graphs"]
        tokens.append(gen.extend([5, 9, 11, 2, 7]))
        assert made["graphs"] == decoding
        tokens += gen.generate()
        runs.append(tokens)
    assert runs[0] == runs[1] and decoding > before


@cuda
def test_a_captured_round_samples_what_the_eager_round_samples(models):
    """Sampled, device rounds: the captured whole-round graph takes the round's uniforms from the same
    draws as the same round run eagerly, so the tokens match."""
    from dataclasses import replace

    cfg = replace(CFG, temperature=0.8, top_p=0.9, seed=3)
    static, _, _ = run(Models(*models), "triforce", graphs="static", cfg=cfg)
    graphed, gen, _ = run(Models(*models), "triforce", graphs="cuda", cfg=cfg)
    assert graphed == static and gen.proposers["triforce"][0].graph.graph is not None


@cuda
def test_lookups_beside_the_drafter_capture_their_own_rounds(models, monkeypatch):
    """An adaptive run with lookups beside its model drafter, every plan in a random order: the
    captured run gives the eager static run's tokens, which are plain decoding's, and each drafter's
    rounds replay their own graph."""
    import random
    from dataclasses import replace

    from triforce.speculative.adaptive import Chooser

    target, drafter = models
    reference, _, _ = run(Models(target, None), "autoregressive")
    cfg = replace(CFG, adaptive=True)
    outs = {}
    for graphs in ("static", "cuda"):
        rng = random.Random(4)
        monkeypatch.setattr(Chooser, "_choose", lambda self: rng.choice(self.plans))
        outs[graphs], gen, _ = run(Models(target, drafter), "triforce", graphs=graphs, cfg=cfg)
    assert outs["cuda"] == outs["static"] == reference
    assert {"lookup", "triforce-lookup"} <= set(gen.stats.modes)
    for mode in ("triforce", "triforce-lookup"):
        assert gen.proposers[mode][0].graph.graph is not None, mode


@cuda
@pytest.mark.parametrize("graphs", [None, "cuda"])
def test_device_rounds_on_cuda_read_once_per_round(models, graphs):
    """Triforce's device rounds (the CUDA default) and its host-driven rounds decode the
    autoregressive tokens; the device rounds' host waits once per full-cache round."""
    from dataclasses import replace

    from triforce.speculative.hostsync import HostSyncCounter

    target, drafter = models
    pair = Models(target, drafter)
    reference, _, _ = run(Models(target, None), "autoregressive")
    host, _, _ = run(pair, "triforce", graphs=graphs, cfg=replace(CFG, device_rounds=False))
    assert host == reference
    ids = torch.randint(0, 48, (101,), generator=torch.Generator().manual_seed(3)).tolist()
    gen = Generator(pair, CFG, "triforce", len(ids) + CFG.max_new_tokens)
    assert gen.device_rounds
    if graphs:
        enable_cuda_graphs(gen)
    gen.prefill(ids)
    out, rounds = [gen.context[-1]], 0
    # CUDA's own sync detector sees every synchronizing call, not only the entry points we patch;
    # graph captures synchronize once, so only the eager run is counted
    with warnings.catch_warnings(record=True) as caught, HostSyncCounter() as waits:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            while len(out) < CFG.max_new_tokens:
                out += gen.step()
                rounds += 1
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert out[:CFG.max_new_tokens] == reference
    if not graphs:
        # each synchronizing call warns "called a synchronizing CUDA operation"; turning the mode on warns
        # once that it is a prototype ("... does not yet detect all synchronizing operations"), which the
        # first H200 run counted as an 18th sync in 17 rounds
        syncs = [w for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
        sites = sorted({f"{w.filename}:{w.lineno}" for w in syncs})  # where each sync was called from
        assert waits.total == rounds and len(syncs) == rounds, (dict(waits.by_site), sites)


@cuda
@pytest.mark.parametrize("S", [299, 300])
@pytest.mark.parametrize("T", [1, 2, 7])
def test_grouped_attention_on_cuda_matches_float64(S, T):
    """Odd key counts take a split path on CUDA (cuBLAS's fallback kernels are slow there)."""
    g = torch.Generator().manual_seed(S + T)
    q = torch.randn(T, 8, 64, generator=g)
    keys, values = (torch.randn(2, S, 64, generator=g) for _ in "kv")
    ref = attention._attend_grouped(q.double(), keys.double(), values.double())
    got = attention._attend_grouped(q.cuda(), keys.cuda(), values.cuda())
    torch.testing.assert_close(got.cpu().double(), ref, atol=1e-5, rtol=1e-5)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,S", [(1, 4096), (7, 4096), (512, 4096)])
def test_shared_heads_attention_runs_fused_kernels(T, S, dtype):
    """The static views' masked attention and a later prefill piece's lower-right causal attention
    run on fused kernels (the math backend disabled: a fallback raises) and match float64."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    g = torch.Generator().manual_seed(T + S)
    q = torch.randn(T, 9, 64, generator=g, dtype=torch.float64)
    keys, values = (torch.randn(3, S, 64, generator=g, dtype=torch.float64) for _ in "kv")
    ref = written_out(q, keys, values)
    visible = torch.ones(T, S, dtype=torch.bool).tril(S - T)
    mask = attention.aligned_mask(T, S, dtype, "cuda")
    mask.masked_fill_(~visible.cuda(), float("-inf"))
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    args = (q.to("cuda", dtype), keys.to("cuda", dtype), values.to("cuda", dtype))
    with sdpa_kernel(fused):
        for bias in (mask, causal_lower_right(T, S)):
            got = attention.attend_shared_heads(*args, bias)
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
            torch.testing.assert_close(got.double().cpu(), ref, atol=tol, rtol=tol)


@cuda
def test_a_kernel_refusing_the_shared_heads_form_leaves_the_grouped_heads_call(monkeypatch):
    """Should a CUDA kernel refuse the zero-stride form, the call falls back once, with a warning."""
    def refuse(*args):
        raise RuntimeError("no kernel for these strides")

    monkeypatch.setattr(attention, "shared_heads_sdpa", refuse)
    monkeypatch.setattr(attention, "_REFUSED", set())
    g = torch.Generator().manual_seed(9)
    q = torch.randn(7, 9, 64, generator=g, dtype=torch.float64)
    keys, values = (torch.randn(3, 300, 64, generator=g, dtype=torch.float64) for _ in "kv")
    mask = attention.aligned_mask(7, 300, torch.float32, "cuda")
    mask.masked_fill_(~torch.ones(7, 300, dtype=torch.bool, device="cuda").tril(293), float("-inf"))
    args = (q.float().cuda(), keys.float().cuda(), values.float().cuda())
    with pytest.warns(UserWarning, match="refused the shared-heads form"):
        got = attention.attend_shared_heads(*args, mask)
    assert attention._REFUSED == {(torch.float32, True)}
    torch.testing.assert_close(got.double().cpu(), written_out(q, keys, values), atol=1e-4, rtol=1e-4)


@cuda
def test_a_16_bit_norm_is_one_kernel_within_a_rounding_of_transformers_form():
    """On CUDA a bf16 RMSNorm is one fused kernel (one rounding), where transformers' form is four
    (two roundings): the outputs part by at most one bf16 unit."""
    from torch.profiler import ProfilerActivity, profile

    from triforce.model.transformer import RMSNorm
    norm = RMSNorm(576, 1e-5).cuda().to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(576, device="cuda"))
    x = torch.randn(7, 576, device="cuda", dtype=torch.bfloat16)
    norm(x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof, torch.no_grad():
        ours = norm(x)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1, kernels
    theirs = norm.weight * torch.nn.functional.rms_norm(x.float(), (576,), eps=1e-5).to(torch.bfloat16)
    ulp = torch.finfo(torch.bfloat16).eps * theirs.float().abs().clamp(min=1e-3)
    assert ((ours.float() - theirs.float()).abs() <= ulp * 1.01).all()


@cuda
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
@pytest.mark.parametrize("T,S,end", [(7, 32768, 20000), (7, 4096, 4096), (17, 33792, 32785), (2, 2500, 300),
                                     (1, 32768, 30000)])
def test_split_keys_on_cuda_is_sdpas_attention(dtype, tol, T, S, end):
    """The CUDA kernel of the split-keys form (model/split_keys.py) over the offloaded slots' layout
    (token-major, seen as (Hkv, S, D)), pieces past the end masked whole, eager and in a CUDA graph."""
    from triforce.model import split_keys
    from ..model.test_split_keys import reference, static_view_mask

    g = torch.Generator().manual_seed(S + T)
    q = torch.randn(T, 9, 64, generator=g).to("cuda", dtype)
    keys, values = (torch.randn(S, 3, 64, generator=g).to("cuda", dtype).transpose(0, 1) for _ in "kv")
    mask = static_view_mask(T, S, end, dtype).cuda()
    got = split_keys.split_keys_attention(q, keys, values, mask)
    torch.testing.assert_close(got.double().cpu(), reference(q.cpu(), keys.cpu(), values.cpu(), mask.cpu()),
                               atol=tol, rtol=tol)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = split_keys.split_keys_attention(q, keys, values, mask)
    graph.replay()
    assert torch.equal(captured, got)
    assert split_keys.serves(T, S, q) == (S >= split_keys.MIN_KEYS)


@cuda
def test_a_captured_split_reads_only_its_own_bias():
    """The split form builds a mask's bias once and reuses it for the pass's later layers
    (split_keys.folded_bias). A graph must not read a bias built before its capture: the cache lets
    that go at the next mask, and the memory is reused. Two layers captured, the cache then moved to
    another mask and the freed memory overwritten: the replay still gives the attention."""
    from triforce.model import split_keys
    from ..model.test_split_keys import reference, static_view_mask

    g = torch.Generator().manual_seed(3)
    T, S = 5, 8192
    q = torch.randn(T, 9, 64, generator=g).to("cuda", torch.bfloat16)
    keys, values = (torch.randn(3, S, 64, generator=g).to("cuda", torch.bfloat16) for _ in "kv")
    mask = static_view_mask(T, S, 6000, torch.bfloat16).cuda()
    eager = split_keys.split_keys_attention(q, keys, values, mask)  # the cache holds an eager bias
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        first = split_keys.split_keys_attention(q, keys, values, mask)
        second = split_keys.split_keys_attention(q, keys, values, mask)
    split_keys.split_keys_attention(q, keys, values, static_view_mask(T, S, 100, torch.bfloat16).cuda())
    junk = [torch.full((3 * T, S), 7.0, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    graph.replay()
    del junk
    want = reference(q.cpu(), keys.cpu(), values.cpu(), mask.cpu())
    for got in (first, second):
        assert torch.equal(got, eager)
        torch.testing.assert_close(got.double().cpu(), want, atol=2e-2, rtol=2e-2)


@cuda
@pytest.mark.parametrize("offloaded", [False, True])
def test_captured_passes_with_split_keys_give_the_eager_tokens(models, offloaded, monkeypatch):
    """Every verification pass of the tiny run through the split-keys form (pieces of 32 keys from 64
    keys on): float32 greedy tokens equal the eager run's (grouped matmuls, no pieces)."""
    from triforce.model import split_keys

    monkeypatch.setattr(split_keys, "MIN_KEYS", 64)
    monkeypatch.setattr(split_keys, "PIECE", 32)
    target, drafter = models
    pair = Models(target, drafter)
    factory = full_cache_factory("cuda", CFG.prefill_chunk, onchip_layers=0, chunk_tokens=7) if offloaded else None
    eager, _, _ = run(pair, "triforce")
    captured, gen, _ = run(pair, "triforce", factory, graphs="cuda")
    assert captured == eager and gen.full.model.replays > 0


@cuda
def test_a_float32_query_cudnn_refuses_takes_the_split_keys(monkeypatch):
    """cuDNN takes no float32: one float32 query over 32K keys went to the memory-efficient kernel's
    9 blocks (plain decoding in float32 with the KV in host memory: 120 ms a pass, the link floor 27,
    session 37). It takes the split keys now, and gives the attention over all keys."""
    from triforce.model import split_keys
    from ..model.test_split_keys import reference, static_view_mask

    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 9, 64, generator=g).cuda()
    keys, values = (torch.randn(32768, 3, 64, generator=g).cuda().transpose(0, 1) for _ in "kv")
    mask = static_view_mask(1, 32768, 30000, torch.float32).cuda()
    assert not attention.grouped_takes_cudnn(q, keys, values, mask)
    assert not attention.takes_cudnn(q, keys, values, mask, grouped=False)
    taken = []
    real = split_keys.split_keys_attention
    monkeypatch.setattr(split_keys, "split_keys_attention", lambda *a, **k: taken.append(1) or real(*a, **k))
    got = attention.attend_shared_heads(q, keys, values, mask)
    assert taken == [1]
    torch.testing.assert_close(got.double().cpu(), reference(q.cpu(), keys.cpu(), values.cpu(), mask.cpu()),
                               atol=1e-4, rtol=1e-4)


@cuda
@pytest.mark.parametrize("S", [4096, 32768])
def test_one_query_takes_the_grouped_call_where_cudnn_does(S):
    """A one-query step over a mask: the grouped-heads call where cuDNN takes it (faster than the
    zero-stride view on the H200), else the view; the same attention either way, in a graph too."""
    from ..model.test_split_keys import static_view_mask

    g = torch.Generator().manual_seed(S)
    q = torch.randn(1, 9, 64, generator=g).to("cuda", torch.bfloat16)
    keys, values = (torch.randn(S, 3, 64, generator=g).to("cuda", torch.bfloat16).transpose(0, 1) for _ in "kv")
    mask = static_view_mask(1, S, S - 100, torch.bfloat16).cuda()
    got = attention.attend_shared_heads(q, keys, values, mask)
    torch.testing.assert_close(got, attention.shared_heads_sdpa(q, keys, values, mask), atol=2e-2, rtol=2e-2)
    takes = attention.fused_kernels_taking(q, keys, values, mask, grouped=True)["cudnn"]
    assert attention.grouped_takes_cudnn(q, keys, values, mask) == takes
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = attention.attend_shared_heads(q, keys, values, mask)
    graph.replay()
    assert torch.equal(captured, got)


@cuda
@pytest.mark.parametrize("T,S", [(2, 8192), (5, 8192), (7, 32768), (2, 300)])
def test_few_queries_as_one_query_heads_on_cuda(monkeypatch, T, S):
    """model/folded_heads.py on CUDA: the same attention as the split keys (or SDPA), decided by the
    device's clock at the first eager call and replayed in a graph as decided."""
    from triforce.model import folded_heads
    from ..model.test_split_keys import reference, static_view_mask

    monkeypatch.setattr(folded_heads, "_FOLDED_SERVES", {})
    g = torch.Generator().manual_seed(S + T)
    q = torch.randn(T, 9, 64, generator=g).to("cuda", torch.bfloat16)
    keys, values = (torch.randn(S, 3, 64, generator=g).to("cuda", torch.bfloat16).transpose(0, 1) for _ in "kv")
    mask = static_view_mask(T, S, S - 100, torch.bfloat16).cuda()
    want = reference(q.cpu(), keys.cpu(), values.cpu(), mask.cpu())
    folded = folded_heads.folded_heads_attention(q, keys, values, mask)
    torch.testing.assert_close(folded.double().cpu(), want, atol=2e-2, rtol=2e-2)
    got = attention.attend_shared_heads(q, keys, values, mask)  # decides the shape: timed both ways
    decided = folded_heads.decisions()
    assert len(decided) == 1
    print(f"\n{T} x {S}: folded heads serve: {list(decided.values())[0]} (cuDNN takes them: "
          f"{folded_heads.cudnn_takes(q, keys, values, mask)})")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = attention.attend_shared_heads(q, keys, values, mask)
    graph.replay()
    assert torch.equal(captured, got) and len(folded_heads.decisions()) == 1
    torch.testing.assert_close(got.double().cpu(), want, atol=2e-2, rtol=2e-2)


@cuda
@pytest.mark.parametrize("cache", ["resident", "offloaded"])
@pytest.mark.parametrize("graphs", [None, "cuda"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_plain_decoding_queued_ahead_gives_steps_tokens_on_cuda(models, cache, graphs, temperature):
    """On CUDA the next pass really runs while the host reads a token (engine._queued_tokens): the
    tokens of step() by step(), a stop included, and the same second answer after it."""
    from dataclasses import replace

    target, _ = models
    answers = []
    for ahead in (False, True):
        cfg = replace(CFG, temperature=temperature, seed=7, queue_ahead=ahead)
        factory = full_cache_factory("cuda", CFG.prefill_chunk, chunk_tokens=7) if cache == "offloaded" else None
        # room for the turn: the stopped answer, 3 ids, then a whole answer
        out, gen, _ = run(Models(target, None), "autoregressive", factory, graphs, cfg, room=CFG.max_new_tokens + 3)
        stop = frozenset({out[9]})
        gen.truncate(len(gen.context) - len(out) + 1)  # back to the first token, then stop early
        first = gen.generate(stop_ids=stop)
        second = [gen.extend([3, 4, 5])] + gen.generate()[1:]
        answers.append((out, first, second))
    assert answers[0] == answers[1]
    if temperature == 0:  # greedy: the same answer again, up to its stop
        out, first, _ = answers[0]
        assert first == out[:len(first)] and len(first) <= 10


@cuda
@pytest.mark.parametrize("cache", ["resident", "offloaded"])
@pytest.mark.parametrize("graphs", [None, "cuda"])
def test_adaptive_plain_passes_queued_ahead_give_plain_decodings_tokens_on_cuda(models, monkeypatch, cache, graphs):
    """The adaptive default's plain passes queued ahead on CUDA (the default there): the chooser picks
    each plan before the last token is read; plain decoding two passes in three, else any plan."""
    import random
    from dataclasses import replace

    from triforce.speculative.adaptive import Chooser, Plan

    target, drafter = models
    reference, _, _ = run(Models(target, None), "autoregressive")
    cfg = replace(CFG, adaptive=True)
    assert cfg.queues_ahead("cuda")
    factory = full_cache_factory("cuda", CFG.prefill_chunk, chunk_tokens=7) if cache == "offloaded" else None
    rng = random.Random(6)
    monkeypatch.setattr(Chooser, "_choose", lambda self: Plan("autoregressive", 0) if rng.random() < 0.67
                        else rng.choice(self.plans))
    out, gen, _ = run(Models(target, drafter), "triforce", factory, graphs, cfg)
    assert gen.reads is not None and out == reference
    assert gen.stats.modes["autoregressive"] >= 10 and len(gen.stats.modes) >= 3


@cuda
@pytest.mark.parametrize("mode", ["autoregressive", "triforce"])
def test_captured_offloaded_passes_through_staging_give_the_same_tokens(models, mode):
    """Where the store cannot be mapped (OffloadedCache.mapped None) a graphed pass's new K/V go back
    through pinned staging, which the host places before the next pass: the eager tokens."""
    target, drafter = models
    pair = Models(target, drafter if mode == "triforce" else None)
    factory = full_cache_factory("cuda", CFG.prefill_chunk, chunk_tokens=7)

    def staged(*args):
        cache = factory(*args)
        cache.mapped = None
        return cache

    ref, _, _ = run(pair, mode, factory)
    out, gen, _ = run(pair, mode, staged, graphs="cuda")
    assert out == ref and gen.full.cache.mapped is None


@cuda
def test_a_captured_kernel_writes_the_mapped_pinned_store():
    """HostStore.mapped on CUDA: a tensor on the GPU over the pinned store's own memory, which a kernel
    captured in a graph writes at the rows a device index names, and the host reads back."""
    from triforce.offload.store import HostStore

    store = HostStore(2, 64, 3, 8, torch.bfloat16, pin=True)
    store.k.copy_(torch.randn(store.k.shape))
    before = store.k.clone()
    k, _ = store.mapped(torch.device("cuda"))
    assert torch.equal(store.k, before)  # the probe's write put back: the store as the prompt left it
    store.k.zero_()
    assert k.is_cuda and k.data_ptr() == store.k.data_ptr() and k.dtype == torch.bfloat16
    rows = torch.zeros(2, dtype=torch.long, device="cuda")
    fresh = torch.zeros(2, 2, 3, 8, dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        k.index_copy_(1, rows, fresh)
    for start in (5, 40):
        rows.copy_(torch.arange(start, start + 2))
        fresh.copy_(torch.randn(2, 2, 3, 8, device="cuda").to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(store.k[:, start:start + 2], fresh.cpu())
    assert store.k[:, 7:40].abs().sum() == 0 and store.k[:, :5].abs().sum() == 0


@cuda
@pytest.mark.parametrize("offload", ["none", "host"])
def test_a_kept_prompt_and_window_load_to_the_same_tokens_on_cuda(tmp_path_factory, monkeypatch, offload):
    """runtime/prompt_cache.py on CUDA (graphs on, device rounds, a store in host memory): the run that
    loads the prompt and the drafter's window samples what the run that prefilled sampled."""
    import triforce
    from ..conftest import tiny_with_tokenizer

    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path_factory.mktemp("gpu-prompt-cache")))
    folder = tiny_with_tokenizer(tmp_path_factory, "gpu-prompt", seed=12)
    prompt = " ".join(f"t{3 + (i * 7) % 60}" for i in range(300))
    settings = dict(model=str(folder), device="cuda", offload=offload, draft="self", mode="triforce", adaptive=False,
                    temperature=1.0, seed=5, max_new_tokens=32, budget=64, chunk_size=8, gamma1=2, gamma2=3)
    prefilled = triforce.generate(prompt, prompt_cache="off", **settings).tokens
    kept = triforce.generate(prompt, prompt_cache="on", **settings)
    loaded = triforce.generate(prompt, prompt_cache="on", **settings)
    assert kept.report["prompt_cache"]["kept"] and loaded.report["prompt_cache"]["loaded"]
    assert prefilled == kept.tokens == loaded.tokens


@cuda
@pytest.mark.parametrize("offload", ["none", "host"])
def test_a_reused_prompt_prefix_makes_a_whole_prefills_tokens_on_cuda(tmp_path_factory, monkeypatch, offload):
    """runtime/prefill.py on CUDA: a question after a kept document loads the document's whole prefill
    pieces into the device cache (or the store in host memory), and the run samples what a whole
    prefill's run samples; the question, kept after the document's file, loads to the same tokens."""
    import triforce
    from ..conftest import tiny_with_tokenizer

    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path_factory.mktemp("gpu-prompt-prefix")))
    folder = tiny_with_tokenizer(tmp_path_factory, "gpu-prefix", seed=21)
    document = " ".join(f"t{3 + (i * 11) % 60}" for i in range(300))
    settings = dict(model=str(folder), device="cuda", offload=offload, draft="self", mode="triforce", adaptive=False,
                    temperature=1.0, seed=5, max_new_tokens=32, budget=64, chunk_size=8, gamma1=2, gamma2=3,
                    prefill_chunk=64)
    triforce.generate(document + " t5 t9", prompt_cache="on", **settings)
    reusing = triforce.generate(document + " t8 t6 t4", prompt_cache="on", **settings)
    assert reusing.report["prompt_cache"]["reused"] >= 256
    assert reusing.tokens == triforce.generate(document + " t8 t6 t4", prompt_cache="off", **settings).tokens
    # kept as the question's tokens after the document's file (kvfile.save's `after`): loading reads both
    loaded = triforce.generate(document + " t8 t6 t4", prompt_cache="on", **settings)
    assert loaded.report["prompt_cache"]["loaded"] and loaded.tokens == reusing.tokens
