"""Kernels per transformer layer in one decode pass of each level, eager and compiled (issue 22, item 5).

A pass runs the same per-layer work L times plus work that does not depend on L (embedding, the
final norm and head, the caches' bookkeeping, the compiled function's prologue). Counting a pass of
an A-layer and of a B-layer model and dividing the difference by B - A leaves only the per-layer
part, whatever the fixed part holds.

- eager: aten ops dispatched (a TorchDispatchMode), the caches' own path (no --compile).
- compiled: the pass as `enable_compiled_passes` (--compile) runs it. On CPU, the kernels the
  compiled graph calls: inductor's generated C++ kernels plus the extern calls it leaves to aten
  (GEMMs, SDPA), read as the profiler's direct children of the compiled graph's call. Inductor marks
  its C++ kernels for the profiler only when built with `cpp.enable_kernel_profile`, so the graphs
  are compiled with it. The extern aten ops' own children (views, empty tensors inside addmm) are
  not kernels of the graph and are not counted. On CUDA: the CUDA kernels the profiler sees in one
  replay of the captured graph (copies and memsets left out).

    python -m bench.kernels [--layers 3,5 --gamma1 4 --gamma2 6 --eager-only]
"""
from __future__ import annotations

import argparse
import re
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from triforce.model.config import ModelConfig
from triforce.model.transformer import Transformer
from triforce.speculative import GenerationConfig, Generator, Models
from triforce.speculative.graphs import HOT_AFTER, enable_compiled_passes, enable_cuda_graphs
from triforce.speculative.modes import LEVELS

# ops that build a causal mask: attention.py's `_future_mask` (triu of ones, repeated per group) and
# the static view's slot comparison (graphs.py, StaticView.begin)
MASK_OPS = ("triu", "gt")


class OpCounter(TorchDispatchMode):
    """Counts the aten ops run while active, by name (`aten.mm.default` -> 'mm')."""

    def __init__(self):
        super().__init__()
        self.names: Counter = Counter()

    @property
    def ops(self) -> int:
        return sum(self.names.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[func._opname] += 1
        return func(*args, **(kwargs or {}))


def mode_passes(gamma1: int, gamma2: int) -> dict[tuple[str, int], list[str]]:
    """(level, tokens per pass) -> the modes whose decode rounds run that pass."""
    # each mode's full pass verifies what its proposer proposed; triforce's middle verifies drafts
    verify_tokens = {"autoregressive": 1, "speculative": gamma1 + 1, "retrieval": gamma2 + 1, "triforce": gamma2 + 1}
    passes: dict[tuple[str, int], list[str]] = {}
    for mode, levels in LEVELS.items():
        shapes = [("verify", verify_tokens[mode])]
        if "draft" in levels:
            shapes.append(("draft", 1))
        if "middle" in levels:
            shapes.append(("middle", gamma1 + 1 if "draft" in levels else 1))
        for shape in shapes:
            passes.setdefault(shape, []).append(mode)
    return dict(sorted(passes.items(), key=lambda kv: (["draft", "middle", "verify"].index(kv[0][0]), kv[0][1])))


def tiny_target(layers: int, hidden: int = 64, vocab: int = 256, device: str = "cpu") -> Transformer:
    """A random Llama of `layers` thin layers: the module load_model returns, without the disk trip."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
                      num_heads=4, num_kv_heads=2, head_dim=hidden // 4, max_position_embeddings=4096)
    return Transformer(cfg).to(device).eval().requires_grad_(False)


def prefilled(target: Transformer, gamma1: int, gamma2: int, kind: str, context: int = 200) -> Generator:
    """A triforce generator (all three levels) after a prompt long enough to retrieve from, its levels
    then wrapped as `kind` says: "eager" (the caches' own path), "static" (the static view the compiled
    graph is traced from, run eagerly) or "compiled" (--compile). Wrapped after the prompt, so that
    no prefill piece compiles a graph of its own."""
    cfg = GenerationConfig(max_new_tokens=8, budget=64, chunk_size=8, gamma1=gamma1, gamma2=gamma2,
                           draft_window=64, sink_tokens=4)
    gen = Generator(Models(target, None), cfg, "triforce", context + 64)
    vocab = target.cfg.vocab_size
    gen.prefill([3 + (i * 7) % (vocab - 3) for i in range(context)])
    if kind == "static":
        enable_cuda_graphs(gen, eager_static=True)
    elif kind == "compiled":
        torch._dynamo.reset()  # the graphs of the previous model count against the recompile limit
        enable_compiled_passes(gen)
    return gen


def run_pass(gen: Generator, level: str, T: int) -> None:
    """One pass of `level` over T new tokens, then the cache rolled back: passes repeat identically."""
    lv = {"draft": gen.drafter, "middle": gen.middle, "verify": gen.full}[level]
    length = lv.cache.length
    tokens = torch.arange(5, 5 + T, device=gen.device)
    with torch.no_grad():
        lv.model(tokens, lv.cache)
    lv.cache.rollback(length)


def eager_ops(gen: Generator, level: str, T: int) -> Counter:
    """aten ops of one steady-state pass, by name (the first passes build per-shape caches; a width
    runs through its static view from its HOT_AFTER-th call)."""
    for _ in range(HOT_AFTER):
        run_pass(gen, level, T)
    with OpCounter() as ops:
        run_pass(gen, level, T)
    return ops.names


@contextmanager
def compile_settings():
    """Compile with inductor's C++ kernels visible to the profiler (see the module's docstring), and
    room for every pass shape of the three levels (six graphs, and before session 37 the full
    level's views compiled twice, nine, against dynamo's default limit of 8)."""
    import torch._dynamo.config as dynamo
    import torch._inductor.config as inductor

    # set, not config.patch(): the compiled graphs did not see the profile setting under patch()
    before = inductor.cpp.enable_kernel_profile, dynamo.recompile_limit
    inductor.cpp.enable_kernel_profile, dynamo.recompile_limit = True, max(before[1], 32)
    try:
        yield
    finally:
        inductor.cpp.enable_kernel_profile, dynamo.recompile_limit = before


def graph_kernels(gen: Generator, level: str, T: int) -> Counter:
    """Kernels the compiled pass runs, by name with the graph's numbering stripped."""
    from torch.profiler import ProfilerActivity, profile

    cuda = gen.device.type == "cuda"
    for _ in range(HOT_AFTER + 2):  # eager until hot, then compile (on CUDA warm up and capture)
        run_pass(gen, level, T)
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        run_pass(gen, level, T)
        if cuda:
            torch.cuda.synchronize()
    if cuda:
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                 and not e.name.startswith(("Memcpy", "Memset"))]
    else:
        names = [e.name for e in prof.events()
                 if e.cpu_parent is not None and e.cpu_parent.name.startswith("## Call CompiledFxGraph")]
    return Counter(_plain(n) for n in names)


