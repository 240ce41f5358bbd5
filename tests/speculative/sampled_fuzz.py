"""Random sampled settings, every token checked: a case draws a mode, a drafter (a model, the target
itself, lookups), host or device rounds (or each round one graph, run eagerly), a resident or
offloaded full cache, temperature, top-p, top-k, the verification rule, and budgets, windows and
rebuild thresholds small enough that a run of 40 tokens rebuilds its retrieval cache and evicts from
its drafter's window; half the cases converse (an answer cut back, a turn added, another answer).
Each of a few hundred seeds generates; every generated token is then set beside the target's exact
distribution given the tokens before it (one float64 pass over what the run had said), and a
chi-square stratified by the previous token (test_round_exactness's stratified_p_value,
conservative) must not reject at ALPHA.

test_sampling.py checks the first round against enumeration; this reaches the states a long run
goes through (rebuilds, evictions, adaptive switches, rounds capped by device-side lengths, a chat's
later turns). `test_sampled_fuzz.py` runs a fixed few; for a long run:

    python -m tests.speculative.sampled_fuzz --cases 40 --seed 3
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile

import torch

from triforce.model.errors import UserError
from triforce.model.loader import load_model
from triforce.offload import full_cache_factory
from triforce.speculative import GenerationConfig, Generator, Models
from triforce.speculative.caches import FullCache
from triforce.speculative.graphs import enable_cuda_graphs
from triforce.speculative.lookup import LookupDrafter
from triforce.speculative.sampling import Sampler

from ..conftest import save_tiny
from .test_round_exactness import VOCAB, stratified_p_value

ALPHA = 1e-4  # a correct engine fails a case with probability below this (the test is conservative)


def tiny(seed: int, layers: int):
    folder = tempfile.mkdtemp(prefix="sampled-fuzz-")
    save_tiny(folder, seed=seed, vocab=VOCAB, hidden=16, layers=layers, heads=2, kv_heads=1, inter=24)
    return load_model(folder, torch.float64)


class Pair:
    """Targets of one and two layers and an unrelated drafter, built once per process."""

    def __init__(self):
        self.targets = {layers: tiny(31, layers) for layers in (1, 2)}
        self.drafter = tiny(32, 1)


def draw(seed: int) -> dict:
    r = random.Random(seed)
    mode = r.choice(["speculative", "retrieval", "triforce", "triforce"])
    chunk = r.choice([2, 4, 8])
    config = dict(temperature=r.choice([0.3, 0.6, 1.0, 1.5]), top_p=r.choice([1.0, 1.0, 0.9, 0.6]),
                  top_k=r.choice([0, 0, 3, 5]), budget=chunk * r.randint(4, 8), chunk_size=chunk,
                  gamma1=r.randint(1, 4), gamma2=r.randint(1, 8), lookup_gamma=r.randint(1, 8),
                  draft_window=r.choice([2, 4, 8, 16]), sink_tokens=r.randint(0, 4),
                  verification=r.choice(["block", "token"]), adaptive=r.random() < 0.3, lookup=r.random() < 0.5,
                  device_rounds=mode == "triforce" and r.random() < 0.5, rebuild_threshold=r.choice([0.0, 0.5, 1.0]),
                  prefill_chunk=r.choice([None, 3, 16]))
    # a conversation: the answer cut back by a few tokens, a turn added, another answer (chat's calls)
    turns = [(r.randint(1, 10), [r.randrange(VOCAB) for _ in range(r.randint(1, 12))], r.randint(5, 30))
             for _ in range(r.choice([0, 0, 1, 2]))]
    return dict(seed=seed, mode=mode, drafter=r.choice(["model", "self", "lookup"]), layers=r.randint(1, 2),
                whole_rounds=config["device_rounds"] and r.random() < 0.5, offload=r.random() < 0.3,
                prompt=torch.randint(0, VOCAB, (r.randint(70, 150),), generator=torch.Generator().manual_seed(seed)).tolist(),
                config=config, turns=turns)


def draws_of(case: dict, pair: Pair, seeds: int, new_tokens: int) -> list:
    """(previous token, token, the target's exact distribution there) for every token of every seed,
    each answer of a conversation against the context it was drawn after."""
    target = pair.targets[case["layers"]]
    prompt, config, turns = case["prompt"], case["config"], case.get("turns", [])
    sampler = Sampler(config["temperature"], config["top_p"], config["top_k"])
    # room for each turn and the most any answer may take (extend keeps max_new_tokens free after a turn)
    max_len = len(prompt) + new_tokens + sum(len(tokens) + 1 + new_tokens for _, tokens, _ in turns)
    draws = []

    def judge(shown: list[int], start: int) -> None:  # shown[start:] was sampled after shown[:start]
        logits = target(torch.tensor(shown[:-1]), FullCache(target.kv_shape(), len(shown)))
        exact = sampler.probs(logits[start - 1:])
        draws.extend((shown[i - 1], shown[i], exact[i - start]) for i in range(start, len(shown)))

    for seed in range(seeds):
        drafter = {"model": pair.drafter, "self": None, "lookup": LookupDrafter()}[case["drafter"]]
        factory = full_cache_factory("cpu", config["prefill_chunk"] or 64, chunk_tokens=5) if case["offload"] else None
        gen = Generator(Models(target, drafter), GenerationConfig(**config, max_new_tokens=new_tokens, seed=seed),
                        case["mode"], max_len=max_len, full_cache_factory=factory)
        if case["whole_rounds"]:
            enable_cuda_graphs(gen, eager_static=True)
        gen.prefill(prompt)
        start = len(prompt)
        answer = gen.generate()
        for cut, tokens, budget in turns:
            judge(gen.context[:start] + answer, start)
            gen.truncate(max(start + 1, start + len(answer) - cut))
            gen.extend(tokens)
            start = len(gen.context) - 1
            answer = gen.generate(budget)
        judge(gen.context[:start] + answer, start)
    return draws


def p_value(case: dict, pair: Pair, seeds: int = 300, new_tokens: int = 40) -> float | None:
    """The case's p-value, None where the engine refuses its settings (a UserError)."""
    try:
        return stratified_p_value(draws_of(case, pair, seeds, new_tokens))[0]
    except UserError:
        return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0, help="cases seed*1000 .. seed*1000 + cases - 1")
    parser.add_argument("--seeds", type=int, default=300, help="sampled runs a case")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    pair, rejected = Pair(), 0
    for i in range(args.cases):
        case = draw(args.seed * 1000 + i)
        p = p_value(case, pair, args.seeds)
        rejected += p is not None and p < ALPHA
        verdict = "refused" if p is None else "REJECTED" if p < ALPHA else "ok"
        print(f"{verdict} p={p if p is None else f'{p:.2e}'} {case['mode']} {case['drafter']} "
              f"whole={case['whole_rounds']} offload={case['offload']} {case['config']}", flush=True)
    print(f"{args.cases} cases, {rejected} rejected")
    return 1 if rejected else 0


if __name__ == "__main__":
    sys.exit(main())
