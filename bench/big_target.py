"""The hierarchy where the method is meant to pay: a big target, a tiny drafter, the KV in host memory.

    python -m bench.big_target [--context 32768 --new-tokens 16 --gamma2 16 --out results/x.json]
    python -m bench.big_target --rehearse        # tiny shapes on this CPU: proves the code runs

SmolLM2-135M drafting for itself cannot show the method's regime: its drafter pass costs what its
middle pass costs, and its full pass at 32K moves only 0.7 GB (docs/results/2026-11-26-gpu-h200-*).
No 7B checkpoint can travel to a lent GPU, but a pass's cost does not depend on the weights' values.
So this builds Llama-2-7B's shape as the target and JackFram/llama-68m's as the drafter (the
published TriForce pair), with random weights on the device, prefills random token ids through the
engine's own offloaded cache (every layer's KV in pinned host memory, as on a 24 GB card, where the
target's 13.5 GB of weights leave no room for 32K tokens of its KV), and runs each mode with the
engine as generate.py builds it (CUDA graphs on a GPU).

MEASURED, as in any bench: plain decoding's speed, its bytes a pass against the pinned link, and each
level's pass cost by width (drafter, middle, whole drafter->middle rounds, full verification), plus
each mode's round overhead. Random weights accept nothing meaningful, so their tokens per second are
shown but are not the result.

PROJECTED: each mode's milliseconds per token at given acceptance rates, priced from those measured
costs by the adaptive chooser's own arithmetic (speculative/adaptive.py, the prediction that picks the
mode of every full pass in a real run), at its best gamma up to each cap. The acceptance rates are
inputs: the published setting reports the middle level above 0.9 (docs/design.md).
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from bench.costmodel import LLAMA2_7B, LLAMA_68M, ModelShape
from bench.linkbench import random_model, raw_h2d
from bench.measure import timed_run
from triforce.cli.common import run_cli
from triforce.model.config import ModelConfig
from triforce.model.errors import UserError
from triforce.speculative import GenerationConfig, Generator, Models
from triforce.speculative.adaptive import Chooser, Plan
from triforce.speculative.pricing import Acceptance, tokens_per_verification
from triforce.speculative.stats import LEVEL_ORDER

MODES = ("autoregressive", "speculative", "retrieval", "triforce")
# rehearsal shapes: seconds on a CPU, the same code
TINY_TARGET = ModelShape("tiny target", 2, 128, 4, 2, 32, 512, 256)
TINY_DRAFTER = ModelShape("tiny drafter", 1, 64, 2, 2, 32, 512, 128)
MIDDLE_RATES, DRAFT_RATES = (0.8, 0.9, 0.95), (0.6, 0.8)


def config_of(shape: ModelShape, positions: int) -> ModelConfig:
    return ModelConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                       num_layers=shape.layers, num_heads=shape.heads, num_kv_heads=shape.kv_heads,
                       head_dim=shape.head_dim, max_position_embeddings=positions)


class FixedRates:
    """Acceptance as the chooser reads it, at given rates per edge."""

    def __init__(self, rates: dict[str, float]):
        self.rates = rates

    def known(self, edge: str) -> bool:
        return edge in self.rates

    def rate(self, edge: str) -> float:
        return self.rates[edge]

    def expected(self, edge: str, gamma: float) -> float:
        return tokens_per_verification(self.rates[edge], gamma)


def rates_at(middle: float, draft: float) -> dict[str, float]:
    """Every edge's rate: the middle level's to the full one, and the drafter's (to either)."""
    return {"middle->verify": middle, "draft->middle": draft, "draft->verify": draft}


@contextmanager
def pricing(meter: Chooser, overheads: dict[str, float], acceptance: "Acceptance | FixedRates"):
    """The meter's measured costs with these overheads and this acceptance, for as long as it is held."""
    saved = meter.acceptance, meter.overhead
    meter.acceptance, meter.overhead = acceptance, dict(overheads)
    try:
        yield meter
    finally:
        meter.acceptance, meter.overhead = saved


