"""Random engine settings against autoregressive decoding: a case draws a tiny model (Llama or Qwen2,
1-3 layers, grouped or not, tied or not), a prompt with repeats, a mode, a drafter (the target itself,
a noisy copy, lookups), adaptive or fixed, host or device rounds (or each round one graph, run
eagerly), a resident or offloaded full cache, and every GenerationConfig size within its rules
(budgets, chunks, gammas, windows, sinks, prefill pieces, rebuild thresholds, stops); some cases
converse (an answer cut back, a turn added, another answer). Greedy cases must make autoregressive's
tokens, and sampled ones must run to their budget; input the engine refuses must be a UserError.

Session 57's run of 1,400 cases found four failures that no test had: a rebuild after a pass wider
than the prefill piece, a draft window shorter than one round's drafts, lookups over a sequence
shorter than the longest match, and (a harness error) a context that holds a round's tokens past
what generate() returned. `test_settings_fuzz.py` runs a fixed set of cases; for a long run:

    python -m tests.speculative.settings_fuzz --cases 500 --seed 7
    python -m tests.speculative.settings_fuzz --cases 40 --seed 7 --compiled   # passes torch.compile'd

tests/parallel/tp_fuzz.py runs the same cases on two tensor-parallel ranks.
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import traceback
import zlib
from dataclasses import dataclass, field

import torch

from triforce.model.errors import UserError
from triforce.model.loader import load_model
from triforce.offload import full_cache_factory
from triforce.speculative import GenerationConfig, Generator, Models
from triforce.speculative.graphs import enable_compiled_passes, enable_cuda_graphs
from triforce.speculative.lookup import LookupDrafter

from ..conftest import save_tiny

VOCABS = (24, 48, 96)
HEADS = ((4, 2), (4, 4), (2, 1))  # (query heads, KV heads)


@dataclass
class Case:
    seed: int
    model: tuple  # (vocab, layers, heads, kv heads, tied, model type)
    prompt: list[int]
    mode: str
    drafter: str  # "self", "noisy" or "lookup"
    config: dict  # GenerationConfig's fields
    whole_rounds: bool = False  # each drafter->middle round one graph (rounds.RoundGraph), run eagerly
    offload: dict | None = None  # full_cache_factory's options, or None for a resident cache
    turns: list = field(default_factory=list)  # (tokens to cut, a new turn's tokens, its budget)
    stops: frozenset = frozenset()
    compiled: bool = False  # every level's passes torch.compile'd (--compile); set by --compiled, never drawn
    # how the case's generator stands after its prefill: None (as prefill left it), "snapshot" (a new
    # generator built from the prefilled prompt, as a second run over a kept prompt) or "reset" (a
    # throwaway answer, then resume() to the prompt, as chat's /reset)
    resumed: str | None = None

    @property
    def sampled(self) -> bool:
        return self.config.get("temperature", 0) > 0


def draw(seed: int) -> Case:
    r = random.Random(seed)
    vocab = r.choice(VOCABS)
    model = (vocab, r.randint(1, 3), *r.choice(HEADS), r.random() < 0.5, r.choice(["llama", "qwen2"]))
    mode = r.choice(["speculative", "retrieval", "triforce", "triforce"])
    chunk = r.choice([1, 2, 4, 8, 16])
    config = dict(max_new_tokens=r.randint(1, 80), budget=chunk * r.randint(4, 12), chunk_size=chunk,
                  gamma1=r.randint(1, 5), gamma2=r.randint(1, 10), lookup_gamma=r.randint(1, 10),
                  # the edges more often than a uniform draw would: windows and prefill pieces narrower
                  # than a round, rebuilds after most rounds
                  sink_tokens=r.randint(0, 6), draft_window=r.choice([r.randint(1, 8), r.randint(1, 40)]),
                  prefill_chunk=r.choice([None, r.randint(1, 12), r.randint(1, 50)]),
                  rebuild_threshold=r.choice([0.0, r.random(), 1.0]),
                  stop_on_eos=r.random() < 0.3, adaptive=r.random() < 0.3, lookup=r.random() < 0.7,
                  device_rounds=mode == "triforce" and r.random() < 0.5, queue_ahead=r.choice([None, True, False]))
    if r.random() < 0.25:
        config.update(temperature=r.choice([0.5, 1.0, 1.5]), top_p=r.choice([1.0, 0.9, 0.5]),
                      top_k=r.choice([0, 0, 5]), seed=r.randrange(100), verification=r.choice(["block", "token"]))
    case = Case(seed, model, _prompt(r, vocab), mode, r.choice(["self", "noisy", "lookup"]), config)
    case.whole_rounds = config["device_rounds"] and r.random() < 0.5
    if r.random() < 0.3:
        case.offload = dict(onchip_layers=r.randint(0, model[1]), chunk_tokens=r.randint(1, 9),
                            prefetch_next=r.random() < 0.5)
    if r.random() < 0.4:
        case.turns = [(r.randint(1, 25), [r.randrange(vocab) for _ in range(r.randint(1, 30))], r.randint(1, 25))]
    if r.random() < 0.3:
        case.stops = frozenset(r.sample(range(vocab), 2))
    # drawn apart, so that the draws above (the suite's fixed cases, the seeds of earlier runs) stay
    case.resumed = random.Random(f"resumed-{seed}").choice([None, None, "snapshot", "reset"])
    return case


def _prompt(r: random.Random, vocab: int) -> list[int]:
    """1-200 tokens (under 9 a third of the time), pieces of an earlier stretch repeated among fresh ones (lookups find matches)."""
    n = r.choice([r.randint(1, 8), r.randint(1, 200), r.randint(1, 200)])
    base = [r.randrange(vocab) for _ in range(max(1, n // r.choice([1, 2, 4])))]
    out: list[int] = []
    while len(out) < n:
        out += base[r.randrange(len(base)):][:r.randint(1, 30)] if r.random() < 0.5 else [r.randrange(vocab)]
    return out[:n]


class TinyModels:
    """Each model spec's target and noisy drafter (float64), built once per process. Under tensor
    parallelism (`tp`, a TensorParallel of world size > 1) the target is this rank's shard and the
    drafter is replicated; its checkpoints come from the process that started the ranks (`folders`:
    transformers saves no config.json from a rank other than 0 of a process group)."""

    def __init__(self, tp=None, folders: dict | None = None):
        self.built: dict[tuple, tuple] = {}
        self.tp, self.folders = tp, {} if folders is None else folders

    def folder(self, spec: tuple) -> str:
        """The spec's checkpoint, saved on first use."""
        if spec not in self.folders:
            vocab, layers, heads, kv_heads, tie, kind = spec
            self.folders[spec] = tempfile.mkdtemp(prefix="settings-fuzz-")
            save_tiny(self.folders[spec], seed=zlib.crc32(repr(spec).encode()) % 1000, vocab=vocab, layers=layers,
                      heads=heads, kv_heads=kv_heads, tie=tie, model_type=kind, hidden=8 * heads)
        return self.folders[spec]

    def __call__(self, spec: tuple):
        if spec not in self.built:
            folder = self.folder(spec)
            if self.tp is None:
                target = load_model(folder, torch.float64)
            else:
                target = self.tp.attach(load_model(folder, torch.float64, rank=self.tp.rank, world_size=self.tp.world_size))
            noisy = load_model(folder, torch.float64)
            with torch.no_grad():
                for p in noisy.parameters():
                    p.add_(0.03 * torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(5)))
            self.built[spec] = target, noisy
        return self.built[spec]


