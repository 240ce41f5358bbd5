"""How close CPU decoding comes to its byte floor: bytes a decode step reads against memory bandwidth.

    python -m bench.bytes_floor                      # SmolLM2 at 4K, every setup and mode
    python -m bench.bytes_floor --contexts 4096,16384 --new-tokens 32 --repeats 3

For each context, each setup (dtype, weights as stored or dequantized, KV dtype) prefills the prompt
once; then every (setup, mode) decodes `--new-tokens` from that prefill, the runs alternating so that
load on a shared machine falls on all alike, after one warm-up run each. Per (setup, mode):

    bytes/token  modelled (bench/traffic.py): each pass reads its level's weights (as this setup
                 stores them, counted from the model's modules) plus the KV its cache holds
    floor        bytes/token over the memory read bandwidth measured in the same run (a large
                 tensor summed, best of several)
    ms/token     measured decode time per new token (median over repeats)

Writes results/bytes_floor-<time>.json and prints a table of 80 columns (wider for setup names past 12 characters).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.measure import seed_config, seed_mode, timed_run
from bench.traffic import Traffic, bytes_read, kv_bytes_per_token

from triforce.speculative import GenerationConfig

DEFAULT_MODEL = "models/smollm2-135m"
GENERATION_DEFAULTS = GenerationConfig()
MODES = ("autoregressive", "speculative", "retrieval", "triforce")


@dataclass(frozen=True)
class Setup:
    name: str
    dtype: torch.dtype
    weights: str  # "stored" | "dequantized"
    kv: torch.dtype | None  # None: the compute dtype
    compiled: bool = False  # --compile: each level's small passes as torch.compile'd graphs
    options: dict | None = None  # inductor's options for them


SETUPS = {
    "f32": Setup("f32", torch.float32, "dequantized", None),  # the baseline (avx2 machines)
    "f32-kv16": Setup("f32-kv16", torch.float32, "dequantized", torch.float16),
    "bf16": Setup("bf16", torch.bfloat16, "dequantized", None),  # today's default with avx512_bf16
    "bf16-stored": Setup("bf16-stored", torch.bfloat16, "stored", None),
    "f32-stored": Setup("f32-stored", torch.float32, "stored", None),  # exact; compiled product (stored_f32)
    # an avx2-only CPU's defaults: float32 compute on the stored blocks, a float16 KV cache
    "f32-stored-kv16": Setup("f32-stored-kv16", torch.float32, "stored", torch.float16),
    "f32-stored-kv16-compiled": Setup("f32-stored-kv16-compiled", torch.float32, "stored", torch.float16, compiled=True),
    "bf16-stored-compiled": Setup("bf16-stored-compiled", torch.bfloat16, "stored", None, compiled=True),
    # the graphs' host code as C++ (inductor's cpp_wrapper): faster steps, much longer first compiles
    "bf16-stored-compiled-cpp": Setup("bf16-stored-compiled-cpp", torch.bfloat16, "stored", None, compiled=True,
                                      options={"cpp_wrapper": True}),
}
DEFAULT_SETUPS = ("f32", "f32-kv16", "bf16", "bf16-stored")


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def memory_read_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Bytes/s of summing a float32 tensor far larger than the caches (best of `repeats`)."""
    x = torch.ones(nbytes // 4)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def prompt_ids(tokenizer, n: int) -> list[int]:
    """`n` tokens of a novel shipped with the package (real text: acceptance like a real prompt's)."""
    text = (Path(__file__).resolve().parents[1] / "triforce" / "data" / "persuasion.txt").read_text()
    ids = tokenizer.encode(text)
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def load_setup(model: str, setup: Setup, max_len: int):
    from triforce.model.gguf_loader import weights_summary
    from triforce.model.kv_dtype import use_kv_dtype
    from triforce.model.loader import load_model

    target = load_model(model, setup.dtype, "cpu", max_len=max_len, weights=setup.weights)
    use_kv_dtype(target, setup.kv)
    return target, weights_summary(target)


def traffic_for(target, summary: dict, context: int, new_tokens: int, cfg) -> Traffic:
    """bench/traffic.py's per-level bytes, with this setup's weight bytes (counted from the model)
    and KV element size in place of one element size for both. The drafter is the target (self)."""
    shape = target.kv_shape()
    kv_elem = torch.empty((), dtype=shape.dtype).element_size()
    traffic = Traffic(target.cfg, target.cfg, kv_elem, context, new_tokens, cfg)
    kv_token = kv_bytes_per_token(target.cfg, kv_elem)
    weights = summary["bytes_per_pass"]
    mean_len = context + new_tokens // 2
    window = min(cfg.sink_tokens + cfg.draft_window, context)
    traffic.full = weights + kv_token * mean_len
    traffic.middle = weights + kv_token * min(cfg.budget, context)
    traffic.draft = weights + kv_token * window
    return traffic


def run_context(args, context: int, bandwidth: float) -> list[dict]:
    from triforce.model.loader import load_tokenizer
    from triforce.speculative.engine import Generator
    from triforce.speculative.models import Models

    tokenizer = load_tokenizer(args.model)
    prompt = prompt_ids(tokenizer, context)
    max_len = context + args.new_tokens + 64
    # the retrieval budget must stay below the prompt (short smoke runs)
    base = GenerationConfig(max_new_tokens=args.new_tokens, budget=min(args.budget, context // 2))
    cfgs = {mode: base for mode in args.modes}
    state = {}
    for name in args.setups:
        setup = SETUPS[name]
        target, summary = load_setup(args.model, setup, max_len)
        models = Models(target, None)
        seed = Generator(models, seed_config(cfgs), seed_mode(cfgs), max_len)
        say(f"[{context}] {name}: prefilling {context} tokens ({summary['format']}, "
            f"{summary['bytes_per_pass'] / 1e6:.0f} MB of weights a pass)")
        start = time.perf_counter()
        with torch.no_grad():
            seed.prefill(prompt)
        prefilled = seed.snapshot()
        say(f"[{context}] {name}: prefill {time.perf_counter() - start:.0f} s")
        gens = {mode: Generator(models, cfgs[mode], mode, max_len, prefilled=prefilled) for mode in args.modes}
        if setup.compiled:  # compiled in the untimed warm-up round
            from triforce.speculative.graphs import enable_compiled_passes

            for gen in gens.values():
                enable_compiled_passes(gen, setup.options)
        state[name] = (target, summary, prefilled, gens)
    times = {(s, m): [] for s in args.setups for m in args.modes}
    outputs, last = {}, {}
    for rep in range(args.repeats + 1):  # the first round warms up, untimed
        for name in args.setups:
            _, _, prefilled, gens = state[name]
            for mode in args.modes:
                with torch.no_grad():
                    tokens, seconds, stats = timed_run(gens[mode], prefilled)
                if rep:
                    times[(name, mode)].append(seconds / max(1, stats.decode_tokens))
                outputs[(name, mode)], last[(name, mode)] = tokens, stats.to_dict()
        # the machine is shared: what it can read is the best of measurements spread over the run
        bandwidth = max(bandwidth, memory_read_bandwidth())
        say(f"[{context}] round {rep}/{args.repeats} done" + (" (warm-up)" if rep == 0 else "")
            + f"; best read bandwidth so far {bandwidth / 1e9:.1f} GB/s")
    rows = []
    for name in args.setups:
        target, summary, _, _ = state[name]
        rows_bandwidth = bandwidth
        for mode in args.modes:
            stats = last[(name, mode)]
            traffic = traffic_for(target, summary, context, args.new_tokens, cfgs[mode])
            per_token = bytes_read(mode, stats, traffic) / max(1, stats["decode_tokens"])
            ms = 1e3 * statistics.median(times[(name, mode)])
            floor_ms = 1e3 * per_token / rows_bandwidth
            rows.append({"context": context, "setup": name, "mode": mode, "weights": summary["format"],
                         "weight_bytes_per_pass": summary["bytes_per_pass"],
                         "kv_dtype": str(target.kv_shape().dtype).removeprefix("torch."),
                         "bytes_per_token": per_token, "floor_ms_per_token": floor_ms,
                         "ms_per_token": ms, "ms_per_token_runs": [1e3 * t for t in times[(name, mode)]],
                         "x_floor": ms / floor_ms, "bandwidth_bytes_per_second": rows_bandwidth, "tokens_per_second": 1e3 / ms,
                         "same_as_autoregressive": outputs[(name, mode)] == outputs.get((name, "autoregressive")),
                         "passes": stats["passes"], "tokens_per_full_pass": stats["tokens_per_full_pass"]})
    del state
    return rows, bandwidth


def table(rows: list[dict], bandwidth: float) -> str:
    """80 columns for setup names of up to 12 characters, wider for longer ones."""
    width = max([12] + [len(r["setup"]) for r in rows])
    lines = [f"memory read bandwidth {bandwidth / 1e9:.1f} GB/s; floor = bytes / bandwidth",
             f"{'ctx':>6} {'setup':<{width}} {'mode':<14} {'MB/tok':>7} {'floor':>6} {'ms/tok':>7} "
             f"{'xfloor':>6} {'tok/s':>6} {'=AR':>4}",
             "-" * (64 + width)]
    for r in rows:
        lines.append(f"{r['context']:>6} {r['setup']:<{width}} {r['mode']:<14} {r['bytes_per_token'] / 1e6:>7.0f} "
                     f"{r['floor_ms_per_token']:>6.1f} {r['ms_per_token']:>7.1f} {r['x_floor']:>6.2f} "
                     f"{r['tokens_per_second']:>6.1f} {'yes' if r['same_as_autoregressive'] else 'NO':>4}")
    return "\n".join(lines)


def machine() -> dict:
    from triforce.model.kv_dtype import cpu_flags

    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 "unknown")
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "f16c", "fma")))
    return {"cpu": model, "flags": flags, "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "load_average": os.getloadavg(), "torch": torch.__version__}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--contexts", default="4096", help="comma-separated prompt lengths (default 4096)")
    p.add_argument("--setups", default=",".join(DEFAULT_SETUPS), help=f"of {', '.join(SETUPS)}")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--budget", type=int, default=GENERATION_DEFAULTS.budget, help="retrieval cache tokens")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.setups = [s for s in args.setups.split(",") if s]
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = [s for s in args.setups if s not in SETUPS] + [m for m in args.modes if m not in MODES]
    if unknown:
        p.error(f"unknown setup or mode: {', '.join(unknown)}")
    torch.set_num_threads(args.threads)
    bandwidth = memory_read_bandwidth()
    say(f"memory read bandwidth: {bandwidth / 1e9:.1f} GB/s ({args.threads} thread(s))")
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        more, bandwidth = run_context(args, context, bandwidth)
        rows += more
    out = args.out or Path("results") / f"bytes_floor-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), "bandwidth_bytes_per_second": bandwidth,
                               "new_tokens": args.new_tokens, "repeats": args.repeats, "model": args.model,
                               "rows": rows}, indent=2) + "\n")
    print(table(rows, bandwidth))
    say(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
