"""bench/retrieval_rules.py on a tiny GQA model: each rule's retrieval cache holds what the rule says
and the engine's rule is the engine's own build (the attention mass itself: tests/speculative/test_caches.py)."""
import pytest
import torch

from bench import retrieval_rules as rr
from triforce.model.loader import load_model
from triforce.speculative.retrieval import RetrievalCache, attention_mass
from tests.conftest import save_tiny

CONTEXT, CONTINUATION, BUDGET, CHUNK = 150, 20, 48, 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gqa")
    save_tiny(folder, seed=5, vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, inter=48)
    model = load_model(folder, torch.float64)
    ids = torch.randint(0, 64, (CONTEXT + CONTINUATION,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        full, p_logits, queries = rr.full_logits(model, ids, CONTEXT)
    return model, ids, full, p_logits, queries


def held(cache: RetrievalCache, full, layer: int, n: int) -> list[set[int]]:
    """The positions each KV head's persistent slots hold, found by their keys (random float64 keys
    are distinct)."""
    keys, _ = full.read(layer, 0, n)
    out = []
    for h in range(keys.shape[0]):
        match = (cache.k[layer, h, :cache.budget, None] == keys[h, None]).all(-1)
        assert match.any(dim=1).all()
        out.append(set(match.float().argmax(dim=1).tolist()))
    return out


def middle(setup, rule):
    model, ids, full, _, queries = setup
    with torch.inference_mode():
        return rr.middle_logits(model, rule, full, ids, CONTEXT, queries, BUDGET, CHUNK)


def test_the_full_logits_are_one_pass_over_the_text(setup):
    model, ids, _, p_logits, _ = setup
    whole = rr.FullCache(model.kv_shape(), len(ids))
    with torch.inference_mode():
        reference = model(ids[:-1], whole)[CONTEXT - 1:].double()
    assert p_logits.shape == (CONTINUATION, 64)
    torch.testing.assert_close(p_logits, reference, rtol=1e-9, atol=1e-9)


def test_the_engines_rule_builds_the_engines_cache(setup):
    model, ids, full, _, queries = setup
    engine = RetrievalCache(model.kv_shape(), BUDGET, CHUNK, scratch=CONTINUATION + 8)
    engine.build(full, CONTEXT - 1, [q[-1] for q in queries])
    _, bench = middle(setup, rr.RULES["mass + recent half"])
    assert torch.equal(bench.k[:, :, :BUDGET], engine.k[:, :, :BUDGET])


def test_recent_only_holds_the_sink_and_one_window_of_the_latest_tokens(setup):
    _, _, full, _, _ = setup
    _, cache = middle(setup, rr.RULES["recent only"])
    n = CONTEXT - 1
    for layer in range(cache.shape.num_layers):
        for positions in held(cache, full, layer, n):
            assert positions == set(range(CHUNK)) | set(range(n - (BUDGET - CHUNK), n))


def test_the_mean_key_rule_is_triforces(setup):
    _, _, full, _, queries = setup
    n_chunks = (CONTEXT - 1) // CHUNK
    for layer, q in enumerate(queries):
        keys, _ = full.read(layer, 0, n_chunks * CHUNK)
        Hkv, rep = keys.shape[0], q.shape[1] // keys.shape[0]
        means = keys.view(Hkv, n_chunks, CHUNK, -1).mean(dim=2)
        expected = torch.zeros(Hkv, n_chunks, dtype=torch.float64)
        for head in range(q.shape[1]):
            expected[head // rep] += torch.softmax(means[head // rep] @ q[-1, head] / q.shape[-1] ** 0.5, dim=0)
        got = rr.mean_key_scores(q[-1], full.chunk_key_means(layer, CHUNK, n_chunks))
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)


def test_sixteen_queries_sum_what_each_gives(setup):
    _, _, full, _, queries = setup
    n_chunks = (CONTEXT - 1) // CHUNK
    q = queries[0]
    each = sum(attention_mass(full, 0, q[i:i + 1], n_chunks, CHUNK) for i in range(16))
    torch.testing.assert_close(attention_mass(full, 0, q[-16:], n_chunks, CHUNK), each)


def test_every_rule_gives_a_row_per_window_and_agreement_in_bounds(setup):
    model, ids, *_ = setup
    tokens = ids.tolist() * 2
    rows = rr.compare(model, {"random": tokens}, CONTEXT, CONTINUATION, BUDGET, CHUNK)
    assert len(rows) == len(rr.RULES) * len(rr.windows(tokens, CONTEXT + CONTINUATION))
    assert all(0 <= r[k] <= 1 for r in rows for k in ("greedy", *rr.SAMPLERS))
    means = rr.summary(rows, 6)
    assert [m["rule"] for m in means] == list(rr.RULES)
    assert "rule" in rr.table(means)


def test_an_unknown_rule_is_named_before_any_load(capsys):
    with pytest.raises(SystemExit):
        rr.main(["--model", "/nonexistent", "--rules", "mean key (TriForce's),nope"])
    assert "unknown rule: nope" in capsys.readouterr().err


def test_summaries_of_one_position_are_the_full_cache(setup):
    """Every position the budget leaves out, summarized alone, is that position: the middle level then
    computes the full cache's distributions (float64), so the summaries' attention is right."""
    _, _, _, p_logits, _ = setup
    q_logits, _ = middle(setup, rr.summarized(rr.RULES["mass + recent half"], 1))
    torch.testing.assert_close(q_logits, p_logits, rtol=1e-9, atol=1e-9)
    plain, _ = middle(setup, rr.RULES["mass + recent half"])
    assert not torch.allclose(plain, p_logits)  # the budget does leave something out


def test_a_groups_summary_is_exact_at_the_build_query_and_skips_held_positions():
    gen = torch.Generator().manual_seed(0)
    Hkv, Hq, n, D, group = 2, 4, 24, 8, 6
    keys, values = torch.randn(Hkv, n, D, generator=gen, dtype=torch.float64), torch.randn(Hkv, n, D, generator=gen, dtype=torch.float64)
    free = torch.rand(Hkv, n, generator=gen) < 0.6
    free[:, :group] = False  # the first group wholly held
    query = torch.randn(Hq, D, generator=gen, dtype=torch.float64)
    k_star, v_star, bias = rr.group_summaries(keys, values, free, query, group)
    assert torch.isinf(bias[:, 0]).all() and torch.isfinite(bias[:, 1:]).all()
    for h in range(Hq):
        kv = h // (Hq // Hkv)
        raw = (query[h] @ keys[kv].T * D ** -0.5).masked_fill(~free[kv], -float("inf"))
        mass = raw.view(-1, group).logsumexp(-1)
        scored = query[h] @ k_star[h].T * D ** -0.5 + bias[h]
        torch.testing.assert_close(scored, mass)  # each group's log-mass, exactly, at the build query
        exact = torch.softmax(raw, -1) @ values[kv]
        torch.testing.assert_close(torch.softmax(scored, -1) @ v_star[h], exact)  # and what it returns