def _plain(name: str) -> str:
    """'graph_2_cpp_fused_mul_silu_split_3' -> 'cpp_fused_mul_silu_split': the same kernel in every graph."""
    return re.sub(r"_\d+$", "", re.sub(r"^graph_\d+_", "", name))


def per_layer(small: Counter, large: Counter, layers: tuple[int, int]) -> float:
    return (sum(large.values()) - sum(small.values())) / (layers[1] - layers[0])


def generated(kernels: Counter) -> Counter:
    """The kernels the compiler wrote (inductor's C++ or Triton), not the library calls it left."""
    return Counter({k: v for k, v in kernels.items() if k.startswith(("cpp_fused", "triton_"))})


def fusions(kernels: Counter) -> dict[str, bool]:
    """Which of a layer's elementwise chains run as one kernel, read from the kernels' names (inductor
    names a fused kernel after the ops it holds)."""
    parts = [set(name.split("_")) for name in generated(kernels)]
    return {"rmsnorm": any({"mean", "rsqrt", "mul"} <= p for p in parts),  # pow, mean, add, rsqrt, mul
            "rope": any({"cat", "mul", "add"} <= p for p in parts),  # rotate-half, x cos + swapped sin
            "silu_mul": any({"silu", "mul"} <= p for p in parts)}  # silu(gate) * up


def mask_kernels(kernels: Counter) -> int:
    """Compiled kernels that build the static view's mask (fill, gt, masked_fill by name) apart from
    attention. On CPU inductor also folds the comparison into each layer's softmax kernel (the
    grouped attention of model/attention.attend_masked), recomputing it where it would otherwise
    read it: no kernel and no memory traffic of its own, so those are not counted."""
    return sum(v for name, v in generated(kernels).items()
               if {"gt", "masked"} & set(name.split("_")) and "softmax" not in name)


def mask_builds(small: Counter, large: Counter, layers: tuple[int, int]) -> dict[str, float]:
    """Mask-building ops per pass (of the larger model) and per layer."""
    return {"per_pass": sum(large[op] for op in MASK_OPS),
            "per_layer": sum(large[op] - small[op] for op in MASK_OPS) / (layers[1] - layers[0])}


class Ticker:
    """Says each step as it starts, and again every `every` seconds while it lasts: compiling one
    pass blocks for tens of seconds with nothing else to say."""

    def __init__(self, say, every: float = 5.0):
        self.say, self.every, self.what = say, every, ""
        self.began = self.since = time.perf_counter()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._tick, daemon=True)

    def __call__(self, what: str) -> None:
        self.what, self.since = what, time.perf_counter()
        self.say(f"[{self.since - self.began:4.0f} s] {what}")

    def _tick(self) -> None:
        while not self.done.wait(self.every):
            now = time.perf_counter()
            self.say(f"[{now - self.began:4.0f} s] {self.what} ({now - self.since:.0f} s so far)")

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()


