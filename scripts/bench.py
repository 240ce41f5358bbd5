#!/usr/bin/env python
"""Side-by-side decoding benchmark: every engine on the same model, prompt, context, dtype, threads.

The prompt is prefilled once per context length and shared (decoding only writes after it).
After a warm-up, repetitions alternate between systems so drift hits all alike. Greedy runs are
checked token for token against our autoregressive engine; a mismatch is a failure.

    python scripts/bench.py --quick
    python scripts/bench.py --contexts 4096,16384,32768 --new-tokens 128 --out bench.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.common import add_engine_args, add_model_args, generation_config, prefill_progress, read_text, run_cli  # noqa: E402
from scripts.session import open_session  # noqa: E402
from speculative import Generator  # noqa: E402
from speculative.engine import synchronize  # noqa: E402

BOOK = Path(__file__).resolve().parents[1] / "speculative" / "data" / "pride_and_prejudice_ch1-9.txt"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    add_engine_args(p)
    p.add_argument("--prompt-file", default=None, help="a book (default: the embedded book prefix)")
    p.add_argument("--contexts", default="4096", help="comma-separated context lengths")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--systems", default="autoregressive,speculative,retrieval,triforce")
    p.add_argument("--quick", action="store_true", help="a few minutes on 2 CPU cores: 2K context, 32 tokens, 1 repeat")
    p.add_argument("--out", default=None, help="write results as JSON")
    p.add_argument("--debug", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.contexts, args.new_tokens, args.repeats = "2048", 32, 1
    args.max_new_tokens = args.new_tokens
    args.contexts = [int(c) for c in args.contexts.split(",")]
    args.context = max(args.contexts)
    return args


def run_system(session, mode, cfg, prefilled, max_len):
    gen = Generator(session.loaded.models, cfg, mode, max_len=max_len, prefilled=prefilled)
    synchronize(gen.device)
    start = time.perf_counter()
    tokens = gen.generate()
    synchronize(gen.device)
    return tokens, time.perf_counter() - start, gen.stats


def bench_context(session, args, ids, context):
    prompt = ids[-context:]
    args.mode = "triforce"  # budgets/gammas resolved for the richest mode, used by all
    cfg = generation_config(args, len(prompt), session.console)
    max_len = len(prompt) + args.new_tokens
    seed_gen = Generator(session.loaded.models, cfg, "autoregressive", max_len=max_len)
    progress, advance = prefill_progress(session.console, len(prompt), f"prefill {context}")
    with progress:
        seed_gen.prefill(prompt, progress=advance)
    prefilled = seed_gen.snapshot()
    systems = args.systems.split(",")
    results = {s: {"times": [], "stats": None, "tokens": None} for s in systems}
    for rep in range(args.repeats + 1):  # repetition 0 is the warm-up
        for mode in systems:
            tokens, seconds, stats = run_system(session, mode, cfg, prefilled, max_len)
            if rep == 0:
                results[mode]["tokens"] = tokens
                continue
            results[mode]["times"].append(seconds)
            results[mode]["stats"] = stats
    reference = results.get("autoregressive", {}).get("tokens")
    rows = []
    for mode in systems:
        r = results[mode]
        seconds = statistics.median(r["times"])
        stats = r["stats"].to_dict()
        rows.append({
            "context": context, "system": mode, "new_tokens": len(r["tokens"]),
            "tokens_per_second": (len(r["tokens"]) - 1) / seconds,
            "acceptance": stats["acceptance"], "tokens_per_full_pass": stats["tokens_per_full_pass"],
            "passes": stats["passes"], "seconds": stats["seconds"], "bytes_moved": stats["bytes_moved"],
            "prefill_seconds": prefilled.prefill_seconds,
            "same_tokens": None if reference is None or cfg.temperature > 0 else r["tokens"] == reference,
        })
    base = next((row["tokens_per_second"] for row in rows if row["system"] == "autoregressive"), None)
    for row in rows:
        row["speedup"] = row["tokens_per_second"] / base if base else None
    return rows, cfg


def print_table(console, rows):
    from rich.table import Table

    table = Table(title="decode throughput, side by side")
    for col in ("context", "system", "tok/s", "speedup", "acceptance", "tok/full pass", "same tokens"):
        table.add_column(col, justify="right")
    for r in rows:
        acc = ", ".join(f"{k} {v:.2f}" for k, v in r["acceptance"].items() if v is not None) or "-"
        same = {None: "-", True: "yes", False: "[red]NO[/]"}[r["same_tokens"]]
        table.add_row(str(r["context"]), r["system"], f"{r['tokens_per_second']:.2f}",
                      f"{r['speedup']:.2f}x" if r["speedup"] else "-", acc,
                      f"{r['tokens_per_full_pass']:.2f}" if r["tokens_per_full_pass"] else "-", same)
    console.print(table)


def main(argv=None) -> int:
    args = parse_args(argv)
    text = read_text(args.prompt_file or BOOK)
    session = open_session(args, text)
    ids = session.prompt_ids
    rows = []
    for context in args.contexts:
        if context > len(ids):
            session.console.print(f"[yellow]skip:[/] the book has only {len(ids)} tokens (< {context})")
            continue
        new_rows, cfg = bench_context(session, args, ids, context)
        rows += new_rows
        print_table(session.console, new_rows)
    from rich.console import Console

    print_table(Console(), rows)
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "model": args.model, "draft": session.draft,
                                              "dtype": args.dtype, "threads": __import__("torch").get_num_threads()}, indent=2))
    mismatches = [r for r in rows if r["same_tokens"] is False]
    if mismatches:
        print(f"error: {len(mismatches)} system(s) generated different tokens than autoregressive greedy", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
