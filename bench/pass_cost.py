"""What one forward pass costs: T new tokens against S cached ones, relative to a single token.

    python -m bench.pass_cost --contexts 256,2048,32768 --tokens 1,4,7 --dtype bfloat16 --threads 1

Speculation pays only if verifying T tokens at once costs about one single-token pass: the cached
keys and values are read once whatever T is. This fills a full cache with random keys and values up
to S (the cost does not depend on their values), runs the target's forward with T new tokens, rolls
back, and repeats: median milliseconds per pass and the ratio to T=1 at the same S. S small is the
weights-only cost of a pass (what the retrieval and drafter levels mostly pay on CPU).

`--key-layouts tiled,plain` times a full cache whose keys are in tiles and values in pairs
(model/key_tiles.py, what a bf16 model on avx512_bf16 builds) against a plain one, alternating pass by
pass in one process.
`--against REV` does the same for the bf16 attention kernels of git revision REV (built beside this
tree's under another op namespace, as bench.attention_rows --old does): a pass whose layers call
REV's `cache_attend` over the key layout `--key-layouts` names (the model's own by default; `plain`
for a revision before key tiles), then this tree's over the model's own, so a change is timed
without another process's noise. (A revision before session 33 reads a tiled cache's values as plain
ones: its passes move the same bytes, but their logits are not the model's.) `--products amx,avx512` (a CPU with AMX) times the weight products
over stored blocks through AMX tiles (model/stored_amx.py, the default there) against the avx512
kernels, pass by pass over one cache; `--attention tiles,avx512` the same for attention's two products
(model/decode_attention.py: AMX tiles, the default there, against the avx512 kernels). With `--dtype
float32` on a CPU with avx512f, `--products avx512,avx2` times the float32 products over stored blocks
in their avx512f code against their avx2 code, and `--attention avx512,avx2` attention's
(model/decode_attention_f32.py), the same bits either way.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from triforce.cli.common import run_cli

from triforce.runtime.defaults import DEFAULT_MODEL


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--contexts", default="256,2048,32768", help="cached tokens S, comma-separated")
    p.add_argument("--tokens", default="1,2,4,7,9", help="new tokens T per pass, comma-separated")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--key-layouts", default="", help="'tiled,plain': both full caches side by side "
                   "(default: the one the model builds)")
    p.add_argument("--against", default="", help="a git revision whose bf16 attention kernels to time "
                   "beside this tree's (decode_attention.cache_attend), pass by pass")
    p.add_argument("--products", default="", help="'amx,avx512': the weight products over stored blocks "
                   "through AMX tiles and through the avx512 kernels, pass by pass (an AMX CPU); "
                   "'avx512,avx2' with --dtype float32: the float32 kernels' avx512f code and avx2 code")
    p.add_argument("--attention", default="", help="'tiles,avx512': attention's products through AMX "
                   "tiles against the avx512 kernels, pass by pass over one cache (a CPU with AMX); "
                   "'avx512,avx2' with --dtype float32: the float32 attention's avx512f code and avx2 code")
    p.add_argument("--debug", action="store_true")
    args = p.parse_args(argv)
    args.key_layouts = [name for name in args.key_layouts.split(",") if name]
    if not set(args.key_layouts) <= {"tiled", "plain"}:
        p.error("--key-layouts takes tiled and/or plain")
    args.products = [name for name in args.products.split(",") if name]
    if not set(args.products) <= ({"avx512", "avx2"} if args.dtype == "float32" else {"amx", "avx512"}):
        p.error("--products takes amx and/or avx512 (bfloat16), avx512 and/or avx2 (--dtype float32)")
    if args.products and (args.key_layouts or args.against):
        p.error("--products times one cache and this tree's attention: drop --key-layouts/--against")
    args.attention = [name for name in args.attention.split(",") if name]
    if not set(args.attention) <= ({"avx512", "avx2"} if args.dtype == "float32" else {"tiles", "avx512"}):
        p.error("--attention takes tiles and/or avx512 (bfloat16), avx512 and/or avx2 (--dtype float32)")
    if args.attention and (args.key_layouts or args.against or args.products):
        p.error("--attention times one cache and one set of products: drop --key-layouts/--against/--products")
    args.contexts = [int(c) for c in args.contexts.split(",")]
    args.tokens = [int(t) for t in args.tokens.split(",")]
    return args


@dataclass
class Setup:
    """What one timed pass runs: its full cache, the bf16 cache_attend its layers call, and which
    kernels' code (None: the process's own choice): AMX products, AMX attention tiles, and the float32
    products' and attention's avx512f code."""

    cache: Any
    cache_attend: Callable
    amx_products: bool | None = None
    attention_tiles: bool | None = None
    wide_products: bool | None = None
    wide_attention: bool | None = None


def pass_ms(model, setups: dict[str, Setup], length: int, T: int, repeats: int) -> dict[str, float]:
    """Median ms of a pass of T tokens for each setup (its cache filled to `length`), the setups in turn."""
    import torch

    from triforce.model import decode_attention, decode_attention_f32, stored_amx, stored_avx2

    tokens = torch.randint(0, model.cfg.vocab_size, (T,))
    times = {name: [] for name in setups}
    ours, amx, tiles = decode_attention.cache_attend, stored_amx.available, decode_attention.tiles()
    codes = [(module, module.code()) for module in (stored_avx2, decode_attention_f32)]
    try:
        with torch.no_grad():
            for i in range(repeats + 1):  # the first is a warm-up
                for name, setup in setups.items():
                    decode_attention.cache_attend = setup.cache_attend
                    stored_amx.available = amx if setup.amx_products in (None, True) else (lambda: False)
                    decode_attention.switch_tiles(tiles if setup.attention_tiles is None else setup.attention_tiles)
                    for module, wide in ((stored_avx2, setup.wide_products), (decode_attention_f32, setup.wide_attention)):
                        if wide is not None:
                            module.use_avx512(wide)
                    start = time.perf_counter()
                    model(tokens, setup.cache)
                    times[name].append(time.perf_counter() - start)
                    setup.cache.rollback(length)
    finally:
        decode_attention.cache_attend, stored_amx.available = ours, amx
        decode_attention.switch_tiles(tiles)
        for module, code in codes:
            if code:
                module.use_avx512(code == "avx512")
    return {name: 1e3 * statistics.median(t[1:]) for name, t in times.items()}


def kernels_against(rev: str):
    """REV's cache_attend, built beside this tree's (as bench.attention_rows --old builds them)."""
    import torch

    from bench.attention_rows import load_old
    from triforce.model import cpu_pool, decode_attention
    from triforce.model.errors import UserError

    if not decode_attention.available() or not load_old(rev):
        raise UserError(f"the bf16 attention kernels of {rev} or of this tree do not build here (avx512_bf16 "
                        "and a C++ compiler needed); drop --against")
    old = torch.ops.triforce_decode_old
    old.use_pool(cpu_pool.address())  # its tasks over the same threads as ours

    def theirs(q, k, v, cache_k, cache_v, layer, start, scale, tiled=False):
        # a revision before key tiles takes no `tiled`: give it --key-layouts plain
        return old.cache_attend(q, k, v, cache_k, cache_v, layer, start, scale, *([True] if tiled else []))

    return theirs


def setups_for(model, args, slots: int) -> dict[str, Setup]:
    """name -> Setup: one per key layout; with --against, REV's kernels over the layout asked for (the
    model's own by default) and this tree's over the model's own; with --products or --attention, one
    per code over one cache."""
    from triforce.model import cpu_kernels, decode_attention, decode_attention_f32, stored_amx, stored_avx2
    from triforce.model.errors import UserError
    from triforce.speculative.caches import FullCache

    caches = build_caches(model, args.key_layouts, slots)
    (cache, *_) = caches.values()
    ours = decode_attention.cache_attend
    for flag, names, module, what in (("--products", args.products, stored_avx2, "products"),
                                      ("--attention", args.attention, decode_attention_f32, "attention")):
        if names and args.dtype == "float32":
            if module.code() == "" or ("avx512" in names and not cpu_kernels.wide_default()):
                raise UserError(f"no avx512f float32 {what} here (no avx2/avx512f, no C++ compiler, or "
                                f"TRIFORCE_AVX512=0); drop {flag}")
            wide = "wide_products" if module is stored_avx2 else "wide_attention"
            return {name: Setup(cache, ours, **{wide: name == "avx512"}) for name in names}
    if args.products:
        if "amx" in args.products and not stored_amx.available():
            raise UserError("no AMX products here (the CPU lacks AMX, no C++ compiler, or TRIFORCE_AMX=0); "
                            "drop --products")
        return {name: Setup(cache, ours, amx_products=name == "amx") for name in args.products}
    if args.attention:
        if "tiles" in args.attention and not decode_attention.tiles():
            raise UserError("attention's products take no AMX tiles here (the CPU lacks AMX, no C++ compiler, "
                            "or TRIFORCE_AMX=0); drop --attention")
        return {name: Setup(cache, ours, attention_tiles=name == "tiles") for name in args.attention}
    if not args.against:
        return {name: Setup(cache, ours) for name, cache in caches.items()}
    if len(caches) > 1:
        raise UserError("--against takes one key layout (the one for the revision's kernels)")
    (layout, cache), = caches.items()
    return {args.against + (f" ({layout} keys)" if layout else ""): Setup(cache, kernels_against(args.against)),
            "this tree": Setup(FullCache(model.kv_shape(), slots), ours)}


def build_caches(model, layouts: list[str], slots: int) -> dict:
    """Full caches by key layout ('' for the model's own)."""
    import dataclasses

    from triforce.model.errors import UserError
    from triforce.speculative.caches import FullCache

    shape = model.kv_shape()
    if "tiled" in layouts and not shape.tiled_keys:
        raise UserError("keys are tiled only for a bfloat16 model on a CPU with avx512_bf16 and a C++ compiler; "
                        "drop 'tiled' from --key-layouts")
    return {name: FullCache(dataclasses.replace(shape, tiled_keys=name == "tiled") if name else shape, slots)
            for name in layouts or [""]}


def main(argv=None) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from triforce.runtime.loading import resolve_dtype
    from triforce.model.loader import load_model

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    longest = max(args.contexts) + max(args.tokens)
    model = load_model(args.model, dtype=resolve_dtype(args.dtype), max_len=longest)
    setups = setups_for(model, args, longest)
    table = Table(title=f"{Path(args.model).name} ({args.dtype}), {torch.get_num_threads()} threads: ms per pass")
    names = list(setups)
    label = ("attention" if args.against or args.attention else "keys" if args.key_layouts
             else "products" if args.products else "")
    for col in ("cached S", *([label] if label else []), *(f"T={t}" for t in args.tokens)):
        table.add_column(col, justify="right")
    points, start = len(args.contexts) * len(args.tokens), time.perf_counter()
    for S in args.contexts:
        # random keys and values (the cost does not depend on them), each cache once
        for cache in {id(setup.cache): setup.cache for setup in setups.values()}.values():
            cache.k.normal_()
            cache.v.normal_()
            cache.used = cache.length = S
        ms = {}
        for T in args.tokens:
            ms[T] = pass_ms(model, setups, S, T, args.repeats)
            # a point at 32K cached tokens takes tens of seconds on a CPU: say each one as it lands,
            # on stderr, so that the table on stdout stays clean
            said = ", ".join(f"{name + ' ' if name else ''}{t:.1f}" for name, t in ms[T].items())
            print(f"pass_cost: {len(ms) + args.contexts.index(S) * len(args.tokens)} of {points} points, "
                  f"S={S:,} T={T}: {said} ms per pass ({time.perf_counter() - start:.0f} s)",
                  file=sys.stderr, flush=True)
        for name in names:
            base = ms.get(1, ms[args.tokens[0]])[name]
            table.add_row(f"{S:,}", *([name] if label else []),
                          *(f"{ms[T][name]:.1f} ({ms[T][name] / base:.2f}x)" for T in args.tokens))
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
