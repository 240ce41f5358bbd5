"""Timing our engines from one shared prefill, and telling a tie from a divergence.

What bench.py, sweep.py and compare_deepspeed.py share: each prefills a prompt once, times every
engine decoding from that snapshot, and checks greedy runs token for token against autoregressive
decoding. A mismatch at a logit gap of a few units in the last place of the dtype is rounding (a
T-token pass sums in another order than T one-token passes), not a logic error.
"""
from __future__ import annotations

import time

from speculative import Generator
from speculative.engine import synchronize

OURS = ("autoregressive", "speculative", "retrieval", "triforce")  # our engines, by mode
TIE_ULPS = 4  # a logit gap of at most 4 units in the last place of the dtype (at the top logit) is rounding


def ulps_at(values, dtype):
    """The unit in the last place of `dtype` at each value's magnitude (bf16 at 20.0: 0.125)."""
    import torch

    mag = torch.exp2(torch.floor(torch.log2(values.abs().clamp_min(torch.finfo(dtype).tiny))))
    return mag * torch.finfo(dtype).eps


def ties_only(disagreements: dict) -> bool:
    return all(ulps <= TIE_ULPS for _, ulps in disagreements.values())


def run_system(session, mode, cfg, prefilled, max_len, models=None):
    gen = Generator(models or session.loaded.models, cfg, mode, max_len=max_len, prefilled=prefilled)
    synchronize(gen.device)
    start = time.perf_counter()
    tokens = gen.generate()
    synchronize(gen.device)
    return tokens, time.perf_counter() - start, gen.stats


def prefill_cache_factory(session, cfg):
    """The full cache of a prefill shared by the timed runs: in host memory with --offload host."""
    if session.run.offload != "host":
        return None
    from offload import full_cache_factory

    return full_cache_factory(device=session.device, prefill_chunk=cfg.prefill_chunk)


def logit_gap_ulps(session, prefilled, reference, tokens, at: int) -> float:
    """At the first greedy mismatch: the target's logit gap between the autoregressive token and
    the other run's, teacher-forced on the common prefix in one pass, in units in the last place of
    the dtype at the top logit. A few ulps is a tie that rounding (a T-token pass vs T one-token
    passes) may break either way; more is a real divergence."""
    import torch

    cache, model = prefilled.cache, session.loaded.models.target
    cache.rollback(len(prefilled.prompt))
    with torch.no_grad():
        logits = model(torch.tensor(reference[:at], device=session.device), cache)[-1]
    cache.rollback(len(prefilled.prompt))
    gap = (logits[reference[at]] - logits[tokens[at]]).abs()
    return float(gap / ulps_at(logits.max(), model.embed.weight.dtype))


def first_mismatch(tokens, reference):
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))
