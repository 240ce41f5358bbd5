"""Host overhead of the engines at widths where nothing else is left (issue 22).

A random Llama of many thin layers (default 30 layers, hidden 64) makes every kernel tiny, so what a
pass costs is the host's: Python, dispatch, and on a GPU every wait for the device. For each mode,
greedy and sampled, it reports host waits per full-cache round (counted at the call sites where a
GPU host would wait: triforce/speculative/hostsync.py), aten ops per generated token (a dispatch
counter) and the share of them outside the model's passes (sampling, acceptance, the caches'
bookkeeping: what compiling the passes leaves as it is), and host milliseconds per pass and per
token, beside transformers' StaticCache decode step
on the same weights. Then kernels per transformer layer of one pass of each level, eager (aten ops)
and compiled (the kernels of the --compile graph), from two shallow models (bench/kernels.py).
JSON goes to --out.

    python -m bench.host_overhead [--layers 30 --hidden 64 --context 512 --new-tokens 48 --no-compile]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from bench import kernels
from bench.kernels import OpCounter
from triforce.model.loader import load_model
from triforce.model.transformer import Transformer
from triforce.speculative import GenerationConfig, Generator, Models
from triforce.speculative.engine import MODES
from triforce.speculative.graphs import enable_compiled_passes
from triforce.speculative.hostsync import HostSyncCounter
from triforce.speculative.stats import LOOKUP_ROUND, ROUND

PROGRESS_AFTER_SECONDS = 10.0


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m bench.host_overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--context", type=int, default=512, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--gamma1", type=int, default=4)
    ap.add_argument("--gamma2", type=int, default=6)
    ap.add_argument("--kernel-layers", default="3,5",
                    help="the two depths whose difference gives kernels per layer (bench/kernels.py)")
    ap.add_argument("--no-compile", action="store_true",
                    help="kernels per layer eager only: skips torch.compile (about 2 minutes cold)")
    ap.add_argument("--compiled-rounds", action="store_true",
                    help="also triforce's device rounds compiled per pass and per whole round (minutes of compiling)")
    ap.add_argument("--out", default="results/host-overhead-cpu.json")
    return ap.parse_args(argv)


def tiny_checkpoint(args, folder: Path):
    """A random Llama saved in HF format; returns transformers' model of it (for the StaticCache row)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4 * (args.context + args.new_tokens), tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model


COMPILED = {"triforce-device-compiled": "per pass", "triforce-device-compiled-rounds": "per round"}


@contextmanager
def ops_in_passes(ops: OpCounter):
    """Yields a one-item list that ends up holding the ops `ops` counted inside the model's forward
    passes (every level's: a pass is a Transformer call), the rest being the engine's own."""
    inside, depth, forward = [0], [0], Transformer.forward

    def counted(self, *args, **kwargs):
        depth[0] += 1
        before = ops.ops
        try:
            return forward(self, *args, **kwargs)
        finally:
            depth[0] -= 1
            if not depth[0]:
                inside[0] += ops.ops - before

    Transformer.forward = counted
    try:
        yield inside
    finally:
        Transformer.forward = forward


def measure_mode(models, args, mode: str, temperature: float, prompt: list[int]) -> dict:
    """Three generations from the same prompt (after an untimed one): timed, counting host waits,
    counting aten ops. "triforce-device" is triforce with its drafter->middle rounds on the device
    (the GPU default); "-compiled" runs every small pass as a torch.compile'd graph (--compile), and
    "-compiled-rounds" each drafter->middle round as one (rounds.RoundGraph), where the host makes
    one call per round; a compiled graph's kernels do not pass through the op counter."""
    engine = mode.split("-")[0]
    cfg = GenerationConfig(max_new_tokens=args.new_tokens, budget=args.budget, chunk_size=args.chunk,
                           gamma1=args.gamma1, gamma2=args.gamma2, draft_window=args.budget, sink_tokens=4,
                           temperature=temperature, device_rounds="-device" in mode)

    kept = []

    def fresh():
        if kept:  # a compiled generator goes back to just after its prefill: its graphs stay compiled
            kept[0].truncate(len(prompt) + 1)
            kept[0].reset_stats()
            return kept[0]
        gen = Generator(models, cfg, engine, len(prompt) + 2 * args.new_tokens)
        if mode in COMPILED:
            enable_compiled_passes(gen)
            if COMPILED[mode] == "per pass":
                gen.proposers[engine][0].graph = None
        gen.prefill(prompt)
        if mode in COMPILED:
            gen.generate()  # compiles, untimed
            kept.append(gen)
            return fresh()
        return gen

    gen = fresh()
    start = time.perf_counter()
    tokens = len(gen.generate()) - 1
    seconds = time.perf_counter() - start
    passes = sum(n for level, n in gen.stats.passes.items() if level not in (ROUND, LOOKUP_ROUND))  # a whole round is its passes

    gen, rounds = fresh(), 0
    with HostSyncCounter() as waits:
        while len(gen.context) < len(prompt) + args.new_tokens:
            gen.step()
            rounds += 1

    ops_per_token = outside_share = None  # a dispatch mode turns torch.compile off: compiled runs are not counted
    if mode not in COMPILED:
        gen = fresh()
        with OpCounter() as ops, ops_in_passes(ops) as in_passes:
            counted = len(gen.generate()) - 1
        ops_per_token = ops.ops / counted
        outside_share = 1 - in_passes[0] / ops.ops
    return {"mode": mode, "sampled": temperature > 0, "tokens": tokens, "rounds": rounds,
            "waits_per_round": waits.total / rounds, "waits_by_site": dict(waits.by_site),
            "ops_per_token": ops_per_token, "ops_outside_passes": outside_share, "passes_per_token": passes / tokens,
            "host_ms_per_pass": 1e3 * seconds / passes, "host_ms_per_token": 1e3 * seconds / tokens}


