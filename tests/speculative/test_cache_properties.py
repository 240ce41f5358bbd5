"""Property-based tests: random append / rollback / absorb / rebuild sequences against a plain
reference of what each cache must hold. Values encode token positions, so a shrunk
counterexample reads as a list of operations and positions."""
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from triforce.model.kv import KVShape
from triforce.speculative.caches import FullCache, StreamingCache
from triforce.model.config import ModelConfig
from triforce.speculative.retrieval import RetrievalCache
from triforce.model.rope import Rotary

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float64, device=torch.device("cpu"))
ROTARY = Rotary(ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2,
                            num_kv_heads=2, head_dim=4, max_position_embeddings=512))


def write(cache, positions):
    """Append tokens whose V rows hold their position (K: random-ish but deterministic)."""
    n = len(positions)
    cache.begin(n)
    pos = torch.tensor(positions, dtype=torch.float64)
    v = pos[:, None, None].expand(n, SHAPE.num_kv_heads, SHAPE.head_dim).clone()
    k = torch.sin(pos[:, None, None] * torch.arange(1, 1 + SHAPE.num_kv_heads * SHAPE.head_dim,
                                                    dtype=torch.float64).view(1, SHAPE.num_kv_heads, -1))
    for layer in range(SHAPE.num_layers):
        cache.attend(layer, torch.zeros(n, 2, SHAPE.head_dim, dtype=torch.float64), k, v)
    cache.end(n)


ops = st.lists(st.tuples(st.sampled_from(["append", "rollback"]), st.integers(1, 9)), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_full_cache_matches_reference(operations):
    cache, reference = FullCache(SHAPE, 400), []
    for op, n in operations:
        if op == "append":
            new = list(range(len(reference), len(reference) + n))
            write(cache, new)
            reference += new
        else:
            keep = max(0, len(reference) - n)
            cache.rollback(keep)
            del reference[keep:]
        assert cache.length == len(reference)
        assert cache.v[:, :, :cache.length, 0].eq(torch.tensor(reference, dtype=torch.float64)).all()


@settings(max_examples=60, deadline=None)
@given(ops, st.integers(1, 4), st.integers(8, 20))
@example([("append", 1)] * 12 + [("append", 8), ("rollback", 9), ("rollback", 9)], 1, 8)  # found on another machine
@example([("append", 1)] * 19 + [("append", 4), ("append", 9), ("rollback", 9), ("append", 1), ("rollback", 9),
          ("append", 1), ("rollback", 4)], 1, 11)  # rollbacks past the round: now limited to it
@example([("append", 1)] * 7 + [("append", 7), ("append", 9), ("append", 9), ("rollback", 2), ("rollback", 9),
          ("rollback", 9)], 1, 11)  # rollbacks in a row, more than a round's speculation in all
def test_streaming_cache_holds_sinks_and_a_recent_suffix(operations, sinks, window):
    cache, reference = StreamingCache(SHAPE, ROTARY, sinks=sinks, window=window, slack=10), []
    pending = 0  # the newest tokens a rollback may still take: at most a round's speculation (9 here)
    for op, n in operations:
        if op == "append":
            new = list(range(len(reference), len(reference) + n))
            write(cache, new)
            reference += new
            pending = min(9, pending + n)  # older tokens are settled: no engine rolls back past a round
        else:  # the engines roll back only tokens of the current round (which the window always holds);
            # once tokens were evicted, at least one window token must survive to be the newest.
            # (Counting rollbacks only since the last append let append 1 / rollback 9 repeat and take
            # 8 settled tokens each time, which no engine does: hypothesis found it, seen once.)
            n = min(n, pending, cache.used - (cache.sinks + 1 if cache.evictions else 0), len(reference))
            pending -= n
            cache.rollback(len(reference) - n)
            del reference[len(reference) - n:]
        held = cache.v[0, 0, :cache.used, 0].long().tolist()
        s = min(sinks, len(reference))
        assert held[:s] == reference[:s], "sinks lost"
        suffix = held[s:]
        assert suffix == reference[len(reference) - len(suffix):] if suffix else True, "window not a suffix"
        assert len(reference) <= sinks or (held and held[-1] == reference[-1]), "last token lost"
        assert cache.used <= cache.capacity and cache.length == len(reference)
        assert len(suffix) >= min(window, len(reference) - s) - 9, "window shrank below its size"



def test_streaming_cache_evicts_once_per_slack_tokens():
    """A drafter appends a token or two a pass: once the cache is full an eviction frees the whole
    slack, so the window moves once per `slack` tokens, not on every pass (keeping all that fit made
    every pass after the first `slack` tokens re-rotate the whole window: 2x a SmolLM2 draft pass)."""
    sinks, window, slack = 2, 16, 8
    cache, n = StreamingCache(SHAPE, ROTARY, sinks=sinks, window=window, slack=slack), 0
    while n < 200:
        before = cache.evictions
        write(cache, [n])
        n += 1
        if cache.evictions > before:  # it moved the window down next to the sinks, then took the token
            assert cache.used == sinks + window + 1
    filled = sinks + window + slack  # the first eviction comes when these slots are all taken
    assert cache.evictions == -(-(n - filled) // slack)


@settings(max_examples=40, deadline=None)
@given(st.integers(60, 140), st.sampled_from([(24, 4), (32, 8), (48, 8)]),
       st.lists(st.tuples(st.sampled_from(["absorb", "speculate", "rebuild"]), st.integers(1, 6)), max_size=25))
def test_retrieval_cache_holds_sink_tail_and_every_absorbed_token(n, budget_chunk, operations):
    budget, chunk = budget_chunk
    full = FullCache(SHAPE, 400)
    write(full, list(range(n)))
    cache = RetrievalCache(SHAPE, budget, chunk, scratch=8)
    query = [torch.ones(2, SHAPE.head_dim, dtype=torch.float64)] * SHAPE.num_layers
    cache.build(full, n, query)
    absorbed = set()
    for op, k in operations:
        length = cache.base
        if op == "speculate":  # scratch tokens come and go without touching persistent slots
            before = cache.v[:, :, :budget].clone()
            write(cache, list(range(1000, 1000 + min(k, 8))))
            cache.rollback(length)
            assert torch.equal(cache.v[:, :, :budget], before)
            continue
        write(full, list(range(full.length, full.length + k)))
        if op == "rebuild" or k > cache.room():
            cache.build(full, full.length, query)
            absorbed = set()
        else:
            cache.absorb(full, full.length)
            absorbed |= set(range(full.length - k, full.length))
        for layer in range(SHAPE.num_layers):
            for head in range(SHAPE.num_kv_heads):
                held = set(cache.v[layer, head, :budget, 0].long().tolist())
                assert len(held) == budget, "a position is held twice"
                assert set(range(chunk)) <= held, "sink chunk lost"
                assert absorbed <= held, "an absorbed token was evicted before a rebuild"
                assert max(held) == full.length - 1, "newest token missing"
        assert cache.length == cache.base == full.length