def measure(layers: tuple[int, int] = (3, 5), gamma1: int = 4, gamma2: int = 6, hidden: int = 64,
            compiled: bool = True, device: str = "cpu", say=lambda line: None) -> list[dict]:
    """Per (level, tokens) pass: eager aten ops per layer and compiled kernels per layer, with the
    fusions and mask builds seen. `say` gets progress lines, at least every 5 seconds."""
    passes = mode_passes(gamma1, gamma2)
    counts: dict[str, list[dict]] = {"eager": [], "static": [], "compiled": []}
    kinds = ["eager", "static"] + (["compiled"] if compiled else [])
    with compile_settings(), Ticker(say) as progress:
        for n in layers:
            target = tiny_target(n, hidden, device=device)
            for kind in kinds:
                gen = prefilled(target, gamma1, gamma2, kind)
                count = graph_kernels if kind == "compiled" else eager_ops
                row = {}
                for level, T in passes:
                    progress(f"{'compiling and counting' if kind == 'compiled' else 'counting'} {kind} "
                             f"{level} T={T}, {n} layers")
                    row[(level, T)] = count(gen, level, T)
                counts[kind].append(row)
    return [_row(level, T, modes, counts, layers) for (level, T), modes in passes.items()]


def _row(level: str, T: int, modes: list[str], counts: dict, layers: tuple[int, int]) -> dict:
    key = (level, T)
    eager_small, eager_large = (c[key] for c in counts["eager"])
    static_small, static_large = (c[key] for c in counts["static"])
    row = {"level": level, "tokens": T, "modes": modes, "layers": list(layers),
           "eager_ops_per_layer": per_layer(eager_small, eager_large, layers),
           "eager_mask_builds": mask_builds(eager_small, eager_large, layers),
           "static_mask_builds": mask_builds(static_small, static_large, layers)}
    if counts["compiled"]:
        small, large = (c[key] for c in counts["compiled"])
        row.update(compiled_kernels_per_layer=per_layer(small, large, layers),
                   compiled_generated_per_layer=per_layer(generated(small), generated(large), layers),
                   compiled_kernels=dict(sorted(large.items())), fused=fusions(large),
                   compiled_mask_kernels=mask_kernels(large))
    return row


def table(rows: list[dict]) -> str:
    """Readable in 80 columns."""
    head = f"{'level':<7} {'tokens':>6} {'eager ops':>9} {'compiled':>8}  modes"
    lines = [head, "-" * 60]
    for r in rows:
        compiled = r.get("compiled_kernels_per_layer")
        lines.append(f"{r['level']:<7} {r['tokens']:>6} {r['eager_ops_per_layer']:>9.0f} "
                     f"{'-' if compiled is None else f'{compiled:.0f}':>8}  {', '.join(r['modes'])}")
    return "\n".join(lines)


def summary(rows: list[dict]) -> list[str]:
    """The fusions seen and where the verification passes' masks are built, in words."""
    lines = []
    fused = [r["fused"] for r in rows if "fused" in r]
    if fused:
        seen = [name for name in fused[0] if all(f[name] for f in fused)]
        lines.append(f"fused in every compiled pass: {', '.join(seen) or 'none'}")
        r = rows[-1]
        lines.append(f"a compiled layer: {r['compiled_generated_per_layer']:g} generated kernels, "
                     f"{r['compiled_kernels_per_layer'] - r['compiled_generated_per_layer']:g} library calls")
    verify = [r for r in rows if r["tokens"] > 1]
    for kind, label in (("eager", "eager (attention.py caches it)"),
                         ("static", "the compiled graph's source")):
        per_layer_ = max(r[f"{kind}_mask_builds"]["per_layer"] for r in verify)
        per_pass = max(r[f"{kind}_mask_builds"]["per_pass"] for r in verify)
        lines.append(f"mask ops, T>1 pass, {label}: {per_pass:g} per pass, {per_layer_:g} per layer")
    if fused:
        lines.append(f"compiled kernels holding the mask ops, T>1 pass: "
                     f"{max(r['compiled_mask_kernels'] for r in verify)}")
    return lines


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="3,5", help="the two layer counts, A,B (B > A)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--gamma1", type=int, default=4)
    ap.add_argument("--gamma2", type=int, default=6)
    ap.add_argument("--eager-only", action="store_true", help="skip torch.compile")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    layers = tuple(int(x) for x in args.layers.split(","))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = measure(layers, args.gamma1, args.gamma2, args.hidden, not args.eager_only, device,
                   say=lambda line: print(line, file=sys.stderr, flush=True))
    print(f"kernels per layer, one pass ({layers[0]} -> {layers[1]} layers, hidden {args.hidden}, {device})")
    print(table(rows))
    print("\n".join(summary(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
