"""Timing our engines from one shared prefill, and telling a tie from a divergence.

What bench.py, sweep.py and compare_deepspeed.py share: each prefills a prompt once, times every
engine decoding from that snapshot, and checks greedy runs token for token against autoregressive
decoding. A mismatch at a logit gap of a few units in the last place of the dtype is rounding (a
T-token pass sums in another order than T one-token passes), not a logic error.
"""
from __future__ import annotations

import time

from triforce.runtime.report import level_ms_per_pass, link_floor, pinned_h2d_bandwidth, torch_device_type  # noqa: F401
from triforce.speculative.engine import synchronize
from triforce.speculative.graphs import made as graphs_made

OURS = ("autoregressive", "speculative", "retrieval", "triforce", "adaptive")  # our systems, measured by default
# ours too, on request (--systems): triforce's two kinds of rounds, and plain decoding and triforce with
# --compile, plain decoding one pass at a time
VARIANTS = ("triforce-device", "triforce-host", "autoregressive-compiled", "retrieval-compiled", "triforce-compiled",
            "adaptive-compiled", "adaptive-no-lookup", "autoregressive-waiting", "adaptive-waiting",
            "triforce-gamma1-4", "adaptive-lookup", "retrieval-token", "triforce-token")
ALL_OURS = OURS + VARIANTS
# a system that is not a mode: (the mode whose levels it builds, its settings, generate.py's flags for it)
SYSTEM_MODES = {"adaptive": ("triforce", {"adaptive": True}, []),
                "triforce-device": ("triforce", {"device_rounds": True}, ["--no-adaptive", "--device-rounds"]),
                "triforce-host": ("triforce", {"device_rounds": False}, ["--no-adaptive", "--no-device-rounds"]),
                "autoregressive-compiled": ("autoregressive", {"compile": True}, ["--no-adaptive", "--compile"]),
                # plain decoding waiting for each token before queuing the next pass (the default before
                # session 38 on a GPU, and on CPU): beside `autoregressive`, what queuing ahead gains
                "autoregressive-waiting": ("autoregressive", {"queue_ahead": False}, ["--no-adaptive", "--no-queue-ahead"]),
                # the adaptive default's plain passes one at a time (before session 39 on a GPU)
                "adaptive-waiting": ("triforce", {"adaptive": True, "queue_ahead": False}, ["--no-queue-ahead"]),
                # triforce drafting 4 tokens a round, the GPU default before session 39 for the target
                # drafting for itself (runtime/settings.py SELF_DRAFT_GPU_GAMMA1 says why it is 1 now)
                "triforce-gamma1-4": ("triforce", {"gamma1": 4}, ["--no-adaptive", "--gamma1", "4"]),
                "retrieval-compiled": ("retrieval", {"compile": True}, ["--no-adaptive", "--compile"]),
                "triforce-compiled": ("triforce", {"compile": True}, ["--no-adaptive", "--compile"]),
                "adaptive-compiled": ("triforce", {"adaptive": True, "compile": True}, ["--compile"]),
                # the adaptive default without lookups beside its model drafter (the default before session 26)
                "adaptive-no-lookup": ("triforce", {"adaptive": True, "lookup": False}, ["--no-lookup"]),
                # the adaptive default weighing lookups beside the target drafting for itself on a GPU
                # (the default there before session 40: runtime/settings.py SELF_DRAFT_GPU_LOOKUP)
                "adaptive-lookup": ("triforce", {"adaptive": True, "lookup": True}, ["--lookup"]),
                # sampled drafts verified one at a time (the rule before session 53) beside block verification
                "retrieval-token": ("retrieval", {"verification": "token"}, ["--no-adaptive", "--verification", "token"]),
                "triforce-token": ("triforce", {"verification": "token"}, ["--no-adaptive", "--verification", "token"])}


def engine_mode(system: str) -> str:
    """The Generator mode of one of our systems: its own name, or the levels it builds."""
    return SYSTEM_MODES.get(system, (system,))[0]


def system_settings(system: str) -> dict:
    """Settings overrides of one of our systems: a mode runs as itself, not adaptive."""
    return {"mode": engine_mode(system), "adaptive": False, **SYSTEM_MODES.get(system, (None, {}))[1]}


def system_flags(system: str) -> list[str]:
    """generate.py's flags that run one of our systems."""
    return ["--mode", engine_mode(system), *SYSTEM_MODES.get(system, (None, {}, ["--no-adaptive"]))[2]]
