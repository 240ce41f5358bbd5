#!/usr/bin/env python
"""PROJECTION of per-token latency on GPUs from a bandwidth cost model (speculative/costmodel.py).

Nothing here is measured: it predicts autoregressive offloaded decoding, DeepSpeed ZeRO-Inference
and triforce from triforce.model shapes, context length, retrieval budget, gammas, acceptance rates and
hardware figures (GPU memory bandwidth, PCIe bandwidth, TP degree, on-chip layers).

1. Calibration: predicted vs published for every row of docs/design.md, section "Published results"
   (the TriForce paper).
2. With --bench FILE.json (written by bench/bench.py --out): the published settings re-predicted
   with the acceptance rates this project measured (per-token rates, assumed independent of gamma).
3. With --model or shape flags and --context: a projection for any setting.

    python -m bench.project
    python -m bench.project --bench bench.json
    python -m bench.project --model models/qwen2.5-coder-1.5b --context 131072 --hardware 4090 --tp 1 \\
        --budget 8192 --gamma2 12 --accept-middle 0.8
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from bench import costmodel as cm

LABEL = "PROJECTION (bandwidth cost model, not a measurement)"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench", default=None, help="a bench JSON (bench/bench.py --out) to read measured acceptance from")
    p.add_argument("--accept-middle", type=float, default=None, help="middle->verify acceptance per token")
    p.add_argument("--accept-draft", type=float, default=None, help="draft->middle acceptance per token")
    p.add_argument("--gamma1", type=int, default=None)
    p.add_argument("--gamma2", type=int, default=None)
    g = p.add_argument_group("a custom setting (printed when --context is given)")
    g.add_argument("--model", default=None, help="HF checkpoint folder whose config.json gives the shapes, or one of: "
                   + ", ".join(cm.SHAPES))
    for name in ("layers", "hidden", "heads", "kv-heads", "head-dim", "vocab", "intermediate"):
        g.add_argument(f"--{name}", type=int, default=None)
    g.add_argument("--context", type=int, default=None, help="tokens in the full KV cache")
    g.add_argument("--budget", type=int, default=12288)
    g.add_argument("--hardware", default="4090", choices=sorted(cm.HARDWARE))
    g.add_argument("--gpu-bw", type=float, default=None, help="GB/s per GPU")
    g.add_argument("--pcie-bw", type=float, default=None, help="GB/s per GPU link")
    g.add_argument("--gpu-mem", type=float, default=None, help="GiB per GPU")
    g.add_argument("--tp", type=int, default=1)
    g.add_argument("--onchip-layers", type=int, default=None, help="default: as many as fit")
    g.add_argument("--on-chip", action="store_true", help="the whole KV cache in GPU memory (no offload)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    return p.parse_args(argv)


def _f(x, fmt="{:.0f}"):
    return "-" if x is None else fmt.format(x)


SOURCE = "docs/design.md, section \"Published results\""
SYSTEM_SHORT = {"autoregressive": "AR", "autoregressive (on-chip)": "AR", "deepspeed": "DS"}
AR_NOTE = ("AR: autoregressive decoding, the KV cache offloaded unless the setting says on-chip; "
           "DS: DeepSpeed ZeRO-Inference")


def compact_table(title: str, columns: list[str], rows: list, left=("model", "system")):
    """A table for 80 columns: no vertical rules, one space between cells, each column as wide as
    its widest value or header word (headers wrap, values never do). A row that is a string is a
    setting's heading, in the first column."""
    from rich import box
    from rich.table import Table

    t = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, padding=0)  # the rule between cells is a space
    cells = [r for r in rows if not isinstance(r, str)]
    for i, col in enumerate(columns):
        widest = max([len(r[i]) for r in cells] + [len(word) for word in col.split()])
        t.add_column(col, justify="left" if col in left else "right", width=widest)
    for r in rows:
        t.add_row(f"[bold]{r}[/]") if isinstance(r, str) else t.add_row(*r)
    return t


def by_setting(rows):
    """(setting, its rows) in the rows' order: the setting is a row of its own, not a column."""
    groups: dict[str, list] = {}
    for r in rows:
        groups.setdefault(r["setting"], []).append(r)
    return groups.items()


