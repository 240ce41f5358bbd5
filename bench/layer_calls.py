"""Eager CPU decoding with one of its shortcuts on and off, in one process, alternating, after a
warm-up: ms per token, torch ops per token, and whether greedy tokens agree. `--switch layer_ops`: a
layer's small steps as one call each (model/layer_ops.py: the rotation, the float32 norm;
`cache_attend`: the cache write and attention) against torch's ops for them; `--switch eager_steps`:
each layer's kernels chosen once per model (model/eager_steps.py) against the modules choosing per call;
`--switch fused_layers`: a layer as two calls around its attention (model/fused_layers.py) against its
bound steps called one by one; `--switch fused_stack`: every layer of a pass in one call
(fused_layers.stack) against the layers' two calls each. SmolLM2 on its stored blocks; the KV cache is filled with random values to the context
(attention's cost does not depend on them), then each timed run decodes --tokens greedy steps from it.

    python -m bench.layer_calls [--switch layer_ops|eager_steps|fused_layers|fused_stack --contexts 4096,16384 --dtypes f32,bf16 --threads 1]

f32 is what an avx2-only CPU runs (float32 on the stored blocks, a float16 cache; set
ATEN_CPU_CAPABILITY=avx2 to emulate one), bf16 what a CPU with avx512_bf16 runs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.bytes_floor import machine
from bench.kernels import OpCounter
from triforce.model import eager_steps, fused_layers, layer_ops
from triforce.model.kv_dtype import use_kv_dtype
from triforce.model.loader import load_model
from triforce.speculative.caches import FullCache

DTYPES = {"f32": (torch.float32, torch.float16), "bf16": (torch.bfloat16, None)}  # compute, KV (None: the same)
# each switch: a module's flag
SWITCHES = {"layer_ops": (layer_ops, "enabled"), "eager_steps": (eager_steps, "enabled"),
            "fused_layers": (fused_layers, "enabled"), "fused_stack": (fused_layers, "stack_enabled")}


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def decode(model, cache, context: int, tokens: int) -> list[int]:
    """`tokens` greedy steps after the cache's `context` tokens; the cache is left at `context`."""
    out, token = [], torch.tensor([42])
    for _ in range(tokens):
        token = model(token, cache, last_only=True)[-1].argmax().view(1)
        out.append(int(token))
    cache.rollback(context)
    return out


def ops_per_token(model, cache, context: int) -> int:
    with OpCounter() as counter:
        decode(model, cache, context, 1)
    return counter.ops


def run(model, context: int, args) -> dict:
    module, flag = SWITCHES[args.switch]
    cache = FullCache(model.kv_shape(), context + args.tokens + 8)
    g = torch.Generator().manual_seed(0)
    for buffer in (cache.k, cache.v):
        buffer.copy_(torch.randn(buffer.shape, generator=g).to(buffer.dtype))
    cache.used = cache.length = context
    times: dict[bool, list[float]] = {True: [], False: []}
    tokens, ops = {}, {}
    with torch.inference_mode():
        for on in (True, False):  # warm-up, tokens and op counts
            setattr(module, flag, on)
            tokens[on] = decode(model, cache, context, args.tokens)
            ops[on] = ops_per_token(model, cache, context)
        for r in range(args.rounds):
            for on in (r % 2 == 0, r % 2 == 1):
                setattr(module, flag, on)
                start = time.perf_counter()
                decode(model, cache, context, args.tokens)
                times[on].append((time.perf_counter() - start) / args.tokens * 1e3)
            say(f"  {context}: round {r + 1}/{args.rounds}: {args.switch} on {times[True][-1]:.2f}, "
                f"off {times[False][-1]:.2f} ms/token")
    setattr(module, flag, True)
    on_ms, off_ms = statistics.median(times[True]), statistics.median(times[False])
    return {"context": context, "ms_per_token_on": on_ms, "ms_per_token_off": off_ms, "speedup": off_ms / on_ms,
            "ops_per_token_on": ops[True], "ops_per_token_off": ops[False], "tokens_equal": tokens[True] == tokens[False],
            "runs_ms_per_token": {"on": times[True], "off": times[False]}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.layer_calls", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/smollm2-135m")
    ap.add_argument("--switch", default="layer_ops", choices=sorted(SWITCHES), help="the shortcut switched")
    ap.add_argument("--weights", default="stored", help="stored (the GGUF's blocks) or dequantized")
    ap.add_argument("--contexts", default="4096,16384")
    ap.add_argument("--dtypes", default="f32,bf16", help=f"of {', '.join(DTYPES)}")
    ap.add_argument("--tokens", type=int, default=16, help="greedy steps per timed run")
    ap.add_argument("--rounds", type=int, default=5, help="timed runs of each, alternating")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="results/layer-calls.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not layer_ops.available():
        print("error: the one-call CPU ops do not build here (a C++ compiler is needed); nothing to compare",
              file=sys.stderr)
        return 1
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = []
    for name in args.dtypes.split(","):
        dtype, kv = DTYPES[name]
        say(f"{name}: loading {args.model}")
        model = load_model(args.model, dtype, "cpu", max_len=max(contexts) + args.tokens + 8,
                           weights=args.weights)
        use_kv_dtype(model, kv)
        rows += [{"dtype": name, **run(model, context, args)} for context in contexts]
    print(f"{args.switch}, {args.threads} thread(s), ms per token:")
    print(f"{'dtype':6} {'context':>8} {'on':>9} {'off':>10} {'speedup':>8} {'ops/token on/off':>17} tokens")
    for row in rows:
        print(f"{row['dtype']:6} {row['context']:>8} {row['ms_per_token_on']:>6.2f} ms "
              f"{row['ms_per_token_off']:>7.2f} ms {row['speedup']:>7.2f}x "
              f"{row['ops_per_token_on']:>8} / {row['ops_per_token_off']:<6} "
              f"{'equal' if row['tokens_equal'] else 'DIFFER'}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": machine(), "args": vars(args), "rows": rows}, indent=2))
    say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
