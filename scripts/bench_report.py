"""What bench.py shows and writes: the machine it ran on, the table of rows, the plot."""
from __future__ import annotations

import os
import platform
from pathlib import Path

from scripts.measure import OURS


def hardware() -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cpu_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "gpu": None}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def hardware_line(hw: dict, device) -> str:
    where = f"GPU {hw['gpu']}" if str(device).startswith("cuda") else "CPU only"
    return f"{where}; {hw['cpu']}, {hw['cpu_cores']} cores, {hw['torch_threads']} torch threads, torch {hw['torch']}"


def _mib(x):
    return "-" if x is None else f"{x / 2**20:,.1f}"


def print_table(console, rows, title="decode throughput, side by side"):
    from rich.table import Table

    table = Table(title=title)
    for col in ("context", "system", "tok/s", "vs ours AR", "vs HF generate", "acceptance", "tok/full pass",
                "MiB read/tok (model)", "MiB moved/tok", "same tokens"):
        table.add_column(col, justify="right")
    for r in rows:
        if r.get("skipped"):
            table.add_row(str(r["context"]), r["system"], "-", "-", "-", f"[yellow]{r['skipped'].split(',')[0]}[/]", "-", "-",
                          "-", "-")
            continue
        acc = ", ".join(f"{k} {v:.2f}" for k, v in (r["acceptance"] or {}).items() if v is not None) or "-"
        same = {None: "-", True: "yes", False: "[red]NO[/]"}[r["same_tokens"]]
        if r["same_tokens"] is False and r.get("first_mismatch") is not None:
            same += f" [red](token {r['first_mismatch']}"
            if r.get("top2_margin_at_mismatch") is not None:
                same += f", HF top-2 gap {r['top2_margin_at_mismatch']:.3f}"
            if r.get("tie_only"):
                same += "; ties only"
            same += ")[/]"
        table.add_row(str(r["context"]), r["system"], f"{r['tokens_per_second']:.2f}",
                      f"{r['speedup']:.2f}x" if r["speedup"] else "-",
                      f"{r['speedup_vs_hf_generate']:.2f}x" if r["speedup_vs_hf_generate"] else "-", acc,
                      f"{r['tokens_per_full_pass']:.2f}" if r["tokens_per_full_pass"] else "-",
                      _mib(r["bytes_read_per_token"]), _mib(r["bytes_moved_per_token"]), same)
    console.print(table)


def wide(console):
    """The console itself on a terminal; redirected to a file or pipe, one that does not wrap the table."""
    from rich.console import Console

    if console.is_terminal:
        return console
    return Console(file=console.file, width=200, quiet=console.quiet)


def plot(rows, path: Path, title: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install -e '.[bench]')"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    systems = list(dict.fromkeys(r["system"] for r in rows if r.get("tokens_per_second")))
    for s in systems:
        pts = sorted((r["context"], r["tokens_per_second"]) for r in rows if r["system"] == s and r.get("tokens_per_second"))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s,
                linestyle="-" if s in OURS else "--")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["context"] for r in rows}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{int(x):,}"))
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"