def print_calibration(console, rows):
    table = []
    for setting, group in by_setting(rows):
        table.append(setting)
        for r in group:
            if r["published_ms"] is not None:
                pub, pred = f"{r['published_ms']:.0f} ms", f"{r['predicted_ms']:.0f} ms"
            else:
                pub, pred = f"{r['published_speedup']:.2f}x", f"{r['predicted_speedup']:.2f}x"
            err = f"{100 * r['relative_error']:+.0f}%" + ("" if r["calibrates"] else "*")
            bg = f"{r['budget']}/{r['gamma2']}" if r["budget"] else "-"
            table.append([r["model"], SYSTEM_SHORT.get(r["system"], r["system"]), bg, _f(r["onchip_layers"]), pub,
                          pred, err, _f(r["implied_accept_middle"], "{:.3f}")])
    t = compact_table(f"{LABEL}: predicted vs published ({SOURCE})",
                      ["model", "system", "budget / γ2", "on chip", "paper", "cost model", "error", "implied a_mid"],
                      table)
    console.print(t)
    console.print(f"{AR_NOTE}; *: not fitted (a speed-up only); on chip: layers whose KV stays in GPU memory; "
                  "implied a_mid: the middle acceptance that reproduces the paper's figure.")
    console.print(f"constants: PCIe {cm.RTX4090.pcie_bw / cm.GB:.0f} GB/s per link ({SOURCE}), RTX 4090 "
                  f"{cm.RTX4090.gpu_bw / cm.GB:.0f} GB/s, A100 {cm.A100_80G.gpu_bw / cm.GB:.0f} GB/s (spec sheets); "
                  f"fitted: middle acceptance {cm.FITTED_ACCEPT_MIDDLE} (least squares over the TriForce rows: "
                  f"{cm.calibrate():.3f}), per-GPU reserve {cm.RTX4090.reserve / cm.GB:.0f} GB (from the published "
                  f"on-chip layer counts), CPU-attention host bandwidth {cm.RTX4090.host_bw / cm.GB:.0f} GB/s (from the "
                  f"DeepSpeed row); assumed: drafter acceptance {cm.FITTED_ACCEPT_DRAFT}, "
                  f"{cm.RTX4090.pass_overhead * 1e3:.1f} ms overhead per target pass. "
                  f"Tolerance: calibrating rows within {100 * cm.CALIBRATION_TOLERANCE:.0f}%.")
    for r in rows:
        if r["note"]:
            console.print(f"  note ({r['setting']}, {r['system']}): {r['note']}")


def measured_acceptance(path: str) -> list[dict]:
    """(model, context, a_middle, a_draft, gammas) for every triforce/retrieval row of a bench JSON."""
    from triforce.speculative import UserError

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read the bench JSON {path} ({e}); write one with bench/bench.py --out") from None
    out = []
    for row in data.get("rows", []):
        if row.get("system") not in ("triforce", "retrieval"):
            continue
        acc = row.get("acceptance") or {}
        a_mid = acc.get("middle->verify")
        if a_mid is None:
            continue
        out.append({"model": data.get("model"), "system": row["system"], "context": row["context"],
                    "accept_middle": a_mid, "accept_draft": acc.get("draft->middle"),
                    "gamma1": row.get("gamma1"), "gamma2": row.get("gamma2"),
                    "tokens_per_full_pass": row.get("tokens_per_full_pass")})
    if not out:
        raise UserError(f"{path} has no triforce or retrieval rows with a middle-level acceptance")
    return out


def print_measured(console, measured):
    for m in measured:
        src = f"{Path(str(m['model'])).name} {m['system']} @ {m['context']}"
        rows = []
        for gamma2 in sorted({None, m["gamma2"]} - {None}, key=lambda g: g or 0) + [None]:
            rows += [{**r, "gamma_from": "run" if gamma2 else "paper"} for r in cm.project_measured(
                m["accept_middle"], m["accept_draft"] if m["system"] == "triforce" else None,
                gamma1=m["gamma1"] if gamma2 else None, gamma2=gamma2)]
        table = []
        for setting, group in by_setting(rows):
            table.append(setting)
            table += [[r["model"], f"{r['gamma2']} {r['gamma_from']}", f"{r['tokens_per_verification']:.2f}",
                       f"{r['projected_ms']:.0f} ms",
                       f"{_f(r['projected_baseline_ms'])} ms {SYSTEM_SHORT.get(r['baseline'], r['baseline'])}",
                       _f(r["projected_speedup"], "{:.2f}x"), _f(r["published_ms"], "{:.0f} ms")] for r in group]
        t = compact_table(f"{LABEL}: the published settings with the acceptance measured on {src} "
                          f"(a_middle {m['accept_middle']:.3f}, a_draft {_f(m['accept_draft'], '{:.3f}')})",
                          ["model", "γ2", "tokens per verif.", "projected", "baseline", "speed-up", "paper"], table)
        console.print(t)
    console.print(f"{AR_NOTE}; γ2 run: the measured run's, paper: the published setting's; paper: the published "
                  "TriForce latency.")
    console.print("caveat: acceptance was measured on this project's models and contexts (CPU run), not on "
                  "Llama2-7B/13B-128K at 128K tokens; rates depend on the model pair, the text, the budget and the context. "
                  "Drafter passes are costed as the published 68M drafter's, whatever drafter the measured run used.")


