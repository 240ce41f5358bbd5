"""How long a model takes to load each way: its folder's dequantized weights or the GGUF's blocks as stored.

    python -m bench.load_time --model models/qwen2.5-coder-1.5b [--dtype bfloat16] [--repeats 3]

One thread; the two loads alternate after one of each (that first one also parses the GGUF, which
the process then keeps, and fills the page cache); prints the medians and what `auto` resolves to.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from triforce.model.gguf_loader import resolve_weights
from triforce.model.loader import load_model

WAYS = ("dequantized", "stored")


def timed_load(model: str, dtype: torch.dtype, weights: str) -> float:
    start = time.perf_counter()
    loaded = load_model(model, dtype, "cpu", weights=weights)
    seconds = time.perf_counter() - start
    del loaded
    return seconds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/qwen2.5-coder-1.5b")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    print(f"auto resolves to {resolve_weights('auto', args.model, 'cpu', dtype)}")
    for way in WAYS:
        print(f"{way:12s} first load {timed_load(args.model, dtype, way):.2f} s (parses the GGUF for stored)")
    times = {way: [] for way in WAYS}
    for _ in range(args.repeats):
        for way in WAYS:
            times[way].append(timed_load(args.model, dtype, way))
    for way, runs in times.items():
        print(f"{way:12s} median {statistics.median(runs):.2f} s (runs {', '.join(f'{t:.2f}' for t in runs)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