def play(case: Case, models: Models, mode: str, config: GenerationConfig, agree=None) -> list[int]:
    """The case's conversation on one generator: its tokens, each answer after a -1. `agree`: the
    generator's (tensor parallelism: every rank runs rank 0's adaptive plan)."""
    extra = sum(len(tokens) + budget for _, tokens, budget in case.turns)
    max_len = len(case.prompt) + config.max_new_tokens + extra + (config.max_new_tokens + 2 if case.turns else 0)
    factory = full_cache_factory("cpu", config.prefill_chunk or 64, **case.offload) if case.offload else None

    def start(prefilled=None) -> Generator:
        gen = Generator(models, config, mode, max_len=max_len, full_cache_factory=factory, prefilled=prefilled,
                        agree=agree)
        if case.compiled and mode == case.mode:
            enable_compiled_passes(gen)
        elif case.whole_rounds and mode == case.mode:
            enable_cuda_graphs(gen, eager_static=True)
        return gen

    gen = start()
    gen.prefill(case.prompt)
    if case.resumed and mode == case.mode:
        snapshot = gen.snapshot()
        if case.resumed == "snapshot":
            gen = start(snapshot)
        else:
            gen.generate(stop_ids=case.stops)
            gen.resume(snapshot.prompt, snapshot.queries, snapshot.first)
    before = len(gen.context)
    answer = gen.generate(stop_ids=case.stops)
    out = list(answer)
    for cut, tokens, budget in case.turns:
        shown = before - 1 + len(answer)  # the context may also hold the rest of the last round
        gen.truncate(max(len(case.prompt) + 1, shown - cut))
        gen.extend(tokens)
        before = len(gen.context)
        answer = gen.generate(budget, stop_ids=case.stops)
        out += [-1, *answer]
    return out


