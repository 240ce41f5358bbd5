"""MKL's first-call race, counted: fresh processes whose first threaded `torch.exp` (and log, cos,
sin, sqrt, tanh) is compared with an identical second call, with and without
triforce.model.first_calls.warm_vml() before them (triforce/model/first_calls.py says why).

    python -m bench.first_call_race --processes 200

Each child runs with OMP_WAIT_POLICY=PASSIVE (as the command line does) and two threads, wakes the
OpenMP team with a few large adds, and then makes each op's first call on a (9, 4096, 1) float32
tensor, a prefill piece's log-sum-exps at SmolLM2's width. Arms alternate, so load hits both alike.
A first call that differs from its rerun is the race. It is rare (a few in a hundred processes on a
2-core Xeon, more on a loaded machine), so a cold arm with none proves nothing; a warm arm with any
would be a defect."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

OPS = ("exp", "log", "cos", "sin", "sqrt", "tanh")
CHILD = r"""
import sys, torch
torch.set_num_threads(2)
team = torch.ones(4_000_000)
for _ in range(20):
    team.add_(1.0)  # the OpenMP team up, then asleep or spinning as the policy says
if sys.argv[1] == "warm":
    from triforce.model import first_calls
    first_calls.warm_vml()
y = torch.linspace(0.05, 0.95, 9 * 4096).reshape(9, 4096, 1)
raced = [name for name in %r if not torch.equal(getattr(torch, name)(y), getattr(torch, name)(y))]
print("RACED", ",".join(raced))
""" % (OPS,)


def child(arm: str) -> list[str]:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    out = subprocess.run([sys.executable, "-c", CHILD, arm], capture_output=True, text=True, env=env, timeout=120)
    if out.returncode != 0:
        raise SystemExit(f"error: a child process failed: {out.stderr.strip().splitlines()[-1]}")
    line = next(line for line in out.stdout.splitlines() if line.startswith("RACED"))
    return [name for name in line.split(" ", 1)[1].split(",") if name] if " " in line else []


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=100, help="processes per arm (default: %(default)s)")
    p.add_argument("--out", default=None, help="write the counts as JSON here")
    args = p.parse_args(argv)
    if args.processes < 1:
        raise SystemExit(f"error: --processes must be at least 1 (got {args.processes})")
    counts = {arm: {"processes": 0, "raced_processes": 0, "raced_calls": {}} for arm in ("cold", "warm")}
    start = time.perf_counter()
    for i in range(args.processes):
        for arm in ("cold", "warm"):
            raced = child(arm)
            c = counts[arm]
            c["processes"] += 1
            c["raced_processes"] += bool(raced)
            for name in raced:
                c["raced_calls"][name] = c["raced_calls"].get(name, 0) + 1
        done = i + 1
        if done % 10 == 0 or done == args.processes:
            left = (time.perf_counter() - start) / done * (args.processes - done)
            print(f"{done}/{args.processes} per arm, cold {counts['cold']['raced_processes']} raced, "
                  f"warm {counts['warm']['raced_processes']} raced, ~{left:.0f} s left", flush=True)
    print("\n| arm | processes | processes with a raced first call | raced calls by op |\n|---|---|---|---|")
    for arm, c in counts.items():
        print(f"| {arm} | {c['processes']} | {c['raced_processes']} | {c['raced_calls'] or '-'} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(counts, f, indent=1)
    return counts


if __name__ == "__main__":
    main()
