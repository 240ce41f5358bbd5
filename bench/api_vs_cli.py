"""The Python API against the command line: the same job, each in a fresh process as a user starts
it, alternating, decode tokens/s side by side (issue: the API once ran 30x slower).

    python -m bench.api_vs_cli --repeats 3 --max-new-tokens 64 --out results/api-vs-cli-cpu.json

Both run the embedded job greedily (temperature 0, so their tokens can be compared) with every
other setting left to its default; the API process sets no environment (a user's script), the
command line sets its own (OpenMP waits that sleep)."""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

API = """
import json, sys, triforce
r = triforce.generate(temperature=0.0, max_new_tokens={n}, model={model!r})
json.dump({{"tokens": r.tokens, "tokens_per_second": r.stats.tokens_per_second, "settings": r.settings}}, sys.stdout)
"""


def run_cli(model: str, n: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "triforce", "generate", "--json", "--temperature", "0",
                          "--max-new-tokens", str(n), "--model", model], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def run_api(model: str, n: int) -> dict:
    out = subprocess.run([sys.executable, "-c", API.format(n=n, model=model)], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    from triforce.runtime.defaults import DEFAULT_MODEL

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    rows = {"cli": [], "api": []}
    tokens = {}
    for rep in range(args.repeats):
        for name, run in (("cli", run_cli), ("api", run_api)) if rep % 2 == 0 else (("api", run_api), ("cli", run_cli)):
            print(f"repetition {rep + 1}/{args.repeats}: {name} ...", file=sys.stderr, flush=True)
            r = run(args.model, args.max_new_tokens)
            rows[name].append(r["tokens_per_second"])
            tokens[name] = r["tokens"]
            print(f"  {name}: {r['tokens_per_second']:.2f} tokens/s, threads {r['settings']['threads']} "
                  f"({r['settings']['threads_why']})", file=sys.stderr, flush=True)
    cli, api = statistics.median(rows["cli"]), statistics.median(rows["api"])
    print("| entry point | decode tokens/s (median) | runs | same tokens |")
    print("|---|---|---|---|")
    print(f"| `triforce-generate` | {cli:.2f} | {', '.join(f'{x:.2f}' for x in rows['cli'])} | - |")
    print(f"| `triforce.generate` | {api:.2f} ({api / cli:.2f}x) | {', '.join(f'{x:.2f}' for x in rows['api'])} | "
          f"{'yes' if tokens['api'] == tokens['cli'] else 'no'} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, "max_new_tokens": args.max_new_tokens,
                                              "tokens_per_second": rows, "same_tokens": tokens["api"] == tokens["cli"],
                                              "api_over_cli": api / cli}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
