"""Defaults that depend on the machine and the checkpoint, decided once per run and said in the
statistics: torch threads, the dtype, and the sampling settings.

Threads. On a 2-core machine that also runs other jobs (a laptop, CI), OpenMP threads that spin
while they wait fight the other jobs for the cores: SmolLM2 decode, 1,024-token context, 1 vs 2
threads beside two busy processes measured 11.8 vs 0.49 tokens/s in float32 (16.8 vs 3.0 in
bfloat16). With waiting threads that sleep instead (OMP_WAIT_POLICY=PASSIVE, set by the command-line entry points
before torch loads its OpenMP runtime: triforce.cli.entry) the collapse is gone (2 threads 5.6 vs 1 thread 4.5 tokens/s under a
load of 3-5), so "auto" uses the cores the machine's other work leaves free, at least one: measured
over a quarter of a second as the run starts (/proc/stat), not by the last minute's load average,
which still counts a run that just ended (after `triforce prepare`, or a second `triforce generate`,
it read 0.6-0.8 on 2 idle cores and took 1 thread: 67 tokens/s at 4K against 88 on 2).

Dtype. bfloat16 where the CPU computes it natively (avx512_bf16 or AMX): at 1 thread it decoded
16.8 tokens/s against 11.8 in float32 and prefilled 413 against 198 tokens/s; float32 elsewhere,
where bfloat16 matmuls are emulated. bfloat16 on a GPU.

Sampling. generate.py with a prompt and chat.py use the checkpoint's own generation settings
(generation_config.json: do_sample, temperature, top_p, top_k), greedy when it has none. The
embedded main job continues a novel, where small models loop: SmolLM2-135M over 128 tokens after
4,096 of Pride and Prejudice, distinct 4-grams per run over 4 seeds: greedy-like 0.2 / top-p 0.9
(its model card's settings) 0.53-0.66, 0.6 / 0.95 0.11-0.99, 0.8 / 0.95 0.73-1.00, temperature 1
0.97-1.00; so that job samples from the model's own distribution (temperature 1). Measuring tools
(bench, sweep) stay greedy, since they compare engines token for token.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]  # triforce/
# where prepare_models writes and the front ends look: TRIFORCE_MODELS, else models/ beside the
# package (a source checkout, installed editable)
MODELS_DIR = Path(os.environ.get("TRIFORCE_MODELS") or PACKAGE.parent / "models")
DEFAULT_MODEL = MODELS_DIR / "smollm2-135m"
DEFAULT_PROMPT_FILE = PACKAGE / "data" / "pride_and_prejudice_ch1-9.txt"


BUSY_SAMPLE_SECONDS = 0.25  # long enough to average out a shell's blip, short beside loading a model
# A window opened earlier than this says too little of what other work does now: sample afresh
BUSY_WINDOW_MAX_SECONDS = 30.0


def auto_threads(sample_seconds: float = BUSY_SAMPLE_SECONDS) -> tuple[int, str]:
    """(threads, why) for --threads auto: the cores not busy now, at least one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    busy = busy_cores(sample_seconds)
    if busy is None:  # no /proc/stat: the last minute's load, else assume the machine is ours
        try:
            busy = os.getloadavg()[0]
        except OSError:
            busy = 0.0
        threads = max(1, min(cores, round(cores - busy)))
        return threads, f"auto: {cores} cores, load {busy:.1f}"
    threads = max(1, min(cores, round(cores - busy)))
    return threads, f"auto: {cores} cores, {busy:.1f} busy"


def open_busy_window() -> None:
    """Start counting other work's CPU time now. The command-line entry points call it first thing (and
    importing this module does), so that `busy_cores` reads the seconds a start spends importing torch
    and loading over this process's own CPU time, instead of sleeping a quarter second of them away."""
    global _window
    times = cpu_times()
    _window = None if times is None else (time.monotonic(), times, own_ticks())


def busy_cores(seconds: float) -> float | None:
    """How many of the machine's cores other work kept busy: /proc/stat's busy CPU time less this
    process's own (and its finished children's), over the cores, since the window opened
    (`open_busy_window`) if that was at least `seconds` and at most BUSY_WINDOW_MAX_SECONDS ago, else
    over the next `seconds` (sleeping). Opens the next window. None without /proc/stat."""
    global _window
    age = time.monotonic() - _window[0] if _window is not None else None
    if age is None or age > BUSY_WINDOW_MAX_SECONDS:
        first, mine = cpu_times(), own_ticks()
        time.sleep(seconds)
    else:
        _, first, mine = _window
        time.sleep(max(seconds - age, 0.0))
    second, now = cpu_times(), own_ticks()
    _window = None if second is None else (time.monotonic(), second, now)  # the next call's window
    mine = now - mine
    if first is None or second is None or second[0] <= first[0]:
        return None
    total, idle = second[0] - first[0], second[1] - first[1]
    return (os.cpu_count() or 1) * min(max(total - idle - mine, 0) / total, 1.0)


def own_ticks() -> float:
    """This process's CPU time (every thread, and children it has waited for: a kernel's compiler) in
    /proc/stat's clock ticks."""
    t = os.times()
    return (t.user + t.system + t.children_user + t.children_system) * os.sysconf("SC_CLK_TCK")


def cpu_times() -> tuple[int, int] | None:
    """(all, idle) clock ticks of every CPU since boot, from /proc/stat's first line (idle counts
    iowait; steal, what a hypervisor gave other machines, counts as busy)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    return sum(fields), fields[3] + fields[4]


_window = None  # (monotonic seconds, cpu_times(), own_ticks()) where the busy window opened
open_busy_window()


def cpu_has_bf16() -> bool:
    """Whether the CPU computes bfloat16 natively (avx512_bf16 or AMX), from /proc/cpuinfo's flags
    (ATEN_CPU_CAPABILITY=avx2 hides them: model/kv_dtype.cpu_flags)."""
    from triforce.model.kv_dtype import cpu_flags

    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def auto_dtype(device: str) -> str:
    if str(device).startswith("cuda"):
        return "bfloat16"
    return "bfloat16" if cpu_has_bf16() else "float32"


def checkpoint_sampling(model_dir: str | Path) -> dict:
    """temperature / top_p / top_k from the checkpoint's generation_config.json when it samples
    (do_sample true); {"temperature": 0.0} (greedy) when it has none or does not sample."""
    try:
        gen = json.loads((Path(model_dir) / "generation_config.json").read_text())
    except (OSError, ValueError):
        gen = {}
    if not isinstance(gen, dict) or not gen.get("do_sample") or not gen.get("temperature"):
        return {"temperature": 0.0}
    out = {"temperature": float(gen["temperature"])}
    if gen.get("top_p") is not None:
        out["top_p"] = float(gen["top_p"])
    if gen.get("top_k"):
        out["top_k"] = int(gen["top_k"])
    return out