def run(case: Case, models_of: TinyModels, agree=None) -> list[int]:
    """The case's tokens (answers after a -1); a UserError where the engine refuses its settings."""
    target, noisy = models_of(case.model)
    drafter = {"self": None, "noisy": noisy, "lookup": LookupDrafter()}[case.drafter]
    return play(case, Models(target, drafter), case.mode, GenerationConfig(**case.config), agree)


def autoregressive(case: Case, models_of: TinyModels) -> list[int]:
    """What greedy decoding of the target makes of the case's conversation."""
    config = GenerationConfig(**{**case.config, "adaptive": False})
    return play(case, Models(models_of(case.model)[0], None), "autoregressive", config)


def judge(case: Case, out: list[int], reference) -> str | None:
    """None where a run's tokens hold (reference() gives autoregressive's), else what went wrong."""
    if any(not (0 <= t < case.model[0] or t == -1) for t in out):
        return f"a token out of the vocabulary: {out}"
    config = GenerationConfig(**case.config)
    if case.sampled:
        if not case.turns and not case.stops and not config.stop_on_eos and len(out) != config.max_new_tokens:
            return f"{len(out)} sampled tokens, {config.max_new_tokens} asked"
        return None
    reference = reference()
    if out != reference:
        at = next((i for i, (a, b) in enumerate(zip(out, reference)) if a != b), min(len(out), len(reference)))
        return f"greedy tokens differ from autoregressive's at {at}: {out} vs {reference}"
    return None


def check(case: Case, models_of: TinyModels) -> str | None:
    """None where the case holds (or the engine refused it with a UserError), else what went wrong."""
    try:
        out = run(case, models_of)
    except UserError:
        return None
    except Exception:  # noqa: BLE001 - the failure is what the fuzz reports
        return traceback.format_exc()
    return judge(case, out, lambda: autoregressive(case, models_of))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0, help="cases seed*100000 .. seed*100000 + cases - 1")
    parser.add_argument("--compiled", action="store_true",
                        help="every case's passes torch.compile'd (--compile): seconds to minutes a case")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    models_of, failed = TinyModels(), 0
    for i in range(args.cases):
        case = draw(args.seed * 100000 + i)
        case.compiled = args.compiled
        problem = check(case, models_of)
        if problem:
            failed += 1
            print(f"FAIL {case}\n{problem}", flush=True)
        if (i + 1) % (5 if args.compiled else 50) == 0:
            print(f"{i + 1} cases, {failed} failed", flush=True)
    print(f"{args.cases} cases, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
