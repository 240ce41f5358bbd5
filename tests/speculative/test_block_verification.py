"""Block verification (sampling.verify_block) is exact, never accepts fewer tokens in expectation than
speculative sampling's token-by-token rule, and the device code is the rule, uniform for uniform.

The rule is written out below with Python loops (`block_rule`): the weights w_i, the chance h_i of
stopping after i drafts and the next token's law there. `exact_law` enumerates every draft of a
3-token vocabulary (the drafter's and target's distributions depend on the whole prefix) and every
stop, completes the round's output with the target, and compares the law of the first g + 1 tokens
with the target's own: equal to rounding, where a wrong weight misses by more than 1e-3. The
device function must then return what the loops return for the same uniforms.
"""
import itertools
import zlib

import pytest
import torch

from triforce.model.errors import UserError
from triforce.speculative import GenerationConfig
from triforce.speculative.sampling import draw_rows, verify_block, verify_sampled, verify_tokens

from .test_device_sampling import random_dists, reference_draw

V, G = 3, 3


def prefix_dist(prefix: tuple, which: str) -> torch.Tensor:
    """A fixed distribution over V tokens for each prefix, the drafter's ("q") or the target's ("p"):
    logits shared by both plus each one's own noise, so that they agree as a drafter and target do."""
    def normal(key):  # seeded by a stable hash: Python's hash of a str varies by process
        return torch.randn(V, generator=torch.Generator().manual_seed(zlib.crc32(repr(key).encode())), dtype=torch.float64)
    return torch.softmax(normal(prefix) * 1.5 + normal((prefix, which)), dim=0)


def block_rule(p_rows, q_rows, drafts, last: int, carry: bool = True):
    """(w, h, next-token laws) for drafts verified by block: w_i = min(w_{i-1} p/q, 1), h_i the chance
    of stopping at i once no later stop was taken (h_last = w_last), laws[i] the next token's law
    there. carry=False is a wrong rule for the tests to catch: w_i = w_{i-1} min(p/q, 1)."""
    w = [1.0]
    for i in range(last):
        ratio = float(p_rows[i][drafts[i]]) / float(q_rows[i][drafts[i]])
        w.append(min(w[-1] * ratio, 1.0) if carry else w[-1] * min(ratio, 1.0))
    h, laws = [], []
    for i in range(last):
        dtype = p_rows[i].dtype  # the device computes the stopping mass in the distributions' dtype
        rest = (torch.tensor(w[i], dtype=dtype) * p_rows[i] - q_rows[i].to(dtype)).clamp_min(0)
        mass = float(rest.sum(dtype=torch.float64))
        h.append((mass, mass + 1 - w[i]))  # h_i as a fraction: the device compares u * den < mass
        laws.append(rest / mass if mass > 0 else p_rows[i])
    h.append((w[last], 1.0))
    laws.append(p_rows[last])
    return w, h, laws


def stop_chances(h) -> list[float]:
    """P(stop at i) for i = 0 .. last: the first success scanning down from the last (0 if none)."""
    chances, none_yet = [0.0] * len(h), 1.0
    for i in range(len(h) - 1, 0, -1):
        mass, den = h[i]
        chance = mass / den if den > 0 else 0.0
        chances[i], none_yet = none_yet * chance, none_yet * (1 - chance)
    chances[0] = none_yet
    return chances


def stopping_time(drafts: tuple) -> int:
    """How many drafts are proposed: one after a 0, else G (depends only on the drafts before)."""
    return 1 if drafts[0] == 0 else G


def exact_law(carry: bool = True) -> torch.Tensor:
    """The law of the first G + 1 output tokens: one round verified by block, then the target."""
    law = torch.zeros([V] * (G + 1), dtype=torch.float64)
    for drafts in itertools.product(range(V), repeat=G):
        last = stopping_time(drafts)
        if any(drafts[last:]):  # drafts past the stop are not drawn: count each proposal once
            continue
        chance = 1.0
        for i in range(last):
            chance *= float(prefix_dist(drafts[:i], "q")[drafts[i]])
        p_rows = [prefix_dist(drafts[:i], "p") for i in range(last + 1)]
        q_rows = [prefix_dist(drafts[:i], "q") for i in range(last)]
        _, h, laws = block_rule(p_rows, q_rows, drafts, last, carry)
        for stop, stop_chance in enumerate(stop_chances(h)):
            for y in range(V):
                head = drafts[:stop] + (y,)
                for tail in itertools.product(range(V), repeat=G - stop):
                    tokens, c = head + tail, chance * stop_chance * float(laws[stop][y])
                    for k in range(stop + 1, G + 1):
                        c *= float(prefix_dist(tokens[:k], "p")[tokens[k]])
                    law[tokens] += c
    return law


def target_law() -> torch.Tensor:
    law = torch.zeros([V] * (G + 1), dtype=torch.float64)
    for tokens in itertools.product(range(V), repeat=G + 1):
        c = 1.0
        for k in range(G + 1):
            c *= float(prefix_dist(tokens[:k], "p")[tokens[k]])
        law[tokens] = c
    return law


def test_block_verification_has_the_targets_law_and_a_wrong_weight_does_not():
    target = target_law()
    assert float((exact_law() - target).abs().max()) < 1e-12
    assert float((exact_law(carry=False) - target).abs().max()) > 1e-3  # the check has teeth


