"""The statistics table of a generation, as the command line prints it (rich)."""
from __future__ import annotations

import torch
from rich.console import Console
from rich.table import Table

from triforce.runtime.report import level_ms_per_pass, link_floor, versus_plain
from triforce.speculative.stats import LEVEL_ORDER, ROUND


def print_session_stats(session, stats, cfg=None) -> None:
    """A Session's run: its statistics and the defaults it decided, on the session's stdout."""
    print_stats_table(Console(file=session.stdout), session.run.mode, stats, session.run.lower_weights, session.device,
                      session.choices(cfg))


def modes_text(modes: dict) -> str:
    """An adaptive run's full-cache passes per mode, most used first: 'triforce 40, autoregressive 3'."""
    return ", ".join(f"{m} {n}" for m, n in sorted(modes.items(), key=lambda kv: -kv[1]))


def estimates_text(estimates: dict) -> str:
    """What an adaptive run predicted last, cheapest first: 'retrieval γ1 410, autoregressive 520'."""
    parts = []
    for mode, e in sorted(estimates.items(), key=lambda kv: kv[1]["ms_per_token"]):
        gamma = f" γ{e['gamma']}" if e["gamma"] else ""
        parts.append(f"{mode}{gamma} {e['ms_per_token']:.0f}")
    return ", ".join(parts)


def print_stats_table(console: Console, mode: str, stats, lower_weights: str = "same", device=None,
                      choices: list[tuple[str, str]] = ()) -> None:
    """The statistics of one generation. With an offloaded full cache (bytes moved counted) the
    verification row also shows the link floor: the KV streamed per full pass over the pinned
    host->device bandwidth measured now (CUDA; n/a on CPU, where there is no link to cross).
    `device`: where the run decoded; when not given, CUDA if this process has initialised it."""
    d = stats.to_dict()
    title = f"adaptive over {mode}'s levels" if stats.modes else mode
    table = Table(title=f"{title}: {stats.prompt_tokens} prompt tokens, {stats.new_tokens} new")
    table.add_column("statistic")
    table.add_column("value", justify="right")
    rows = [("prefill", f"{stats.prefill_seconds:.2f} s"), ("decode", f"{stats.decode_seconds:.2f} s"),
            ("decode tokens/s", _fmt(stats.tokens_per_second)),
            ("tokens per full-cache pass", _fmt(stats.tokens_per_full_pass)), ("full-cache passes", str(stats.full_passes))]
    plain = versus_plain(d, mode)
    if plain is not None:
        rows.append(("vs plain decoding", f"{plain['speedup']:.2f}x ({plain['how']}: {plain['plain_ms_per_token']:.0f} "
                                          f"ms/token against {plain['ms_per_token']:.0f})"
                     if plain["how"] != "this is plain decoding" else "1.00x (this is plain decoding)"))
    if d["modes"]:
        rows.append(("full-cache passes per mode", modes_text(d["modes"])))
        rows.append(("predicted ms per token", estimates_text(d["estimates"])))
    for key, value in d["acceptance"].items():
        rows.append((f"acceptance {key}", _fmt(value, 3)))
    for level in LEVEL_ORDER:
        if d["passes"][level]:
            inside = d["passes"][level] - d["timed_passes"][level]
            within = f" ({inside} inside {ROUND} rounds)" if inside else ""
            rows.append((f"{level} passes / time", f"{d['passes'][level]}{within} / {d['seconds'][level]:.2f} s"))
    floor = link_floor(d, _decode_device(device)) if stats.bytes_moved is not None else None
    for level, ms in level_ms_per_pass(d).items():
        value = f"{ms:.1f}"
        if level == "verify" and floor is not None:
            value += f" (link floor {floor['text']})"
        rows.append((f"{level} ms per pass", value))
    if floor is not None and stats.decode_tokens:
        per_token = "n/a" if floor["ms_per_token"] is None else f"{floor['ms_per_token']:.1f}"
        rows.append(("decode ms per token / link floor",
                     f"{1e3 * stats.decode_seconds / stats.decode_tokens:.1f} / {per_token}"))
    if stats.rebuilds:
        rows.append(("retrieval cache builds", str(stats.rebuilds)))
    rows += list(choices)
    if lower_weights != "same" and (d["passes"]["draft"] or d["passes"]["middle"]):
        rows.append(("proposing levels' weights", lower_weights))
    if stats.bytes_moved is not None:
        rows.append(("bytes moved per token", f"{stats.bytes_moved / max(stats.new_tokens, 1) / 2**20:.1f} MiB"))
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)



def _decode_device(device) -> str:
    # generate.py's print_stats does not say where it decoded: a process that initialised CUDA did so there
    if device is not None:
        return str(device)
    return "cuda" if torch.cuda.is_available() and torch.cuda.is_initialized() else "cpu"


def _fmt(x, digits=2):
    return "-" if x is None else f"{x:.{digits}f}"


