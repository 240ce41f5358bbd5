"""Cache invariants: rollback, the StreamingLLM window, retrieval selection vs brute force, errors."""
import math

import pytest
import torch

from triforce.speculative import GenerationConfig, Generator, Models, UserError
from triforce.model.kv import KVShape
from triforce.speculative.caches import FullCache, StreamingCache
from triforce.model.loader import load_model
from triforce.speculative.retrieval import RetrievalCache, check_budget, plan_selection
from triforce.model.rope import Rotary

from ..conftest import save_tiny

SHAPE = KVShape(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float64, device=torch.device("cpu"))


def filled_full_cache(n, heads_q=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = FullCache(SHAPE, n + 16)
    cache.begin(n)
    for layer in range(SHAPE.num_layers):
        k = torch.randn(n, SHAPE.num_kv_heads, SHAPE.head_dim, generator=g, dtype=torch.float64)
        v = torch.randn(n, SHAPE.num_kv_heads, SHAPE.head_dim, generator=g, dtype=torch.float64)
        cache.attend(layer, torch.randn(n, heads_q, SHAPE.head_dim, generator=g, dtype=torch.float64), k, v)
    cache.end(n)
    return cache


def brute_force_positions(full, layer, head, query, n, budget, chunk):
    """Positions a retrieval cache should hold for (layer, head), computed the slow obvious way: the
    sink chunk, the latest tokens from a chunk boundary, and the chunks between them with the most
    attention from the query's heads that share this KV head (the last one cut to fit)."""
    rep = query.shape[0] // SHAPE.num_kv_heads
    n_chunks = n // chunk
    keys = full.k[layer, head, :n_chunks * chunk]
    mass = [0.0] * n_chunks
    for qh in range(head * rep, (head + 1) * rep):  # the query heads sharing this KV head
        logits = [float(query[qh] @ k) / math.sqrt(SHAPE.head_dim) for k in keys]
        top = max(logits)
        weights = [math.exp(x - top) for x in logits]
        for t, w in enumerate(weights):
            mass[t // chunk] += w / sum(weights)
    recent = int(budget * RetrievalCache.RECENT_SHARE)
    latest = max(chunk + n % chunk, min(recent, budget - 3 * chunk + 1))
    tail_start = (n - latest) // chunk * chunk
    assert tail_start % chunk == 0 and n - tail_start >= latest
    room = budget - chunk - (n - tail_start)
    candidates = list(range(1, tail_start // chunk))
    chosen = sorted(candidates, key=lambda c: -mass[c])[:-(-room // chunk)]
    positions = set(range(chunk)) | set(range(tail_start, n))
    for rank, c in enumerate(chosen):
        take = min(chunk, room - rank * chunk)  # the last one keeps its last tokens
        positions |= set(range((c + 1) * chunk - take, (c + 1) * chunk))
    return positions


@pytest.mark.parametrize("n,budget,chunk", [(96, 32, 8), (101, 48, 8), (77, 24, 4), (203, 64, 16)])
def test_retrieval_selection_matches_brute_force(n, budget, chunk):
    full = filled_full_cache(n)
    queries = [q[-1] for q in full.queries]
    cache = RetrievalCache(SHAPE, budget, chunk, scratch=8)
    cache.build(full, n, queries)
    for layer in range(SHAPE.num_layers):
        for head in range(SHAPE.num_kv_heads):
            expected = brute_force_positions(full, layer, head, queries[layer], n, budget, chunk)
            assert len(expected) == budget
            # find each held key in the full cache: keys are random, so equality identifies the position
            held = cache.k[layer, head, :budget]
            matches = (held[:, None, :] == full.k[layer, head, :n][None]).all(-1)
            positions = {int(i) for i in matches.float().argmax(dim=1)}
            assert matches.any(dim=1).all() and positions == expected
            values = cache.v[layer, head, :budget]
            order = matches.float().argmax(dim=1)
            assert torch.equal(values, full.v[layer, head, order])


def test_retrieval_absorb_replaces_lowest_scoring_slots():
    n, budget, chunk = 120, 48, 8
    full = filled_full_cache(n + 10)
    full.rollback(n)
    cache = RetrievalCache(SHAPE, budget, chunk, scratch=8)
    cache.build(full, n, [q[-1] for q in full.queries])
    before = cache.k[:, :, :budget].clone()
    victims = cache.victims[:, :, :3].clone()
    full.used = full.length = n + 3
    cache.absorb(full, n + 3)
    after = cache.k[:, :, :budget]
    changed = (after != before).any(-1)
    for layer in range(SHAPE.num_layers):
        for head in range(SHAPE.num_kv_heads):
            assert set(changed[layer, head].nonzero().flatten().tolist()) == set(victims[layer, head].tolist())
            for i in range(3):
                assert torch.equal(after[layer, head, victims[layer, head, i]], full.k[layer, head, n + i])
    assert cache.length == n + 3 and cache.room() == cache.replaceable - 3


def test_full_cache_rollback_then_append_overwrites():
    full = filled_full_cache(50)
    keep = full.k[:, :, :45].clone()
    full.rollback(45)
    assert full.length == 45 and full.used == 45
    full.begin(2)
    for layer in range(SHAPE.num_layers):
        full.attend(layer, torch.zeros(2, 6, 8, dtype=torch.float64), torch.ones(2, 2, 8, dtype=torch.float64),
                    torch.ones(2, 2, 8, dtype=torch.float64))
    full.end(2)
    assert full.length == 47 and torch.equal(full.k[:, :, :45], keep) and (full.k[:, :, 45:47] == 1).all()


def test_streaming_window_keeps_sinks_and_last_token():
    rotary = Rotary(__import__("triforce.model.config", fromlist=["ModelConfig"]).ModelConfig(
        vocab_size=8, hidden_size=16, intermediate_size=8, num_layers=3, num_heads=2, num_kv_heads=2, head_dim=8,
        max_position_embeddings=64))
    cache = StreamingCache(SHAPE, rotary, sinks=3, window=10, slack=4)
    marks = []
    for t in range(60):
        cache.begin(1)
        mark = torch.full((1, 2, 8), float(t), dtype=torch.float64)
        for layer in range(SHAPE.num_layers):
            cache.attend(layer, torch.zeros(1, 2, 8, dtype=torch.float64), mark, mark)
        cache.end(1)
        marks.append(t)
        # values are not rotated: slot contents tell which token they hold
        held = cache.v[0, 0, :cache.used, 0].tolist()
        assert held[:3] == [0.0, 1.0, 2.0][:min(3, t + 1)]
        assert held[-1] == float(t)
        assert held[3:] == [float(x) for x in range(t + 1 - (cache.used - 3), t + 1)][-len(held[3:]):] if t >= 3 else True
        assert cache.used <= 3 + 10 + 4
    cache.rollback(57)
    assert cache.length == 57 and cache.v[0, 0, cache.used - 1, 0] == 56.0


def test_budget_errors():
    with pytest.raises(UserError, match="budget must be > 0"):
        check_budget(0, 8, 100)
    with pytest.raises(UserError, match="multiple of the chunk"):
        check_budget(100, 8, 400)
    with pytest.raises(UserError, match="smaller than the prompt"):
        check_budget(512, 8, 300)
    with pytest.raises(UserError, match="budget"):
        GenerationConfig(budget=-8)
    with pytest.raises(UserError, match="gamma1"):
        GenerationConfig(gamma1=0)


@pytest.mark.parametrize("partial", range(8))
def test_budget_rule_boundary(partial):
    """One rule for the config and the cache: 4 chunks is the least budget, and it always retrieves at
    least one chunk whatever the length's remainder (the recent tail then spans two chunks)."""
    with pytest.raises(UserError, match="fewer than 4 chunks of 8"):
        GenerationConfig(budget=24, chunk_size=8)
    with pytest.raises(UserError, match="fewer than 4 chunks of 8"):
        check_budget(24, 8, 400)
    GenerationConfig(budget=32, chunk_size=8)
    n = 200 + partial
    check_budget(32, 8, n)
    index, _, replaceable = plan_selection(n, 32, 8, torch.rand(2, n // 8))
    assert replaceable >= 1 and index.shape == (2, 32)
    assert all(len(set(row.tolist())) == 32 for row in index)  # no position twice


def test_prompt_longer_than_configured_maximum(tmp_path):
    save_tiny(tmp_path, seed=1)
    model = load_model(tmp_path, torch.float64)
    gen = Generator(Models(model, None), GenerationConfig(max_new_tokens=8), "autoregressive", max_len=40)
    with pytest.raises(UserError, match="exceeds the context"):
        gen.prefill(list(range(3, 40)))


def test_shared_prefill_gives_the_same_tokens(tmp_path):
    """Engines started from one prefill (snapshot) produce what fresh prefills would."""
    save_tiny(tmp_path, seed=5)
    model = load_model(tmp_path, torch.float64)
    prompt = torch.randint(0, 64, (90,), generator=torch.Generator().manual_seed(2)).tolist()
    cfg = GenerationConfig(max_new_tokens=40, budget=32, chunk_size=8, gamma1=2, gamma2=4, draft_window=16)
    first = Generator(Models(model, None), cfg, "autoregressive", max_len=140)
    first.prefill(prompt)
    reference = first.generate()
    seed = Generator(Models(model, None), cfg, "autoregressive", max_len=140)
    seed.prefill(prompt)
    snap = seed.snapshot()
    for mode in ("triforce", "retrieval", "autoregressive", "speculative"):
        gen = Generator(Models(model, None), cfg, mode, max_len=140, prefilled=snap)
        assert gen.generate() == reference, mode
