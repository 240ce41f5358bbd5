"""What bench.py shows and writes: the machine it ran on, the table of rows, the plot."""
from __future__ import annotations

import os
import platform
from pathlib import Path

from bench import timeline
from bench.measure import ALL_OURS
from triforce.speculative.stats import ROUND


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


def _x(value) -> str:
    return f"{value:.2f}x" if value else "-"


def _num(value, digits=2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _same(r: dict) -> str:
    return {None: "-", True: "yes", False: "[red]NO[/]" + (" (tie)" if r.get("tie_only") else "")}[r["same_tokens"]]


def _table(title: str, columns):
    from rich import box
    from rich.table import Table

    # no vertical rules, one space of padding: both tables stay within 100 columns
    table = Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, show_edge=False,
                  title_justify="left")
    for col in columns:
        table.add_column(col, justify="left" if col == "system" else "right", no_wrap=True)
    return table


def print_table(console, rows, title="decode throughput, side by side"):
    """Two tables within 100 columns (throughput; per level), then one line per skipped system and per
    mismatch saying why."""
    ran = [r for r in rows if not r.get("skipped")]
    speed = _table(title, ("ctx", "system", "tok/s", "vs AR", "vs HF gen", "tok/full pass", "same tokens"))
    for r in rows:
        if r.get("skipped"):
            speed.add_row(str(r["context"]), r["system"], "n/a", "-", "-", "-", "-")
            continue
        speed.add_row(str(r["context"]), r["system"], f"{r['tokens_per_second']:.2f}", _x(r["speedup"]),
                      _x(r["speedup_vs_hf_generate"]), _num(r["tokens_per_full_pass"]), _same(r))
    console.print(speed)
    moved = any(r.get("bytes_moved_per_token") is not None for r in ran)
    floor = any(r.get("link_floor") for r in ran)
    columns = ["ctx", "system", "acc d", "acc m", "ms d", "ms m", "ms v", "MiB rd/t"]
    columns += ["MiB mv/t"] * moved + ["floor"] * floor
    rounds = any((r.get("ms_per_pass") or {}).get(ROUND) for r in ran)
    levels = _table("per level (d: draft, m: middle, v: verify): acceptance, ms per pass, MiB read (model) and "
                    "moved per token" + ("; floor: link floor ms of a full pass" if floor else "")
                    + ("; r: ms per drafter->middle round run whole (device rounds)" if rounds else ""), columns)
    for r in ran:
        acc, ms = r["acceptance"] or {}, r.get("ms_per_pass") or {}
        cells = [str(r["context"]), r["system"], _num(acc.get("draft->middle", acc.get("draft->verify"))),
                 _num(acc.get("middle->verify")), *_pass_cells(ms), _mib(r["bytes_read_per_token"])]
        cells += [_mib(r["bytes_moved_per_token"])] * moved
        cells += [_floor_cell(r.get("link_floor"))] * floor
        levels.add_row(*cells)
    console.print(levels)
    timelines = timeline.table_rows(ran)
    if timelines:
        spent = _table("one profiled run per system, ms a token: the device's wall, kernels, host->device "
                       "copies, copies hidden under kernels, busy, idle (bench/timeline.py)",
                       ("ctx", "system", "wall", "kernels", "h2d", "overlap", "busy", "idle"))
        for cells in timelines:
            spent.add_row(*cells)
        console.print(spent)
    for line in _notes(rows):
        console.print(line, width=100)


def _pass_cells(ms: dict) -> list[str]:
    """ms d, ms m, ms v. Where the drafter's and middle level's passes ran inside whole rounds, their
    own figures are the few passes outside one (a catch-up feeding many tokens: 99-164 ms on the H200
    beside 11.5 ms rounds), so the round's time stands in their place."""
    if ms.get(ROUND):
        return [f"r {ms[ROUND]:.1f}", "-", _num(ms.get("verify"), 1)]
    return [_num(ms.get(lv), 1) for lv in ("draft", "middle", "verify")]


def _floor_cell(floor) -> str:
    if not floor:
        return "-"
    return "n/a" if floor["ms_per_full_pass"] is None else f"{floor['ms_per_full_pass']:.1f}"


def _notes(rows) -> list[str]:
    """What the tables cannot hold: why a system did not run, where a run left the reference, the link floor."""
    notes = [f"[yellow]{r['system']}@{r['context']}:[/] {r['skipped']}" for r in rows if r.get("skipped")]
    for r in rows:
        if r.get("same_tokens") is False and r.get("first_mismatch") is not None:
            note = f"[red]{r['system']}@{r['context']}: differs from token {r['first_mismatch']}"
            if r.get("top2_margin_at_mismatch") is not None:
                note += f", HF top-2 gap {r['top2_margin_at_mismatch']:.3f}"
            notes.append(note + ("; ties only" if r.get("tie_only") else "") + "[/]")
    floors = {r["link_floor"]["text"] for r in rows if r.get("link_floor") and r["link_floor"]["ms_per_full_pass"] is None}
    notes += [f"link floor: {text}" for text in sorted(floors)]
    for r in rows:
        f = r.get("link_floor")
        if f and f["ms_per_full_pass"] is not None:
            notes.append(f"{r['system']}@{r['context']} link floor: {f['text']}; measured verify "
                         f"{_num((r.get('ms_per_pass') or {}).get('verify'), 1)} ms/pass")
    return notes


def wide(console):
    """The console itself on a terminal; redirected to a file or pipe, one that does not wrap the table."""
    from rich.console import Console

    if console.is_terminal:
        return console
    return Console(file=console.file, width=200, quiet=console.quiet)


def plot(rows, path: Path, title: str) -> str:
    """tokens/s against context (several contexts), or a bar per system (one context)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install -e '.[bench]')"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    measured = [r for r in rows if r.get("tokens_per_second")]
    if len({r["context"] for r in measured}) > 1:
        _lines(ax, matplotlib, measured)
    else:
        _bars(ax, measured)
    ax.set_ylabel("decode tokens/s")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"


def _lines(ax, matplotlib, rows) -> None:
    for s in dict.fromkeys(r["system"] for r in rows):
        pts = sorted((r["context"], r["tokens_per_second"]) for r in rows if r["system"] == s)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s,
                linestyle="-" if s in ALL_OURS else "--")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["context"] for r in rows}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{int(x):,}"))
    ax.set_xlabel("context length (tokens)")
    ax.legend(fontsize=8)


def _bars(ax, rows) -> None:
    names = [r["system"] for r in rows]
    bars = ax.bar(names, [r["tokens_per_second"] for r in rows],
                  color=["tab:blue" if n in ALL_OURS else "tab:gray" for n in names])
    ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xlabel(f"system (context {rows[0]['context']:,} tokens)" if rows else "system")
    ax.tick_params(axis="x", labelsize=8, rotation=20)