def project(meter: Chooser, overheads: dict[str, float], middle: float, draft: float, cap: int) -> dict:
    """{mode: (ms per token, gamma)} at its best gamma <= cap, priced by the chooser's arithmetic from
    the costs `meter` measured, each mode's round overhead, and acceptance at the given rates."""
    out = {}
    with pricing(meter, overheads, FixedRates(rates_at(middle, draft))):
        for mode in MODES:
            plans = [p for p in meter.plans if p.mode == mode and p.gamma <= cap]
            if plans and meter.known(mode):
                best = min(plans, key=meter.predict)
                out[mode] = (1e3 * meter.predict(best), best.gamma)
    return out


def check(meter: Chooser, overheads: dict[str, float], seen: dict[str, Acceptance], gammas: dict[str, int]) -> dict:
    """{mode: ms per token} that the same arithmetic predicts for each timed run: its own plan at the
    acceptance it saw (`seen`: each mode's WholeRun). Beside the measured figure it tests the
    projection where both are known."""
    out = {}
    for mode, acceptance in seen.items():
        with pricing(meter, overheads, acceptance):
            if meter.known(mode):
                out[mode] = 1e3 * meter.predict(Plan(mode, gammas[mode]))
    return out


class WholeRun(Acceptance):
    """A run's verifications, all of them (the chooser keeps the last 16 per edge)."""

    WINDOW = 1 << 20


def seen_rates(acceptance: Acceptance) -> dict[str, float]:
    """Each edge's rate per proposal as a run saw it: successes over successes and failures, without
    the chooser's prior (one run's few verifications are all there is to go on)."""
    out = {}
    for edge, history in acceptance.recent.items():
        successes, failures = sum(s for s, _ in history), sum(f for _, f in history)
        if successes + failures:
            out[edge] = successes / (successes + failures)
    return out


def with_graphs(gen: Generator, cuda: bool) -> Generator:
    """The levels' passes as generate.py runs them on a GPU: captured graphs; rehearsed on a CPU, the
    same static views run eagerly."""
    from triforce.speculative.graphs import enable_cuda_graphs

    enable_cuda_graphs(gen, eager_static=not cuda)
    return gen