TIE_ULPS = 4  # a logit gap of at most 4 units in the last place of the dtype (at the top logit) is rounding


def ulps_at(values, dtype):
    """The unit in the last place of `dtype` at each value's magnitude (bf16 at 20.0: 0.125)."""
    import torch

    mag = torch.exp2(torch.floor(torch.log2(values.abs().clamp_min(torch.finfo(dtype).tiny))))
    return mag * torch.finfo(dtype).eps


def ties_only(disagreements: dict) -> bool:
    return all(ulps <= TIE_ULPS for _, ulps in disagreements.values())


def build_system(session, mode, cfg, prefilled, max_len, models=None):
    """One of our engines decoding from a shared prefill, built as generate.py builds it
    (Session.generator: the offload factory and --cuda-graphs alike)."""
    gen = session.generator(cfg, max_len, prefilled=prefilled, mode=engine_mode(mode), models=models)
    if system_settings(mode).get("compile") and not session.run.compile:  # a compiled system beside eager ones
        from triforce.speculative.graphs import enable_compiled_passes

        enable_compiled_passes(gen)
    return gen


def timed_run(gen, prefilled, learned: bool = False):
    """(tokens, seconds, stats) of one decode from the shared prefill. The generator is put back at
    the prefill first, so one generator serves every repetition: what its first run captured (CUDA
    graphs) is replayed, not captured again inside the clock. `learned`: an adaptive generator keeps
    what its chooser learned in the runs before (Generator.resume)."""
    return counted_run(gen, prefilled, learned)[:3]


def counted_run(gen, prefilled, learned: bool = False, seed: int | None = None):
    """timed_run's (tokens, seconds, stats) and the graphs made inside its clock (CUDA captures,
    compiled pass widths). Those made while the generator is put back are not: a drafter's restart
    feeds its window's last piece (sinks + window modulo the feed size) through a graph, once per
    generator, before the clock starts, and counting it made every drafting row of session 40's H200
    run say "1 graph inside the clock" that its time did not contain. `seed`: sampling's, in place of
    the config's (a sampled bench draws another text each repetition)."""
    gen.resume(prefilled.prompt, prefilled.queries, prefilled.first, learned=learned, seed=seed)
    synchronize(gen.device)
    before = graphs_made["graphs"]
    start = time.perf_counter()
    tokens = gen.generate()
    synchronize(gen.device)
    return tokens, time.perf_counter() - start, gen.stats, graphs_made["graphs"] - before


def run_system(session, mode, cfg, prefilled, max_len, models=None):
    """One decode by a generator built for it (sweep.py, compare_deepspeed.py)."""
    return timed_run(build_system(session, mode, cfg, prefilled, max_len, models), prefilled)


# ------------------------------------------------------------------ time per level, and the link floor
def seed_mode(modes) -> str:
    """The mode whose generator prefills for all of `modes`: one with every level they use, so the
    offload planner keeps device memory for each one's retrieval and StreamingLLM caches."""
    modes = [engine_mode(m) for m in modes]
    middle = any(m in ("retrieval", "triforce") for m in modes)
    draft = any(m in ("speculative", "triforce") for m in modes)
    return {(True, True): "triforce", (True, False): "retrieval", (False, True): "speculative"}.get(
        (middle, draft), "autoregressive")


def seed_config(cfgs: dict):
    """The prefilling generator's GenerationConfig: the largest gammas of the systems' configs, so
    the full cache it allocates has room for any system's round (the budget is theirs: shared)."""
    from dataclasses import replace

    first = next(iter(cfgs.values()))
    budget = next((c.budget for m, c in cfgs.items() if engine_mode(m) in ("retrieval", "triforce")), first.budget)
    return replace(first, gamma1=max(c.gamma1 for c in cfgs.values()), gamma2=max(c.gamma2 for c in cfgs.values()),
                   budget=budget, adaptive=False)


def shared_prefill(session, cfgs: dict, prompt, max_len, label="prefill"):
    """Prefill `prompt` once, through Session.generator (the full cache generate.py would build), for
    the systems of `cfgs` ({mode: GenerationConfig}); returns the snapshot they all decode from."""
    from triforce.cli.progress import prefill_progress, watch_layers

    seed = session.generator(seed_config(cfgs), max_len, mode=seed_mode(cfgs))
    progress, advance = prefill_progress(session.console, len(prompt), label)
    with progress, watch_layers(seed.full.model, advance):  # the bar moves within a piece too
        seed.prefill(prompt, progress=advance)
    return seed.snapshot()


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
