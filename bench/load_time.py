"""How long a model takes to load each way: its folder's dequantized weights or the GGUF's blocks as stored.

    python -m bench.load_time --model models/qwen2.5-coder-1.5b [--dtype bfloat16] [--repeats 3]
    python -m bench.load_time --model models/smollm2-135m --fresh [--out results/load_time.json]

One thread; the two loads alternate after one of each (that first one also parses the GGUF, which
the process then keeps, and fills the page cache); prints the medians and what `auto` resolves to.
Stored loads keep their packed model beside the GGUF (model/stored_cache.py), so the repeats map it.
--fresh: each load in a new process, as a user's next run is: the folder, then the stored load with
no cache file (parses, decodes, packs, writes the cache), then the stored load that maps it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from triforce.model import stored_cache
from triforce.model.gguf_loader import gguf_origin, resolve_weights
from triforce.model.loader import load_model

WAYS = ("dequantized", "stored")


def timed_load(model: str, dtype: torch.dtype, weights: str) -> float:
    start = time.perf_counter()
    loaded = load_model(model, dtype, "cpu", weights=weights)
    seconds = time.perf_counter() - start
    del loaded
    return seconds


CHILD = """import sys, time, torch
torch.set_num_threads(1)
from triforce.model.loader import load_model
start = time.perf_counter()
load_model(sys.argv[1], getattr(torch, sys.argv[2]), "cpu", weights=sys.argv[3])
print(time.perf_counter() - start)"""


def fresh_load(model: str, dtype: str, weights: str) -> tuple[float, float]:
    """(seconds in load_model, seconds of the whole process) for one load in a new process."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, model, dtype, weights], check=True, capture_output=True, text=True)
    return float(out.stdout.split()[-1]), time.perf_counter() - start


def fresh(args) -> dict:
    origin = gguf_origin(args.model)
    cache = stored_cache.cache_path(origin, getattr(torch, args.dtype))
    cache.unlink(missing_ok=True)
    rows = {}
    for name, weights in (("dequantized", "dequantized"), ("stored, no cache", "stored"),
                          ("stored, cached", "stored"), ("stored, cached again", "stored")):
        load, whole = fresh_load(args.model, args.dtype, weights)
        rows[name] = {"load_s": round(load, 2), "process_s": round(whole, 2)}
        print(f"{name:22s} load {load:5.2f} s, whole process {whole:5.2f} s")
    size = cache.stat().st_size if cache.is_file() else 0
    print(f"cache file {cache.name}: {size / 1e6:.0f} MB")
    return {"model": args.model, "dtype": args.dtype, "loads": rows, "cache_mb": round(size / 1e6)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/qwen2.5-coder-1.5b")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--fresh", action="store_true", help="each load in a new process (first and second stored load)")
    p.add_argument("--out", type=Path, default=None, help="JSON of the --fresh figures")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.fresh:
        result = fresh(args)
        if args.out:
            args.out.write_text(json.dumps(result, indent=1) + "\n")
        return 0
    dtype = getattr(torch, args.dtype)
    print(f"auto resolves to {resolve_weights('auto', args.model, 'cpu', dtype)}")
    for way in WAYS:
        print(f"{way:12s} first load {timed_load(args.model, dtype, way):.2f} s (stored: parses the GGUF unless its packed cache is current)")
    times = {way: [] for way in WAYS}
    for _ in range(args.repeats):
        for way in WAYS:
            times[way].append(timed_load(args.model, dtype, way))
    for way, runs in times.items():
        print(f"{way:12s} median {statistics.median(runs):.2f} s (runs {', '.join(f'{t:.2f}' for t in runs)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