def expected_accepted(drafts, p_rows, q_rows) -> tuple[float, float]:
    """Accepted drafts in expectation for these drafts: by block, and token by token."""
    _, h, _ = block_rule(p_rows, q_rows, drafts, len(drafts))
    block = sum(i * c for i, c in enumerate(stop_chances(h)))
    token, standing = 0.0, 1.0
    for i, x in enumerate(drafts):
        standing *= min(1.0, float(p_rows[i][x]) / float(q_rows[i][x]))
        token += standing
    return block, token


def test_block_never_accepts_fewer_in_expectation_and_equals_tokens_for_point_masses():
    block = token = 0.0
    for drafts in itertools.product(range(V), repeat=G):
        chance = 1.0
        for i in range(G):
            chance *= float(prefix_dist(drafts[:i], "q")[drafts[i]])
        p_rows = [prefix_dist(drafts[:i], "p") for i in range(G + 1)]
        b, t = expected_accepted(drafts, p_rows, [prefix_dist(drafts[:i], "q") for i in range(G)])
        block, token = block + chance * b, token + chance * t
        # drafts looked up (point masses): the same chance of each stop as token by token
        points = [torch.nn.functional.one_hot(torch.tensor(x), V).to(torch.float64) for x in drafts]
        b, t = expected_accepted(drafts, p_rows, points)
        assert b == pytest.approx(t, abs=1e-12)
    assert block > token * 1.02, (block, token)  # 0.845 against 0.823 drafts here


def reference_block(drafts, draft_probs, target_probs, uniforms, last: int) -> tuple[int, int]:
    """The rule with loops: scan down from the last draft for the first uniform under its h."""
    _, h, laws = block_rule(list(target_probs), list(draft_probs), drafts, last)
    stop = 0
    for i in range(last, 0, -1):
        mass, den = h[i]
        if float(uniforms[i - 1]) * den < mass:
            stop = i
            break
    law = laws[stop]
    if stop < last:  # the device draws from the unnormalised rest in the probabilities' dtype
        w, _, _ = block_rule(list(target_probs), list(draft_probs), drafts, last)
        rest = (torch.tensor(w[stop], dtype=target_probs.dtype) * target_probs[stop] - draft_probs[stop]).clamp_min(0)
        law = rest if float(rest.sum()) > 0 else target_probs[stop]
    return stop, reference_draw(law, float(uniforms[len(drafts)]))


def test_device_block_verification_equals_the_loops():
    gen = torch.Generator().manual_seed(5)
    stops = set()
    for case in range(2000):
        g = 2 + case % 5
        dtype = torch.float32 if case % 2 else torch.float64
        q, p = random_dists(g, gen, dtype), random_dists(g + 1, gen, dtype)
        if case % 7 == 0:
            p[:g] = q  # p == q: every draft stands
        drafts = draw_rows(q, torch.rand(g, generator=gen, dtype=torch.float64))
        uniforms = torch.rand(g + 1, generator=gen, dtype=torch.float64)
        last = g if case % 3 else int(torch.randint(0, g + 1, (1,), generator=gen))
        limit = None if last == g and case % 2 else torch.tensor(last)
        accepted, nxt = verify_block(drafts, q, p, uniforms, limit=limit)
        expected = reference_block(drafts.tolist(), q, p, uniforms, last)
        assert (int(accepted), int(nxt)) == expected, (case, g, last)
        stops.add((g, expected[0]))
    assert {(g, s) for g in range(2, 7) for s in range(g + 1)} <= stops  # every stop was taken


def test_one_draft_by_block_is_one_draft_token_by_token():
    """verify_block hands a single draft to verify_tokens: the loops' block rule agrees with it."""
    gen = torch.Generator().manual_seed(6)
    for case in range(300):
        q, p = random_dists(1, gen, torch.float64), random_dists(2, gen, torch.float64)
        drafts = draw_rows(q, torch.rand(1, generator=gen, dtype=torch.float64))
        uniforms = torch.rand(2, generator=gen, dtype=torch.float64)
        last = case % 2
        accepted, nxt = verify_tokens(drafts, q, p, uniforms, limit=torch.tensor(last))
        assert (int(accepted), int(nxt)) == reference_block(drafts.tolist(), q, p, uniforms, last)


def test_the_rule_is_chosen_by_name_and_an_unknown_one_is_refused():
    gen = torch.Generator().manual_seed(7)
    differ = False
    for _ in range(200):
        q, p = random_dists(4, gen, torch.float64), random_dists(5, gen, torch.float64)
        drafts = draw_rows(q, torch.rand(4, generator=gen, dtype=torch.float64))
        uniforms = torch.rand(5, generator=gen, dtype=torch.float64)
        by_block, by_token = verify_sampled(drafts, q, p, uniforms), verify_sampled(drafts, q, p, uniforms, rule="token")
        assert [int(t) for t in by_block] == [int(t) for t in verify_block(drafts, q, p, uniforms)]
        assert [int(t) for t in by_token] == [int(t) for t in verify_tokens(drafts, q, p, uniforms)]
        differ |= int(by_block[0]) != int(by_token[0])
    assert differ
    assert GenerationConfig().verification == "block"
    with pytest.raises(UserError, match="verification must be one of block, token"):
        GenerationConfig(verification="tree")
