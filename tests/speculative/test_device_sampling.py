"""Sampling and acceptance on the device equal a plain host implementation, uniform for uniform.

The reference below is the pre-issue-22 verify_sampled (token by token, now verify_tokens; block
verification has its own in test_block_verification.py) written out with Python loops (accept draft
x while u * q(x) < p(x); at the first rejection draw from norm(max(0, p - q)); after all, from the
bonus row), with the draw made by inversion from the same uniform, so both must return the same
accepted count and the same next token for every input.
"""
import torch

from triforce.speculative.sampling import draw_rows, verify_greedy, verify_tokens

V = 12


def reference_draw(dist: torch.Tensor, u: float) -> int:
    """The first token whose cumulative mass exceeds u * total, skipping tokens of zero mass."""
    weights = [float(w) for w in dist.to(torch.float64)]
    target, cumulative = u * sum(weights), 0.0
    last = max(i for i, w in enumerate(weights) if w > 0)
    for i, w in enumerate(weights):
        cumulative += w
        if cumulative > target and w > 0:
            return i
    return last


def reference_verify(drafts, draft_probs, target_probs, uniforms) -> tuple[int, int]:
    g = len(drafts)
    for i, x in enumerate(drafts):
        p, q = float(target_probs[i, x]), float(draft_probs[i, x])
        if float(uniforms[i]) * q < p:
            continue
        residual = (target_probs[i] - draft_probs[i]).clamp_min(0)
        dist = residual / residual.sum() if residual.sum() > 0 else target_probs[i]
        return i, reference_draw(dist, float(uniforms[g]))
    return g, reference_draw(target_probs[g], float(uniforms[g]))


def random_dists(rows: int, gen: torch.Generator, dtype) -> torch.Tensor:
    """Peaked distributions with some exact zeros (as top-k / top-p leave them)."""
    logits = torch.randn(rows, V, generator=gen, dtype=torch.float64) * 2
    logits[torch.rand(rows, V, generator=gen) < 0.3] = float("-inf")
    logits[:, 0] = logits[:, 0].clamp_min(0)  # every row keeps some mass
    return torch.softmax(logits, dim=-1).to(dtype)


def test_device_verification_equals_the_reference():
    gen = torch.Generator().manual_seed(0)
    outcomes = set()
    for case in range(600):
        g = case % 6
        dtype = torch.float32 if case % 2 else torch.float64
        q, p = random_dists(g, gen, dtype), random_dists(g + 1, gen, dtype)
        if case % 5 == 0 and g:
            p[:g] = q  # p == q: every draft stands
        drafts = draw_rows(q, torch.rand(g, generator=gen, dtype=torch.float64)) if g else torch.zeros(0, dtype=torch.long)
        uniforms = torch.rand(g + 1, generator=gen, dtype=torch.float64)
        accepted, nxt = verify_tokens(drafts, q, p, uniforms)
        expected = reference_verify(drafts.tolist(), q, p, uniforms)
        assert (int(accepted), int(nxt)) == expected, (case, g)
        outcomes.add((g, expected[0] == g))
    # both ways out of the loop were taken at every draft count
    assert {(g, full) for g in range(1, 6) for full in (True, False)} <= outcomes


def test_draws_equal_the_reference_and_never_pick_zero_mass():
    gen = torch.Generator().manual_seed(1)
    probs = random_dists(200, gen, torch.float32)
    uniforms = torch.rand(200, generator=gen, dtype=torch.float64)
    uniforms[:5] = torch.tensor([0.0, 1 - 2 ** -53, 0.5, 1e-300, 1 - 1e-12], dtype=torch.float64)
    tokens = draw_rows(probs, uniforms)
    assert tokens.tolist() == [reference_draw(p, float(u)) for p, u in zip(probs, uniforms)]
    assert bool((probs.gather(1, tokens[:, None]) > 0).all())


def test_greedy_acceptance_is_the_first_mismatch():
    drafts = torch.tensor([5, 6, 7, 8])
    for argmax, expected in (([5, 6, 7, 8, 9], (4, 9)), ([5, 1, 7, 8, 9], (1, 1)), ([0, 6, 7, 8, 9], (0, 0)),
                             ([5, 6, 7, 2, 9], (3, 2))):
        accepted, nxt = verify_greedy(drafts, torch.tensor(argmax))
        assert (int(accepted), int(nxt)) == expected
    accepted, nxt = verify_greedy(torch.zeros(0, dtype=torch.long), torch.tensor([4]))
    assert (int(accepted), int(nxt)) == (0, 4)
