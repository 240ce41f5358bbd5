#!/usr/bin/env python
"""This project's single-device mode vs DeepSpeed ZeRO-Inference: per-token decode latency, side by side.

Both systems get the same checkpoint folder, dtype, thread count and the same real prompt (token
ids of a book, not a short prompt padded to length as DeepSpeedExamples' zero_inference driver does).

    DeepSpeed ZeRO-Inference   transformers' model wrapped by `deepspeed.initialize` with ZeRO stage 3
                               and parameters offloaded to CPU memory (`offload_param: cpu`), the config
                               of DeepSpeedExamples inference/huggingface/zero_inference/run_model.py;
                               greedy `generate()`, transformers' own KV cache.
    this project               one process, one device: our autoregressive engine (the reference) and
                               triforce, sharing one prefill; `--offload host` keeps our full KV cache
                               in host memory and streams it per pass.

What the comparison does NOT include: ZeRO-Inference's KV-cache offload with attention computed on
the CPU (`kv_offload`) only ever lived in a fork of transformers and never reached a transformers
release, so it cannot run on current releases. DeepSpeed's KV cache stays where transformers keeps
it (device memory; on a CPU-only machine, host memory). The comparison covers parameter offload only.

Timing: decode only. Each system prefills the prompt once (DeepSpeed's prompt cache is copied per
run), the first token comes from prefill, and the clock covers the next N-1 tokens; a warm-up run,
then repetitions alternate between the systems; the median is reported.

Hardware: on a CPU-only machine DeepSpeed runs with its CPU accelerator and the gloo backend (one
process; the "offload" of parameters is then host memory to host memory, so the row measures ZeRO-3's
gather/partition machinery, not PCIe); on a GPU with the CUDA accelerator and NCCL. The output says
which it ran on.

    pip install -e '.[deepspeed]'        # DS_BUILD_OPS=0: a source build without CUDA ops is enough
    python -m bench.compare_deepspeed --prompt-file ../shared/data/books/persuasion.txt --context 1024
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from triforce.cli.common import (DEFAULT_PROMPT_FILE, RunConfig, add_engine_args, add_model_args,
                            generation_config, read_text, run_cli, run_config)

NOT_INCLUDED = ("not included: ZeRO-Inference's KV-cache offload with CPU attention (it only lived in a fork of "
                "transformers and never reached a release); DeepSpeed keeps transformers' KV cache on its device, "
                "so this compares ZeRO-3 parameter offload only")


@dataclass(frozen=True)
class ComparePlan:
    run: RunConfig
    prompt_file: str | None
    new_tokens: int
    repeats: int
    modes: tuple[str, ...]  # our engines
    pin_memory: bool
    out: str | None
    accept_ties: bool


def parse_args(argv) -> ComparePlan:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    add_engine_args(p)
    p.add_argument("--prompt-file", default=None, help=f"a book (default: {DEFAULT_PROMPT_FILE.name})")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--modes", default="autoregressive,triforce", help="our engines to run (comma-separated)")
    p.add_argument("--pin-memory", action="store_true", help="pinned host memory for offloaded parameters (GPU)")
    p.add_argument("--out", default=None, help="write results as JSON")
    p.add_argument("--accept-ties", action="store_true",
                   help="do not fail when DeepSpeed's tokens diverge only at logit ties (see bench/bench.py)")
    p.add_argument("--debug", action="store_true")
    args = p.parse_args(argv)
    run = run_config(args, max_new_tokens=args.new_tokens, context=1024 if args.context is None else args.context)
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    return ComparePlan(run, args.prompt_file, args.new_tokens, args.repeats, modes, args.pin_memory, args.out,
                       args.accept_ties)


def deepspeed_blocker(device: str) -> str | None:
    """None when DeepSpeed can be imported here, else the one-line reason."""
    if not device.startswith("cuda"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed  # noqa: F401
        from deepspeed.accelerator import get_accelerator
    except ImportError as e:
        return f"deepspeed is not installed ({e}); pip install -e '.[deepspeed]' (DS_BUILD_OPS=0 builds it without CUDA)"
    except Exception as e:  # a broken install raises many kinds of errors at import
        return f"deepspeed fails to import: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    name = get_accelerator().device_name()
    if device.startswith("cuda") and name != "cuda":
        return f"DeepSpeed picked its '{name}' accelerator but --device is {device}; unset DS_ACCELERATOR"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_wrap(dtype, hidden: int, pin_memory: bool, device: str):
    """A function model -> ZeRO-3 (parameters offloaded to CPU) engine module, as ZeRO-Inference sets it up."""
    import deepspeed
    import torch
    from deepspeed.utils import logger

    logger.setLevel(logging.ERROR)
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    deepspeed.init_distributed(dist_backend="nccl" if device.startswith("cuda") else "gloo", verbose=False)
    config = {
        "fp16": {"enabled": dtype == torch.float16},
        "bf16": {"enabled": dtype == torch.bfloat16},
        "zero_optimization": {
            "stage": 3,
            "stage3_prefetch_bucket_size": 2 * hidden * hidden,
            "stage3_param_persistence_threshold": hidden,
            "stage3_max_live_parameters": 2 * hidden * hidden,
            "offload_param": {"device": "cpu", "pin_memory": pin_memory},
        },
        "steps_per_print": 2000,
        "train_batch_size": 1,
        "wall_clock_breakdown": False,
    }

    def wrap(model):
        engine = deepspeed.initialize(model=model, config=config)[0]
        engine.module.eval()
        return engine.module

    return wrap, config


def hardware_summary(device: str) -> tuple[str, dict]:
    from bench.bench_report import hardware, hardware_line

    hw = hardware()
    accel = None
    try:
        from deepspeed.accelerator import get_accelerator

        a = get_accelerator()
        accel = f"{a.device_name()} ({a.communication_backend_name()})"
    except Exception:
        pass
    line = hardware_line(hw, device) + (f"; DeepSpeed accelerator {accel}" if accel else "")
    return line, {**hw, "deepspeed_accelerator": accel}


def compare(plan: ComparePlan) -> dict:
    import torch

    from bench.bench_report import wide
    from bench.hf_peers import HFSystems
    from bench.bench import system_configs
    from bench.measure import build_system, first_mismatch, shared_prefill, ties_only, timed_run
    from triforce.parallel import resolve_device
    from bench.prompts import open_story_session
    from triforce.speculative import UserError
    from triforce.speculative.engine import synchronize

    run = plan.run
    if run.tp != 1:
        raise UserError("compare_deepspeed.py compares single-device modes: use --tp 1")
    if run.temperature > 0:
        raise UserError("compare_deepspeed.py runs greedy (the token check needs it): leave --temperature at 0")
    device = resolve_device(run.device)
    blocker = deepspeed_blocker(device)
    if blocker:
        raise UserError(f"DeepSpeed ZeRO-Inference cannot run here: {blocker}")
    text = read_text(plan.prompt_file or DEFAULT_PROMPT_FILE)
    session = open_story_session(run, text)
    console = session.console
    prompt = session.prompt_ids
    if len(prompt) < run.context:
        console.print(f"[yellow]note:[/] the prompt file has {len(prompt)} tokens (< --context {run.context})")
    import deepspeed

    try:
        wrap, ds_config = deepspeed_wrap(session.dtype, session.config.hidden_size, plan.pin_memory, device)
        with console.status("DeepSpeed ZeRO-3 (parameters offloaded to CPU): loading"):
            ds = HFSystems(session, session.config, wrap=wrap, assistant=False)
    except Exception as e:
        raise UserError(f"DeepSpeed ZeRO-Inference failed to start on {device}: {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}") from None
    if run.threads:
        torch.set_num_threads(run.threads)  # DeepSpeed's CPU accelerator may change it
    hw_line, hw = hardware_summary(device)
    wide(console).print(f"[bold]hardware:[/] {hw_line}")

    # each of our modes with its own defaults, built as generate.py builds it (as bench.py does)
    cfgs = system_configs(session.run, plan.modes, len(prompt), session.say)
    cfg = cfgs.get("triforce") or generation_config(replace(session.run, mode="triforce"), len(prompt))
    max_len = len(prompt) + plan.new_tokens
    prefilled = shared_prefill(session, cfgs, prompt, max_len, "prefill (ours)") if cfgs else None
    gens = {m: build_system(session, m, c, prefilled, max_len) for m, c in cfgs.items()}
    with console.status("prefill (DeepSpeed)"):
        ds_prefill, _ = ds.prefill(prompt)

    systems = ["deepspeed", *plan.modes]
    res = {s: {"times": [], "tokens": None, "margins": None} for s in systems}
    for rep in range(plan.repeats + 1):  # 0: warm-up
        for s in systems:
            if s == "deepspeed":
                tokens, seconds, _, margins = ds.run("hf-generate", plan.new_tokens, cfg, scores=rep == 0)
                if rep == 0:
                    res[s]["margins"] = margins
            else:
                tokens, seconds, _ = timed_run(gens[s], prefilled)
            if rep == 0:
                res[s]["tokens"] = tokens
            else:
                res[s]["times"].append(seconds)
            console.print(f"  {'warm-up' if rep == 0 else f'rep {rep}'} {s}: {seconds / (len(tokens) - 1) * 1e3:.1f} ms/token")
    synchronize(torch.device(device))
    ref = res.get("autoregressive", res[plan.modes[0]] if plan.modes else None)
    kv_where = "host memory (streamed per pass)" if run.offload == "host" else f"{device} memory"
    rows = []
    for s in systems:
        n = len(res[s]["tokens"]) - 1
        sec = statistics.median(res[s]["times"])
        row = {"system": "DeepSpeed ZeRO-Inference (ZeRO-3, params offloaded to CPU)" if s == "deepspeed" else f"ours: {s}",
               "key": s, "ms_per_token": sec / n * 1e3, "tokens_per_second": n / sec,
               "prefill_seconds": ds_prefill if s == "deepspeed" else prefilled.prefill_seconds,
               "weights": "CPU memory, gathered per layer (ZeRO-3)" if s == "deepspeed" else f"{device} memory",
               "kv_cache": f"{device} memory (transformers' DynamicCache)" if s == "deepspeed" else kv_where,
               "same_tokens": None if ref is None else res[s]["tokens"] == ref["tokens"],
               "times": res[s]["times"]}
        if row["same_tokens"] is False:
            at = row["first_mismatch"] = first_mismatch(res[s]["tokens"], ref["tokens"])
            margins = res[s]["margins"]
            if margins and at is not None and 0 < at <= len(margins):
                row["top2_margin_at_mismatch"] = margins[at - 1]  # DeepSpeed's logit gap where it chose differently
            if s == "deepspeed":  # fed our tokens, does it rank each first (up to a tie)?
                row["teacher_forced_disagreements"] = d = ds.teacher_forced(ref["tokens"])
                row["tie_only"] = ties_only(d)
        rows.append(row)
    import transformers

    return {"hardware_line": hw_line, "hardware": hw, "device": device, "model": run.model, "dtype": run.dtype,
            "prompt_file": str(plan.prompt_file or DEFAULT_PROMPT_FILE), "prompt_tokens": len(prompt),
            "new_tokens": plan.new_tokens, "repeats": plan.repeats, "budget": cfg.budget, "gamma1": cfg.gamma1,
            "gamma2": cfg.gamma2, "deepspeed": deepspeed.__version__, "transformers": transformers.__version__,
            "deepspeed_config": ds_config, "not_included": NOT_INCLUDED, "rows": rows}


def print_report(rep: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console() if sys.stdout.isatty() else Console(width=200)
    t = Table(title=f"per-token decode latency, {Path(rep['model']).name} ({rep['dtype']}), prompt {rep['prompt_tokens']} "
                    f"tokens of {Path(rep['prompt_file']).name}, {rep['new_tokens']} new tokens, median of {rep['repeats']}")
    for col in ("system", "weights", "KV cache", "prefill s", "ms/token", "tokens/s", "vs DeepSpeed", "same tokens"):
        t.add_column(col, justify="right" if col not in ("system", "weights", "KV cache") else "left")
    ds = next(r for r in rep["rows"] if r["key"] == "deepspeed")
    for r in rep["rows"]:
        same = {None: "-", True: "yes", False: f"[red]NO (token {r.get('first_mismatch')}"}[r["same_tokens"]]
        if r["same_tokens"] is False:
            gap = r.get("top2_margin_at_mismatch")
            same += f", top-2 logit gap {gap:.3f}" if gap is not None else ""
            same += ("; ties only" if r.get("tie_only") else "") + ")[/]"
        t.add_row(r["system"], r["weights"], r["kv_cache"], f"{r['prefill_seconds']:.2f}", f"{r['ms_per_token']:.1f}",
                  f"{r['tokens_per_second']:.2f}", f"{ds['ms_per_token'] / r['ms_per_token']:.2f}x", same)
    console.print(f"hardware: {rep['hardware_line']}")
    console.print(t)
    console.print(f"DeepSpeed {rep['deepspeed']}, transformers {rep['transformers']}; {rep['not_included']}.")
    if any(r.get("tie_only") for r in rep["rows"]):
        console.print("note: DeepSpeed's tokens diverge only at logit ties: fed our autoregressive tokens, its model ranks "
                      "each first or within 4 units in the last place of the dtype of its top logit (bf16 logits tie often; "
                      "--dtype float32 gives an exact-token comparison)")
    if not rep["device"].startswith("cuda"):
        console.print("CPU-only run: DeepSpeed's 'offload' moves parameters from host memory to host memory, so its row "
                      "measures ZeRO-3's per-layer gather/release overhead, not PCIe traffic.")


def main(argv=None) -> int:
    plan = parse_args(argv)
    rep = compare(plan)
    print_report(rep)
    if plan.out:
        Path(plan.out).write_text(json.dumps(rep, indent=2, default=str))
        print(f"results: {plan.out}")
    failed = [r for r in rep["rows"] if r["same_tokens"] is False and not (plan.accept_ties and r.get("tie_only"))]
    if failed:
        print(f"error: {', '.join(r['key'] for r in failed)} generated different tokens than our autoregressive greedy",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
