"""The adaptive chooser's arithmetic against what fixed modes really run at, on real weights.

    python -m bench.projection_check --context 4096 --new-tokens 96 --gamma1 2 --gamma2 3 --repeats 2

Every choice an adaptive run makes, and every figure bench.big_target projects for a GPU, is the
chooser's prediction: each level's measured pass costs, each mode's round overhead, and the tokens a
verification yields at the acceptance seen. This runs each fixed mode from one shared prefill (the
engine the command line builds: `triforce generate --no-adaptive --mode M`), a warm-up decode, then
a timed one whose passes and verifications go to one chooser, and prices each timed run at its own
plan and acceptance (bench.big_target.check). A ratio near 1 says the arithmetic holds on this
machine. Beside it, per mode, the tokens a full pass yielded against what the chooser expects from
those verifications: counted position by position (what the chooser uses) and from one rate per
proposal (what it used before session 28).
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
from dataclasses import replace
from pathlib import Path

from bench import big_target
from bench.measure import timed_run
from triforce.cli.common import run_cli
from triforce.runtime.defaults import DEFAULT_MODEL
from triforce.runtime.session import Session
from triforce.runtime.settings import make_settings
from triforce.runtime.text import read_prompt_file
from triforce.speculative import Generator
from triforce.speculative.adaptive import Chooser
from triforce.speculative.pricing import tokens_per_verification

MODES = big_target.MODES
CHECKED_EDGE = {"speculative": "draft->verify", "retrieval": "middle->verify", "triforce": "middle->verify"}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.projection_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--prompt-file", default="triforce/data/persuasion.txt")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--budget", type=int, default=None, help="retrieval budget (default: the run's, a quarter of the context)")
    p.add_argument("--gamma1", type=int, default=2)
    p.add_argument("--gamma2", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=1, help="timed runs of every mode (each priced on its own)")
    p.add_argument("--out", help="write the figures as JSON here")
    return p.parse_args(argv)


def check_once(session, cfg, prefilled, max_len: int, gammas: dict[str, int]) -> dict:
    """Each mode timed once from the prefill, then priced at its own plan and acceptance."""
    meter, runs, seen = Chooser(MODES, cfg.gamma1, cfg.gamma2), {}, {}
    for mode in MODES:
        gen = session.generator(replace(cfg, adaptive=False), max_len, prefilled=prefilled, mode=mode)
        timed_run(gen, prefilled)  # warm-up
        for level in gen.seq.levels:
            level.meter = meter
        meter.acceptance = seen[mode] = big_target.WholeRun()
        tokens, seconds, stats = timed_run(gen, prefilled)
        passes = sum(stats.seconds.values())
        runs[mode] = {"ms_per_token": 1e3 * seconds / len(tokens), "tokens": tokens,
                      "tokens_per_full_pass": stats.decode_tokens / max(stats.full_passes, 1),
                      "overhead_ms_per_round": 1e3 * max(stats.decode_seconds - passes, 0.0) / max(stats.full_passes, 1)}
        edge = CHECKED_EDGE.get(mode)
        if edge and seen[mode].known(edge):
            rate = big_target.seen_rates(seen[mode])[edge]
            runs[mode]["expected_tokens"] = {"by position": seen[mode].expected(edge, gammas[mode]),
                                             "one rate": tokens_per_verification(rate, gammas[mode])}
        gc.collect()
    overheads = {m: r["overhead_ms_per_round"] / 1e3 for m, r in runs.items()}
    for mode, ms in big_target.check(meter, overheads, seen, gammas).items():
        runs[mode]["predicted_ms_per_token"] = ms
    plain = runs["autoregressive"]["tokens"]
    for run in runs.values():
        run["same_tokens_as_plain"] = run.pop("tokens") == plain
    runs["pass_costs_ms"] = {lv: {n: 1e3 * s for n, s in sorted(w.items())} for lv, w in meter.costs.mean.items()}
    return runs


def main(argv=None) -> int:
    args = parse_args(argv)
    run = make_settings(None, sampling="greedy", model=args.model, draft="self", context=args.context,
                        max_new_tokens=args.new_tokens, threads=args.threads, dtype=args.dtype,
                        gamma1=args.gamma1, gamma2=args.gamma2, budget=args.budget)
    session = Session(run, read_prompt_file(args.prompt_file)[0]).load()  # as triforce-generate reads it
    cfg = session.plan_generation()
    max_len = session.needed + 4 * cfg.gamma2
    seed = Generator(session.loaded.models, cfg, "triforce", max_len=max_len)
    seed.prefill(session.prompt_ids)
    prefilled = seed.snapshot()
    gammas = {"autoregressive": 0, "speculative": cfg.gamma1, "retrieval": cfg.gamma2, "triforce": cfg.gamma2}
    repeats = [check_once(session, cfg, prefilled, max_len, gammas) for _ in range(args.repeats)]
    figures = {"model": args.model, "context": len(session.prompt_ids), "new_tokens": args.new_tokens,
               "budget": cfg.budget, "gamma1": cfg.gamma1, "gamma2": cfg.gamma2, "dtype": session.run.dtype,
               "threads": session.run.threads, "weights": session.weights, "repeats": repeats}
    print_tables(figures)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(figures, indent=1, default=str))
    return 0


def print_tables(figures: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    title = (f"{Path(figures['model']).name} drafting for itself, {figures['context']} tokens, {figures['new_tokens']} "
             f"new, greedy, gamma1 {figures['gamma1']}, gamma2 {figures['gamma2']}, budget {figures['budget']}")
    table = Table("#", "mode", "ms/tok", "pred.", "ratio", "tok/pass", "expect", "1 rate", title=title,
                  caption="ms/tok measured, pred. predicted, ratio pred./measured; tok/pass: what a full pass committed; "
                  "expect: what the chooser expects of those verifications, counted by position; 1 rate: from one rate "
                  "per proposal (before session 28)")
    for i, runs in enumerate(figures["repeats"], 1):
        for mode in MODES:
            r = runs[mode]
            predicted, expected = r.get("predicted_ms_per_token"), r.get("expected_tokens", {})
            table.add_row(str(i), mode, f"{r['ms_per_token']:.2f}", f"{predicted:.2f}" if predicted else "-",
                          f"{predicted / r['ms_per_token']:.3f}" if predicted else "-", f"{r['tokens_per_full_pass']:.2f}",
                          f"{expected['by position']:.2f}" if expected else "-",
                          f"{expected['one rate']:.2f}" if expected else "-")
    console.print(table)
    same = all(r["same_tokens_as_plain"] for runs in figures["repeats"] for r in runs.values() if isinstance(r, dict)
               and "same_tokens_as_plain" in r)
    console.print("every mode gave plain decoding's tokens" if same else "SOME MODE DID NOT GIVE PLAIN DECODING'S TOKENS")
    last = figures["repeats"][-1]["pass_costs_ms"]
    console.print("pass costs (ms, by tokens per pass, last run): " +
                  "; ".join(f"{lv} " + ", ".join(f"{n}: {ms:.2f}" for n, ms in widths.items()) for lv, widths in last.items()))


if __name__ == "__main__":
    sys.exit(run_cli(main))