def prefill(models: Models, cfg: GenerationConfig, context: int, max_len: int, offload: bool, cuda: bool):
    """One prefill of random ids through the engine's full cache (offloaded: every layer in host memory)."""
    factory = None
    if offload:
        from triforce.offload import full_cache_factory

        factory = full_cache_factory(device=models.target.embed.weight.device,
                                     prefill_chunk=cfg.prefill_piece(models.target.embed.weight.device), onchip_layers=0)
    seed = with_graphs(Generator(models, cfg, "triforce", max_len, full_cache_factory=factory), cuda)
    ids = torch.randint(3, models.target.cfg.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
    seed.prefill(ids.tolist())
    return seed.snapshot()


def run_mode(models: Models, cfg: GenerationConfig, mode: str, prefilled, max_len: int, meter: Chooser,
             cuda: bool) -> tuple[dict, Acceptance]:
    """A warm-up decode (graphs captured), then one timed with every pass's cost handed to `meter`:
    its figures, and every verification it saw."""
    gen = with_graphs(Generator(models, cfg, mode, max_len, prefilled=prefilled), cuda)
    timed_run(gen, prefilled)
    for level in gen.seq.levels:
        level.meter = meter
    meter.acceptance = seen = WholeRun()  # this run's own verifications
    moved = gen.full.cache.bytes_moved
    tokens, seconds, stats = timed_run(gen, prefilled)
    moved = gen.full.cache.bytes_moved - moved if moved is not None else None
    passes = sum(stats.seconds.values())
    per_level = {name: 1e3 * stats.seconds[name] / timed for name in LEVEL_ORDER
                 if (timed := stats.passes.get(name, 0) - stats.untimed.get(name, 0))}
    return {"mode": mode, "tokens": len(tokens), "seconds": seconds, "ms_per_token": 1e3 * seconds / len(tokens),
            "full_passes": stats.full_passes, "ms_per_pass": per_level,
            "acceptance (random weights)": {k: stats.acceptance(k) for k in sorted(stats.proposed)},
            "rates": seen_rates(meter.acceptance),
            "overhead_ms_per_round": 1e3 * max(stats.decode_seconds - passes, 0.0) / max(stats.full_passes, 1),
            "full_pass_bytes": moved / max(stats.full_passes, 1) if moved is not None else None}, seen


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.big_target", description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--new-tokens", type=int, default=16, help="tokens each timed run decodes (about as many full passes: random weights accept little)")
    p.add_argument("--budget", type=int, default=8192, help="retrieval budget (the GPU default at 32K)")
    p.add_argument("--chunk-size", type=int, default=32)
    p.add_argument("--gamma1", type=int, default=4)
    p.add_argument("--gamma2", type=int, default=16, help="the longest run measured (TriForce's offloaded setting)")
    p.add_argument("--caps", default="6,16", help="projected at each mode's best gamma up to each of these "
                   "(6: this project's GPU default; 16: TriForce's offloaded setting)")
    p.add_argument("--offload", default="host", choices=["host", "none"])
    p.add_argument("--rehearse", action="store_true", help="tiny shapes on this machine's CPU (figures mean nothing)")
    p.add_argument("--out", help="write the figures as JSON here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.rehearse
    if not cuda and not args.rehearse:
        raise UserError("bench.big_target measures a GPU and none is visible here; --rehearse runs the same code "
                        "on this CPU at tiny shapes (its figures mean nothing)")
    device, caps = torch.device("cuda" if cuda else "cpu"), sorted({int(c) for c in args.caps.split(",")})
    target_shape, drafter_shape = (LLAMA2_7B, LLAMA_68M) if cuda else (TINY_TARGET, TINY_DRAFTER)
    context, budget = (args.context, args.budget) if cuda else (1024, 256)
    max_len = context + args.new_tokens + 4 * args.gamma2
    dtype = torch.bfloat16 if cuda else torch.float32
    started = time.perf_counter()
    torch.manual_seed(0)  # the same random weights every run: what they happen to accept stays put
    models = Models(random_model(config_of(target_shape, max_len), device, dtype),
                    random_model(config_of(drafter_shape, max_len), device, dtype))
    # rehearsed, triforce's rounds run on the device as a GPU runs them (one graph a round, timed whole)
    cfg = GenerationConfig(max_new_tokens=args.new_tokens, budget=budget, chunk_size=args.chunk_size,
                           gamma1=args.gamma1, gamma2=args.gamma2, device_rounds=True)
    print(f"[big_target] {target_shape.name} + {drafter_shape.name} built; prefilling {context} tokens",
          file=sys.stderr, flush=True)
    prefilled = prefill(models, cfg, context, max_len, args.offload == "host", cuda)
    print(f"[big_target] {target_shape.name} + {drafter_shape.name}, {context} tokens prefilled in "
          f"{prefilled.prefill_seconds:.1f} s", file=sys.stderr, flush=True)
    meter = Chooser(MODES, args.gamma1, args.gamma2, device_rounds=cfg.rounds_on_device(device))
    runs, seen = {}, {}
    for mode in MODES:
        # each step named before it starts and each mode's figures written as they come: the first
        # H200 run died of a CUDA assert 90 s in, and nothing said in which mode
        print(f"[big_target] {mode}: a warm-up, then a timed run", file=sys.stderr, flush=True)
        runs[mode], seen[mode] = run_mode(models, cfg, mode, prefilled, max_len, meter, cuda)
        if args.out:
            write_json(args.out, {"partial": "modes measured so far", "runs": runs})
        gc.collect()  # the last mode's caches and graphs (4 GiB of retrieval cache at 7B) go before the next
        print(f"[big_target] {mode}: {runs[mode]['ms_per_token']:.1f} ms/token (random weights)", file=sys.stderr, flush=True)
    link = raw_h2d(2**30, device) if cuda else None
    plain = runs["autoregressive"]
    floor_ms = 1e3 * plain["full_pass_bytes"] / (link * 1e9) if link and plain["full_pass_bytes"] else None
    overheads = {m: r["overhead_ms_per_round"] / 1e3 for m, r in runs.items()}
    projected = [{"gamma_cap": cap, "middle->verify": a, "drafter": d,
                  **{m: {"ms_per_token": ms, "gamma": g, "x_plain": plain["ms_per_token"] / ms}
                     for m, (ms, g) in project(meter, overheads, a, d, cap).items()}}
                 for cap in caps for a in MIDDLE_RATES for d in DRAFT_RATES]
    gammas = {"autoregressive": 0, "speculative": cfg.gamma1, "retrieval": cfg.gamma2, "triforce": cfg.gamma2}
    for mode, ms in check(meter, overheads, seen, gammas).items():
        runs[mode]["predicted_ms_per_token"] = ms
    figures = {"device": torch.cuda.get_device_name(device) if cuda else "cpu (rehearsal: the figures mean nothing)",
               "target": target_shape.name, "drafter": drafter_shape.name, "context": context,
               "offload": args.offload, "config": {k: getattr(cfg, k) for k in ("budget", "chunk_size", "gamma1", "gamma2")},
               "measured": {"runs": runs, "pinned_GBps": link, "plain_link_floor_ms": floor_ms,
                            "pass_costs_ms": {lv: {n: 1e3 * s for n, s in sorted(w.items())}
                                              for lv, w in meter.costs.mean.items()}},
               "projected (acceptance given, costs measured)": projected,
               "seconds": time.perf_counter() - started}
    print_tables(figures)
    if args.out:
        write_json(args.out, figures)
    return 0


def write_json(path: str, figures: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(figures, indent=1))


def print_tables(figures: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console, measured = Console(), figures["measured"]
    title = f"{figures['target']} + {figures['drafter']}, {figures['context']} tokens, KV {figures['offload']}: MEASURED"
    table = Table("mode", "ms/token (random weights)", "predicted at its own acceptance", "full passes",
                  "ms per pass by level", "overhead ms/round", title=title)
    for mode, run in measured["runs"].items():
        levels = ", ".join(f"{k} {v:.2f}" for k, v in run["ms_per_pass"].items())
        predicted = run.get("predicted_ms_per_token")
        table.add_row(mode, f"{run['ms_per_token']:.2f}", f"{predicted:.2f}" if predicted else "-", str(run["full_passes"]),
                      levels, f"{run['overhead_ms_per_round']:.2f}")
    console.print(table)
    if measured["plain_link_floor_ms"]:
        console.print(f"plain decoding {measured['runs']['autoregressive']['ms_per_token']:.1f} ms/token against a link "
                      f"floor of {measured['plain_link_floor_ms']:.1f} ms ({measured['pinned_GBps']:.1f} GB/s pinned)")
    table = Table("gamma cap", "middle->verify", "drafter", *MODES[1:],
                  title="PROJECTED from the measured costs at these acceptance rates: ms/token (x plain decoding), gamma")
    for row in figures["projected (acceptance given, costs measured)"]:
        cells = [f"{row[m]['ms_per_token']:.1f} ({row[m]['x_plain']:.2f}x) g{row[m]['gamma']}" if m in row else "-"
                 for m in MODES[1:]]
        table.add_row(str(row["gamma_cap"]), f"{row['middle->verify']:.2f}", f"{row['drafter']:.2f}", *cells)
    console.print(table)


if __name__ == "__main__":
    sys.exit(run_cli(main))