def custom_setting(args):
    from triforce.cli.common import read_text  # noqa: F401  (keeps the CLI import path uniform)
    from triforce.speculative import ModelConfig, UserError

    if args.model and args.model in cm.SHAPES:
        shape = cm.SHAPES[args.model]
    elif args.model:
        shape = cm.ModelShape.from_config(ModelConfig.from_folder(args.model), name=Path(args.model).name)
    else:
        shape = cm.LLAMA2_7B
    over = {k: getattr(args, k.replace("-", "_")) for k in ("layers", "hidden", "heads", "kv_heads", "head_dim", "vocab",
                                                           "intermediate")}
    shape = replace(shape, **{k: v for k, v in over.items() if v is not None})
    hw = cm.HARDWARE[args.hardware].with_(tp=args.tp, onchip_layers=args.onchip_layers)
    if args.gpu_bw:
        hw = hw.with_(gpu_bw=args.gpu_bw * cm.GB)
    if args.pcie_bw:
        hw = hw.with_(pcie_bw=args.pcie_bw * cm.GB)
    if args.gpu_mem:
        hw = hw.with_(gpu_mem=args.gpu_mem * 2**30)
    try:
        s = cm.Setting(shape, hw, args.context, budget=args.budget, gamma1=args.gamma1 or 1, gamma2=args.gamma2 or 16,
                       accept_middle=cm.FITTED_ACCEPT_MIDDLE if args.accept_middle is None else args.accept_middle,
                       accept_draft=cm.FITTED_ACCEPT_DRAFT if args.accept_draft is None else args.accept_draft,
                       offloaded=not args.on_chip)
    except ValueError as e:
        raise UserError(str(e)) from None
    tri, ar = cm.triforce(s), cm.autoregressive(s)
    out = {"model": shape.name, "params": shape.params, "weight_bytes": shape.weight_bytes,
           "kv_bytes": shape.kv_bytes(s.context), "context": s.context, "hardware": hw.name, "tp": hw.tp,
           "budget": s.budget, "gamma1": s.gamma1, "gamma2": s.gamma2, "accept_middle": s.accept_middle,
           "accept_draft": s.accept_draft, "triforce_ms": tri.ms, "autoregressive_ms": ar.ms,
           "speedup": ar.seconds_per_token / tri.seconds_per_token, "triforce_parts": tri.parts,
           "autoregressive_onchip_layers": ar.parts["onchip_layers"]}
    if not args.on_chip and hw.tp == 1:
        out["deepspeed_ms"] = cm.deepspeed_zero_inference(s).ms
    return out


def print_custom(console, c):
    console.print(f"[bold]{LABEL}[/]: {c['model']} ({c['params'] / 1e9:.2f} B params, weights {c['weight_bytes'] / 2**30:.1f} GiB, "
                  f"KV {c['kv_bytes'] / 2**30:.1f} GiB at {c['context']} tokens) on {c['tp']}x {c['hardware']}, budget "
                  f"{c['budget']}, gamma {c['gamma1']}/{c['gamma2']}, acceptance {c['accept_draft']:.2f}/{c['accept_middle']:.2f}")
    p = c["triforce_parts"]
    console.print(f"  autoregressive (KV offloaded, {c['autoregressive_onchip_layers']} on-chip layers): "
                  f"{c['autoregressive_ms']:.1f} ms/token (projected)")
    if "deepspeed_ms" in c:
        console.print(f"  DeepSpeed ZeRO-Inference (params over PCIe, CPU attention): {c['deepspeed_ms']:.1f} ms/token (projected)")
    console.print(f"  triforce: {c['triforce_ms']:.1f} ms/token (projected), {c['speedup']:.2f}x; per verification: full pass "
                  f"{p['full_pass'] * 1e3:.1f} ms + {p['middle_passes']:.1f} middle passes {p['middle'] * 1e3:.1f} ms + drafts "
                  f"{p['draft'] * 1e3:.1f} ms, {p['tokens_per_verification']:.2f} tokens")


def main(argv=None) -> int:
    from rich.console import Console

    args = parse_args(argv)
    console = Console()  # the tables fit 80 columns; files and pipes get rich's 80 too
    report = {"label": LABEL, "calibration": cm.calibration_table()}
    if args.bench:
        report["measured"] = [{**m, "projection": cm.project_measured(
            m["accept_middle"], m["accept_draft"] if m["system"] == "triforce" else None,
            gamma1=m["gamma1"], gamma2=m["gamma2"])} for m in measured_acceptance(args.bench)]
    elif args.accept_middle is not None:
        report["measured"] = [{"model": "given", "system": "triforce", "context": "-", "accept_middle": args.accept_middle,
                               "accept_draft": args.accept_draft, "gamma1": args.gamma1, "gamma2": args.gamma2,
                               "projection": cm.project_measured(args.accept_middle, args.accept_draft, args.gamma1,
                                                                 args.gamma2)}]
    if args.context:
        report["custom"] = custom_setting(args)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
        return 0
    print_calibration(console, report["calibration"])
    if "measured" in report:
        print_measured(console, report["measured"])
    if "custom" in report:
        print_custom(console, report["custom"])
    bad = [r for r in report["calibration"] if r["calibrates"] and abs(r["relative_error"]) > cm.CALIBRATION_TOLERANCE]
    if bad:
        console.print(f"[red]calibration outside the {100 * cm.CALIBRATION_TOLERANCE:.0f}% tolerance for {len(bad)} row(s)[/]")
        return 1
    return 0


if __name__ == "__main__":
    from triforce.cli.common import run_cli

    sys.exit(run_cli(main))
