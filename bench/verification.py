"""Block verification against token-by-token verification, sampled, in the engine.

    python -m bench.verification                        # SmolLM2, 8K of Persuasion, 8 seeds a rule
    python -m bench.verification --context 4096 --modes triforce --seeds 16 --gamma2 16

Both rules are exact (speculative/sampling.py), so what they differ in is how many drafts a full pass
keeps. Each mode runs from one prefill with each rule and seeds 1..N, alternating, and two figures
come out:

    realized     tokens per full pass, and each edge's acceptance, over the runs of that rule
    expected     for every full-cache verification of every run (either rule's), the drafts each
                 rule would keep in expectation given those very drafts and distributions: paired on
                 the same drafts, so seeds' luck cancels and few runs tell a small difference

The second is exact arithmetic, not sampling (`expected_kept`): token by token, the sum over i of the
product of min(1, p/q) up to i; by block, the sum over i of the chance that some stop at i or later
is taken (1 minus the product of 1 - h_j for j >= i). Writes results/verification-<time>.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from triforce.cli.common import run_cli
from triforce.runtime.settings import generation_config, make_settings
from triforce.speculative.sampling import block_terms

from .prompts import open_story_session
from .measure import build_system, shared_prefill, system_settings

DEFAULT_BOOK = Path(__file__).resolve().parent.parent / "triforce" / "data" / "persuasion.txt"
RULES = ("block", "token")


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def expected_kept(drafts, draft_probs, target_probs, limit) -> tuple[float, float]:
    """(block, token): the drafts each rule keeps in expectation, given these drafts (g,), their
    distributions (g, V), the target's (g + 1, V) and the count proposed (None: all g)."""
    g = drafts.shape[0]
    if g == 0:
        return 0.0, 0.0
    positions, last, w, mass, den = block_terms(drafts, draft_probs, target_probs, limit)
    L = int(last[0])
    if L == 0:
        return 0.0, 0.0
    h = torch.where(den > 0, mass / den.clamp_min(1e-300), 0.0)[:L].clone()
    h[L - 1] = w[L]
    miss_from = torch.flip(torch.cumprod(torch.flip(1 - h, (0,)), 0), (0,))  # no stop at i..L, i = 1..L
    block = float((1 - miss_from).sum())
    p = target_probs[positions - 1, drafts].double()[:L]
    q = draft_probs[positions - 1, drafts].double()[:L]
    token = float(torch.cumprod(torch.minimum(p / q, torch.ones_like(p)), 0).sum())
    return block, token


UNSET = object()


def record_full_verifications(gen, into: list) -> None:
    """Wrap the generator's verification so that the full level's calls append (block, token)
    expectations to `into`. The engine's step is the one caller that passes `limit` (None after host
    rounds); the middle level's calls (speculative proposer, device rounds) do not."""
    sampling = gen.sampling
    verify = sampling.verify

    def recorded(drafts, draft_probs, logits, limit=UNSET, uniforms=None):
        if limit is UNSET:
            return verify(drafts, draft_probs, logits, uniforms=uniforms)
        if draft_probs is not None and drafts.shape[0]:
            into.append(expected_kept(drafts, draft_probs, sampling.sampler.probs(logits), limit))
        return verify(drafts, draft_probs, logits, limit=limit, uniforms=uniforms)

    sampling.verify = recorded


