"""Random engine settings under tensor parallelism: the cases of tests/speculative/settings_fuzz.py
(models with an even number of KV heads), run by two gloo processes, each holding its shard of the
target, with the ranks' logits compared after every forward (SPEC_TP_CHECK's check).

A case holds when both ranks make the same tokens as one process: autoregressive's where greedy, the
one process's draws where sampled with a fixed plan (an adaptive plan follows rank 0's timings, so
there only the ranks must agree), and both refuse exactly what one process refuses, with its words.
`test_tp_fuzz.py` runs a fixed set of cases; for a long run:

    python -m tests.parallel.tp_fuzz --cases 300 --seed 3
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import traceback
from collections import Counter
from pathlib import Path

import torch
import torch.multiprocessing as mp

from triforce.model.errors import UserError
from triforce.model.tensor_parallel import apply_tp
from triforce.parallel import setup_tensor_parallel

from ..speculative.settings_fuzz import Case, TinyModels, autoregressive, draw, judge, run

WORLD = 2
TIMEOUT_S = 30.0  # a rank that fails mid-case leaves the other waiting in a collective this long at most


def tp_case(seed: int) -> Case:
    """settings_fuzz's case, with 4 query heads over 2 KV heads where it drew one KV head (not divisible)."""
    case = draw(seed)
    if case.model[3] % WORLD:
        case.model = (*case.model[:2], 4, 2, *case.model[4:])
    return case


def outcome(case: Case, models_of: TinyModels, agree=None) -> list[int] | str:
    """The case's tokens, or 'refused: <the UserError>'."""
    try:
        return run(case, models_of, agree)
    except UserError as e:
        return f"refused: {e}"


class Unsummed:
    """A planted fault: the ranks skip the sum of their row-parallel outputs (each keeps its part),
    and nothing compares their logits: the tokens alone must show it."""

    def __init__(self, tp):
        self.rank, self.world_size = tp.rank, tp.world_size

    def attach(self, model):
        return apply_tp(model, lambda x: x)


def _worker(rank: int, seeds: list[int], folders: dict, port: int, out: Path, fault: bool = False) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tp = setup_tensor_parallel(WORLD, "cpu", timeout=TIMEOUT_S, check=True)
    models_of, results = TinyModels(Unsummed(tp) if fault else tp, folders), {}
    try:
        for seed in seeds:
            try:
                results[seed] = outcome(tp_case(seed), models_of, tp.follow_main)
            except Exception:  # noqa: BLE001 - the failure is what the fuzz reports
                results[seed] = "error: " + traceback.format_exc()
            if tp.failed or str(results[seed]).startswith("error: "):
                break  # the ranks may be out of step: later cases would only time out
            if rank == 0 and len(results) % 50 == 0:
                print(f"{len(results)} of {len(seeds)} cases run on {WORLD} ranks", flush=True)
    finally:
        torch.save(results, out / f"rank{rank}.pt")
        tp.close()


def run_ranks(seeds: list[int], models_of: TinyModels, fault: bool = False) -> list[dict]:
    """Each rank's {seed: outcome} for the cases, from one two-process group (their checkpoints
    saved by models_of); `fault` plants Unsummed."""
    from .test_tp import free_port

    folders = {tp_case(seed).model: models_of.folder(tp_case(seed).model) for seed in seeds}
    with tempfile.TemporaryDirectory(prefix="tp-fuzz-") as folder:
        try:
            mp.spawn(_worker, args=(seeds, folders, free_port(), Path(folder), fault), nprocs=WORLD, join=True)
        except mp.ProcessExitedException:  # a rank whose peer stopped exits 2 after saving what it had
            pass
        return [torch.load(Path(folder) / f"rank{r}.pt", weights_only=False) if (Path(folder) / f"rank{r}.pt").exists()
                else {} for r in range(WORLD)]


def compare(seed: int, ranks: list[dict], models_of: TinyModels) -> str | None:
    """None where both ranks' outcome of the case holds against one process, else what went wrong."""
    case = tp_case(seed)
    got = [r.get(seed, "error: not run (an earlier case failed)") for r in ranks]
    for r, o in enumerate(got):
        if isinstance(o, str) and o.startswith("error: "):
            return f"rank {r}: {o}"
    if got[0] != got[1]:
        return f"the ranks differ: {got[0]} vs {got[1]}"
    one = outcome(case, models_of)
    if isinstance(got[0], str) or isinstance(one, str):
        return None if got[0] == one else f"two ranks: {got[0]}; one process: {one}"
    if case.sampled and not case.config.get("adaptive") and got[0] != one:
        return f"sampled tokens differ from one process's: {got[0]} vs {one}"
    return judge(case, got[0], lambda: autoregressive(case, models_of))


def kind(case: Case, outcome) -> str:
    if isinstance(outcome, str):
        return "refused" if outcome.startswith("refused: ") else "not run"
    if not case.sampled:
        return "greedy"
    return "sampled adaptive" if case.config.get("adaptive") else "sampled"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0, help="cases seed*100000 .. seed*100000 + cases - 1")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    seeds = [args.seed * 100000 + i for i in range(args.cases)]
    models_of, failed, kinds = TinyModels(), 0, Counter()
    ranks = run_ranks(seeds, models_of)
    for seed in seeds:
        problem = compare(seed, ranks, models_of)
        if problem:
            failed += 1
            print(f"FAIL {tp_case(seed)}\n{problem}", flush=True)
        kinds[kind(tp_case(seed), ranks[0].get(seed))] += 1
    print(f"{args.cases} cases ({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))}), {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
