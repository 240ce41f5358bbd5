"""Two runs of the GPU plan side by side: each system's tokens/s in one step of `bench.gpu_figures`
at one context, before and after, as a table and a grouped-bar plot:

    python -m bench.gpu_compare results/gpu-2026-11-27-h200-b.json results/gpu-2026-11-27-h200-d.json \
        --step "kv host greedy" --context 32768 --out docs/results/x.png

`--after-step` compares another step of the after run (it may be the same file), such as TriForce's
gamma2 beside the default in one run:

    python -m bench.gpu_compare R.json R.json --step "kv host greedy" --after-step "gamma2 6 kv host greedy" \
        --context 32768 --labels "gamma2 16,gamma2 6"

The two runs must come from the same kind of device (the JSON says which; a mismatch is refused),
since a ratio across devices measures the devices. Each figure is the run's own timed run; the
ratio column is after / before.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from triforce.cli.common import run_cli
from triforce.model.errors import UserError


def step_rows(path: Path, step: str, context: int) -> tuple[str, dict[str, float]]:
    """(device, {system: tokens/s}) of `step` at `context` in a gpu_figures JSON."""
    try:
        run = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {path} as a gpu_figures JSON ({e}): pass a file bench.gpu_figures wrote")
    found = [s for s in run.get("steps", []) if s.get("name") == step]
    result = found[0].get("result") if found else None
    if not isinstance(result, dict) or not result.get("rows"):
        names = ", ".join(s.get("name", "?") for s in run.get("steps", []))
        raise UserError(f"{path} has no bench rows for step '{step}': pick one of {names}")
    rows = {r["system"]: r["tokens_per_second"] for r in result["rows"]
            if r.get("context") == context and r.get("tokens_per_second")}
    if not rows:
        raise UserError(f"{path}, step '{step}', has no row at context {context}: pass --context with one it ran")
    return run.get("device") or result.get("device", "?"), rows


def compare(before: dict[str, float], after: dict[str, float]) -> list[tuple[str, float | None, float | None]]:
    """(system, before, after) for every system of either run, in the order they ran."""
    return [(s, before.get(s), after.get(s)) for s in dict.fromkeys([*before, *after])]


def table(rows, labels: tuple[str, str]) -> str:
    def cell(v):
        return "-" if v is None else f"{v:.1f}"
    lines = [f"| system | {labels[0]} tok/s | {labels[1]} tok/s | after / before |", "|---|---|---|---|"]
    for system, b, a in rows:
        ratio = f"{a / b:.2f}x" if a and b else "-"
        lines.append(f"| {system} | {cell(b)} | {cell(a)} | {ratio} |")
    return "\n".join(lines)


def plotted(rows):
    """The rows both runs measured: a system one run lacks is left out of the plot (the table says
    "-"), where a bar of 0 read as a measurement."""
    return [r for r in rows if r[1] is not None and r[2] is not None]


def plot(rows, labels: tuple[str, str], title: str, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install -e '.[bench]')"
    rows = plotted(rows)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    xs = range(len(rows))
    for k, (label, offset) in enumerate(zip(labels, (-0.2, 0.2))):
        values = [r[1 + k] for r in rows]
        bars = ax.bar([x + offset for x in xs], values, width=0.4, label=label)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(list(xs), [r[0] for r in rows], rotation=20, fontsize=8)
    ax.set_ylabel("decode tokens/s")
    ax.set_title(title, fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--step", required=True, help="a step of bench.gpu_figures, e.g. 'kv host greedy'")
    ap.add_argument("--after-step", help="the after run's step, when not --step's")
    ap.add_argument("--context", type=int, required=True)
    ap.add_argument("--labels", default="before,after", help="the two runs' names in the table and plot")
    ap.add_argument("--out", type=Path, help="a PNG of the two runs' bars")
    args = ap.parse_args(argv)
    labels = tuple(args.labels.split(",", 1)) if "," in args.labels else ("before", "after")
    device_b, before = step_rows(args.before, args.step, args.context)
    device_a, after = step_rows(args.after, args.after_step or args.step, args.context)
    if device_b != device_a:
        raise UserError(f"the runs come from different devices ({device_b}, {device_a}): compare runs of one kind")
    rows = compare(before, after)
    print(table(rows, labels))
    if args.out:
        steps = args.step if args.after_step in (None, args.step) else f"{args.step} / {args.after_step}"
        print(plot(rows, labels, f"{steps}, {args.context:,} tokens, {device_a}", args.out))


if __name__ == "__main__":
    sys.exit(run_cli(main))