def run_seed(gen, prefilled, seed: int, into: dict) -> str:
    """One sampled run of `gen` from the prefill with `seed`, its counts added to `into`."""
    gen.resume(prefilled.prompt, prefilled.queries, prefilled.first)
    gen.sampling.generator.manual_seed(seed)
    made = len(gen.generate()) - 1  # the first token came from the prefill
    into["tokens"] += made
    into["full_passes"] += gen.stats.full_passes
    for edge, proposed in gen.stats.proposed.items():
        before = into["edges"].get(edge, (0, 0))
        into["edges"][edge] = (before[0] + proposed, before[1] + gen.stats.accepted[edge])
    return f"{made} tokens in {gen.stats.full_passes} full passes"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/smollm2-135m")
    ap.add_argument("--draft", default=None, help="the drafter (default: the model's natural one)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prompt-file", default=str(DEFAULT_BOOK))
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--modes", default="retrieval,triforce")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--gamma1", type=int, default=None)
    ap.add_argument("--gamma2", type=int, default=None)
    ap.add_argument("--budget", type=int, default=None)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="the compute dtype (auto: generate's default on this machine)")
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "same", "bfloat16", "float16", "float32"])
    ap.add_argument("--offload", default="none", choices=["none", "host"], help="host: the full KV cache in host memory")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    run = make_settings(model=args.model, draft=args.draft, threads=args.threads, context=args.context, max_new_tokens=args.new_tokens,
                        temperature=args.temperature, top_p=args.top_p, gamma1=args.gamma1, gamma2=args.gamma2, budget=args.budget,
                        dtype=args.dtype, kv_dtype=args.kv_dtype, offload=args.offload,
                        adaptive=False)
    session = open_story_session(run, Path(args.prompt_file).read_text(), args.context)
    prompt = session.prompt_ids
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    cfgs = {m: generation_config(replace(session.run, **system_settings(m)), len(prompt)) for m in modes}
    max_len = len(prompt) + args.new_tokens
    prefilled = shared_prefill(session, cfgs, prompt, max_len, f"prefill {len(prompt)}")
    seeds = list(range(1, args.seeds + 1))
    rows = []
    for mode in modes:
        results, gens = {}, {}
        for rule in RULES:
            gens[rule] = build_system(session, mode, replace(cfgs[mode], verification=rule), prefilled, max_len)
            results[rule] = {"tokens": 0, "full_passes": 0, "edges": {}, "paired": []}
            record_full_verifications(gens[rule], results[rule]["paired"])
        for seed in seeds:  # the rules alternate seed by seed, so drift hits both alike
            for rule in RULES:
                say(f"  {mode} {rule} seed {seed}: {run_seed(gens[rule], prefilled, seed, results[rule])}")
        rows.append(summarise(mode, cfgs[mode], results))
        del gens
    print(table(rows))
    out = Path(args.out or f"results/verification-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"settings": vars(args), "rows": rows}, indent=2))
    print(f"wrote {out}")
    session.close()
    return 0


def summarise(mode, cfg, results) -> dict:
    paired = results["block"]["paired"] + results["token"]["paired"]
    block, token = [b for b, _ in paired], [t for _, t in paired]
    gains = [b - t for b, t in zip(block, token)]
    return {"mode": mode, "gamma1": cfg.gamma1, "gamma2": cfg.gamma2, "budget": cfg.budget,
            "realized": {rule: {"tokens_per_full_pass": r["tokens"] / max(r["full_passes"], 1),
                                "tokens": r["tokens"], "full_passes": r["full_passes"],
                                "acceptance": {e: kept / proposed for e, (proposed, kept) in r["edges"].items() if proposed}}
                         for rule, r in results.items()},
            "expected": {"verifications": len(gains), "block": statistics.fmean(block), "token": statistics.fmean(token),
                         # each rule's mean over verifications: its standard error, to set runs of other
                         # settings (a dtype, a prompt) beside each other, where nothing is paired
                         "block_stderr": stderr(block), "token_stderr": stderr(token),
                         "gain": statistics.fmean(gains),
                         "gain_stderr": stderr(gains)}}


def stderr(values) -> float | None:
    return statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else None


def table(rows) -> str:
    lines = ["mode        g1  g2   tokens/full pass      drafts kept per full pass, paired (expected)",
             "                     block     token       block    token    gain (+- s.e.)"]
    for r in rows:
        e, z = r["expected"], r["realized"]
        lines.append(f"{r['mode']:<11} {r['gamma1']:>2}  {r['gamma2']:>2}   {z['block']['tokens_per_full_pass']:>6.2f}"
                     f"    {z['token']['tokens_per_full_pass']:>6.2f}      {e['block']:>6.3f}   {e['token']:>6.3f}"
                     f"   {e['gain']:+.3f} ({e['gain_stderr'] or 0:.3f}) over {e['verifications']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(run_cli(main))
