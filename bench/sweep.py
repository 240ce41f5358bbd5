"""Where the time goes, and which settings pay: one prefill, then a grid of engine settings.

    python -m bench.sweep --context 32768 --modes retrieval,triforce --budgets 1024,2048,4096 --gamma2s 3,4,6

Prefills the prompt once (a real book) and runs, for every (mode, budget, gamma1, gamma2) in the grid,
the same number of new tokens from that prefill, alternating with the autoregressive reference so
drift hits all alike. Per setting: acceptance at each level, tokens per full-cache pass, milliseconds
per pass of each level (draft / middle / verify), tokens/s and speedup over autoregressive. Greedy
runs are checked token for token against the reference (a mismatch exits 1). This is the data the
defaults in triforce/runtime/settings.py were chosen from (docs/results/2026-11-23-cpu-epyc-2core.md, "Choosing the defaults").
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from bench.bench_report import wide
from triforce.cli.common import (DEFAULT_PROMPT_FILE, RunConfig, add_engine_args, add_model_args,
                            generation_config, read_text, run_cli, run_config)
from triforce.cli.progress import prefill_progress, watch_layers
from bench.measure import TIE_ULPS, first_mismatch, logit_gap_ulps, run_system
from bench.prompts import open_story_session
from triforce.speculative import Generator, UserError
from triforce.model.quant import resolve_lower_weights, with_lower_weights

LEVELS = ("draft", "middle", "verify")


@dataclass(frozen=True)
class SweepPlan:
    run: RunConfig  # loads the exact weights (lower weights 'same'): each setting derives its own proposers
    prompt_file: str | None
    modes: tuple[str, ...]
    grid: dict  # budgets, gamma1s, gamma2s, chunk_sizes: the values to try ([None]: the run's own)
    lowers: tuple[str, ...]  # the proposing levels' weights to try
    temperatures: tuple  # None: the run's own
    new_tokens: int
    repeats: int
    out: str | None
    accept_ties: bool


def parse_args(argv) -> SweepPlan:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    add_engine_args(p)
    p.add_argument("--prompt-file", help="a book (default: the embedded book prefix)")
    p.add_argument("--modes", default="retrieval,triforce", help="comma-separated engines to sweep")
    p.add_argument("--budgets", default="", help="retrieval budgets (default: --budget or the default)")
    p.add_argument("--gamma1s", default="", help="drafter lengths (default: --gamma1)")
    p.add_argument("--gamma2s", default="", help="middle lengths (default: --gamma2)")
    p.add_argument("--chunk-sizes", default="", help="retrieval chunk sizes (default: --chunk-size)")
    p.add_argument("--lower-weights-grid", default="", help="e.g. same,int8: the proposing levels' weights "
                                                            "(default: --lower-weights)")
    p.add_argument("--temperatures", default="", help="e.g. 0,0.6: greedy and sampled from one prefill "
                                                       "(default: --temperature; --top-p applies to all)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="timed runs per setting (after one warm-up)")
    p.add_argument("--out", help="write the rows as JSON")
    p.add_argument("--accept-ties", action="store_true",
                   help=f"do not fail on a greedy mismatch at a logit tie (gap <= {TIE_ULPS} ulps of the dtype)")
    p.add_argument("--debug", action="store_true")
    args = p.parse_args(argv)
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    grid = {name: _ints(getattr(args, name), name) for name in ("budgets", "gamma1s", "gamma2s", "chunk_sizes")}
    lowers = tuple(w.strip() for w in args.lower_weights_grid.split(",") if w.strip()) or (args.lower_weights,)
    run = run_config(args, max_new_tokens=args.new_tokens, lower_weights="same")
    return SweepPlan(run, args.prompt_file, modes, grid, lowers, _temperatures(args.temperatures), args.new_tokens,
                     args.repeats, args.out, args.accept_ties)


def _temperatures(flag: str) -> tuple:
    try:
        temperatures = tuple(float(t) for t in flag.split(",") if t.strip()) or (None,)
    except ValueError:
        raise UserError(f"--temperatures '{flag}' must be comma-separated numbers") from None
    if any(t is not None and t < 0 for t in temperatures):
        raise UserError("--temperatures must be >= 0 (0 is greedy)")
    return temperatures


def _ints(text: str, name: str) -> list[int | None]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"--{name} '{text}' must be comma-separated integers") from None
    return values or [None]


def settings(plan: SweepPlan, base, lowers):
    """Every engine configuration of the grid, as (lower weights, mode, GenerationConfig)."""
    for lower, temperature, mode, budget, g1, g2, chunk in itertools.product(lowers, plan.temperatures, plan.modes,
                                                                             *plan.grid.values()):
        cfg = replace(base, budget=budget or base.budget, gamma1=g1 or base.gamma1, gamma2=g2 or base.gamma2,
                      chunk_size=chunk or base.chunk_size,
                      temperature=base.temperature if temperature is None else temperature)
        if mode == "retrieval" and g1 not in (None, plan.grid["gamma1s"][0]):
            continue  # gamma1 plays no part without a drafter
        if mode == "speculative" and (budget, chunk) != (plan.grid["budgets"][0], plan.grid["chunk_sizes"][0]):
            continue  # nor do the budget and chunk size without a retrieval level
        yield lower, mode, cfg


def timed(session, mode, cfg, prefilled, max_len, repeats, models=None):
    runs = [run_system(session, mode, cfg, prefilled, max_len, models) for _ in range(repeats + 1)][1:]
    tokens, _, stats = runs[0]
    seconds = statistics.median(r[1] for r in runs)
    return tokens, seconds, stats


def main(argv=None) -> int:
    plan = parse_args(argv)
    session = open_story_session(plan.run, read_text(plan.prompt_file or DEFAULT_PROMPT_FILE))
    prompt = session.prompt_ids
    base = generation_config(replace(session.run, mode="triforce"), len(prompt), session.say)
    max_len = len(prompt) + plan.new_tokens
    seed = Generator(session.loaded.models, base, "autoregressive", max_len=max_len)
    progress, advance = prefill_progress(session.console, len(prompt), f"prefill {len(prompt)}")
    with progress, watch_layers(seed.full.model, advance):  # the bar moves within a piece too
        seed.prefill(prompt, progress=advance)
    prefilled = seed.snapshot()
    reference, ar_seconds, _ = timed(session, "autoregressive", base, prefilled, max_len, plan.repeats)
    rows, failed = [], False
    lowers = [resolve_lower_weights(kind, session.device, session.dtype) for kind in plan.lowers]
    variants = {kind: with_lower_weights(session.loaded.models, kind) for kind in lowers}
    for lower, mode, cfg in settings(plan, base, lowers):
        tokens, seconds, stats = timed(session, mode, cfg, prefilled, max_len, plan.repeats, variants[lower])
        _, ar_again, _ = timed(session, "autoregressive", base, prefilled, max_len, plan.repeats)
        ar = statistics.median([ar_seconds, ar_again])
        at = first_mismatch(tokens, reference) if cfg.temperature == 0 else None
        same = None if cfg.temperature else at is None
        tie = at is not None and logit_gap_ulps(session, prefilled, reference, tokens, at) <= TIE_ULPS
        failed |= same is False and not (tie and plan.accept_ties)
        d = stats.to_dict()
        rows.append({"mode": mode, "lower_weights": lower, "temperature": cfg.temperature, "top_p": cfg.top_p,
                     "budget": cfg.budget, "chunk_size": cfg.chunk_size, "gamma1": cfg.gamma1,
                     "gamma2": cfg.gamma2,
                     "acceptance": d["acceptance"], "tokens_per_full_pass": d["tokens_per_full_pass"],
                     "ms_per_pass": {lv: 1e3 * d["seconds"][lv] / d["passes"][lv] for lv in LEVELS if d["passes"][lv]},
                     "tokens_per_second": (len(tokens) - 1) / seconds, "speedup": ar / seconds,
                     "autoregressive_ms_per_token": 1e3 * ar / (len(reference) - 1), "rebuilds": d["rebuilds"],
                     "same_tokens": same, "first_mismatch": at, "tie_only": tie})
        session.console.print(f"  [dim]{mode} {lower} T={cfg.temperature:g} budget {cfg.budget} chunk {cfg.chunk_size} "
                              f"gammas {cfg.gamma1}/{cfg.gamma2}: "
                              f"{rows[-1]['speedup']:.2f}x[/]")
    import torch

    print_rows(session.console, rows, f"{Path(plan.run.model).name} ({plan.run.dtype}), context {len(prompt)}, "
                                      f"{plan.new_tokens} new tokens, {torch.get_num_threads()} threads")
    if plan.out:
        Path(plan.out).write_text(json.dumps({"context": len(prompt), "rows": rows}, indent=2))
    if failed:
        print("error: a greedy run differs from autoregressive decoding (see the 'same' column; '(tie)': at a "
              f"logit tie of <= {TIE_ULPS} ulps, rounding; --dtype float32 or --accept-ties)", file=sys.stderr)
        return 1
    return 0


def print_rows(console, rows, title):
    from rich.table import Table

    t = Table(title=title)
    for col in ("mode", "lower", "T", "budget", "chunk", "γ1", "γ2", "acc. draft", "acc. middle", "tok/full pass", "ms/pass draft",
                "ms/pass middle", "ms/pass verify", "AR ms/token", "tok/s", "speedup", "same"):
        t.add_column(col, justify="right")
    for r in rows:
        acc = r["acceptance"]
        t.add_row(r["mode"], r.get("lower_weights", "same"), f"{r['temperature']:g}", str(r["budget"]), str(r["chunk_size"]), str(r["gamma1"]), str(r["gamma2"]),
                  *(_fmt(acc.get(k)) for k in ("draft->middle" if r["mode"] == "triforce" else "draft->verify",
                                               "middle->verify")),
                  _fmt(r["tokens_per_full_pass"]), *(_fmt(r["ms_per_pass"].get(lv), 1) for lv in LEVELS),
                  _fmt(r["autoregressive_ms_per_token"], 1), _fmt(r["tokens_per_second"]), f"{r['speedup']:.2f}x",
                  {True: "yes", False: "[red]NO[/]" + (" (tie)" if r["tie_only"] else ""), None: "-"}[r["same_tokens"]])
    wide(console).print(t)


def _fmt(value, digits=2):
    return "-" if value is None else f"{value:.{digits}f}"


def cli() -> int:
    return run_cli(main)


if __name__ == "__main__":
    sys.exit(cli())