def measure_static_cache(hf_model, prompt: list[int], steps: int) -> dict | None:
    """transformers' decode step over its StaticCache: ms and aten ops per step (argmax included)."""
    try:
        from transformers import StaticCache
    except ImportError:
        return None
    cache = StaticCache(config=hf_model.config, max_cache_len=len(prompt) + steps + 1)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model(ids, past_key_values=cache, cache_position=torch.arange(len(prompt)), use_cache=True)
        token = out.logits[:, -1:].argmax(-1)

        def step(position):
            logits = hf_model(token, past_key_values=cache, cache_position=torch.tensor([position]),
                              use_cache=True).logits
            return logits[:, -1:].argmax(-1)

        start = time.perf_counter()
        for i in range(steps):
            token = step(len(prompt) + i)
        seconds = (time.perf_counter() - start) / steps
        with OpCounter() as ops:
            step(len(prompt))
    return {"mode": "hf-static", "sampled": False, "waits_per_round": None, "ops_per_token": ops.ops, "ops_outside_passes": None,
            "passes_per_token": 1.0, "host_ms_per_pass": 1e3 * seconds, "host_ms_per_token": 1e3 * seconds}


def table(rows: list[dict]) -> str:
    """Readable in 80 columns (wider with --compiled-rounds' long names)."""
    w = max(15, *(len(r["mode"]) for r in rows))
    head = f"{'mode':<{w}} {'sampling':<8} {'waits/rnd':>9} {'ops/tok':>8} {'outside':>7} {'pass/tok':>8} " \
           f"{'ms/pass':>8} {'ms/token':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        waits = "-" if r["waits_per_round"] is None else f"{r['waits_per_round']:.2f}"
        ops = "-" if r["ops_per_token"] is None else f"{r['ops_per_token']:,.0f}"
        outside = "-" if r.get("ops_outside_passes") is None else f"{r['ops_outside_passes']:.1%}"
        lines.append(f"{r['mode']:<{w}} {'sampled' if r['sampled'] else 'greedy':<8} {waits:>9} "
                     f"{ops:>8} {outside:>7} {r['passes_per_token']:>8.2f} "
                     f"{r['host_ms_per_pass']:>8.2f} {r['host_ms_per_token']:>9.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(1)  # thin layers: thread wake-ups would be most of what is measured
    began = time.perf_counter()

    def progress(what: str) -> None:
        if time.perf_counter() - began > PROGRESS_AFTER_SECONDS:
            print(f"[{time.perf_counter() - began:5.0f} s] {what}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory() as folder:
        hf_model = tiny_checkpoint(args, Path(folder))
        target = load_model(folder, torch.float32)
    models = Models(target, None)  # the target drafts for itself (StreamingLLM cache), as on a GPU
    prompt = torch.randint(0, args.vocab, (args.context,), generator=torch.Generator().manual_seed(1)).tolist()
    rows = []
    for temperature in (0.0, 0.8):
        for mode in (*MODES, "triforce-device", *(COMPILED if args.compiled_rounds else ())):
            progress(f"{mode} {'sampled' if temperature else 'greedy'}")
            rows.append(measure_mode(models, args, mode, temperature, prompt))
    progress("transformers StaticCache")
    static = measure_static_cache(hf_model, prompt, steps=args.new_tokens)
    if static is not None:
        rows.append(static)
    layers = tuple(int(n) for n in args.kernel_layers.split(","))
    per_layer = kernels.measure(layers, args.gamma1, args.gamma2, args.hidden, not args.no_compile,
                                say=lambda line: print(line, file=sys.stderr, flush=True))
    text = table(rows)
    print(f"{args.layers} layers, hidden {args.hidden}, {args.context}-token prompt, {args.new_tokens} new tokens, "
          f"gamma1 {args.gamma1}, gamma2 {args.gamma2}, budget {args.budget}; CPU, 1 thread")
    print(text)
    print(f"\nkernels per transformer layer, one pass (the difference of {layers[0]} and {layers[1]} layers)")
    print(kernels.table(per_layer))
    print("\n".join(kernels.summary(per_layer)))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"settings": vars(args), "rows": rows, "kernels_per_layer": per_layer}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
