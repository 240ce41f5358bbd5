#!/usr/bin/env python
"""Side-by-side decoding benchmark: every engine on the same model, prompt, context, dtype, threads.

Systems: our four engines (autoregressive, speculative, retrieval, triforce) and the ones users
would pick instead: Hugging Face transformers `generate()` (greedy, its default DynamicCache; `hf-static`:
its static cache, the decode step compiled on CUDA as transformers does for it, compiled before the
clock; `hf-offloaded`: its offloaded cache, CUDA only, else n/a with the reason) and transformers
assisted generation (`assistant_model=` the same drafter, HF's default settings: 20 assistant tokens,
confidence threshold 0.4). With `--draft self` there is no separate drafter to hand to transformers,
so that row says so instead of a number.

Our engines run exactly as generate.py runs them for the same flags: each mode with its own
defaults (budget, gammas: triforce.cli.common.generation_config of that mode), each built by
Session.generator (offloaded full cache, --cuda-graphs); one generator per system serves all its
repetitions, so the warm-up captures what later runs replay.

The prompt is prefilled once per context length and shared by our engines (decoding only writes
after it); transformers gets its own prefill of the same token ids, copied per run (and so does its
assistant), so every system is timed on decoding alone: the first token comes from the prefill,
the clock covers the other N-1. After a warm-up, repetitions alternate between systems so drift hits
all alike; the median is reported. Greedy runs are checked token for token against our
autoregressive engine; a mismatch is a failure (exit 1), reported with the first differing position,
transformers' top-2 logit gap there, and whether transformers, fed our tokens, ranks every one of them
first up to a tie (a logit gap of at most 4 units in the last place of the dtype: bf16 logits tie
often, then the runs differ by rounding, not by logic; --accept-ties stops counting those as
failures, --dtype float32 avoids them).
EOS does not stop any system (transformers runs with eos_token_id unset), so all produce N tokens.

RoPE: each context gets the scaling it needs (--rope-scaling auto: YaRN when context + new tokens
exceeds the trained positions); contexts needing different scalings are run with the models reloaded.

Two tables, each within 100 columns. Throughput: decode tokens/s; speedup vs our autoregressive and
vs transformers generate(); tokens per full-cache pass; same tokens. Levels: acceptance per level;
milliseconds per pass of each level; bytes per token: read (modelled: weights + the KV each pass
reads, from the pass counts) and moved (measured host->device copies, with --offload host); with
--offload host the link floor of a full pass (KV it streamed / pinned host->device bandwidth
measured in this run; n/a on CPU).

    python -m bench.bench --quick           # 1K context, 16 tokens, 1 repeat: AR, triforce, adaptive, hf-generate
    python -m bench.bench --contexts 4096,16384,32768 --new-tokens 128 --out bench.json   # + bench.png
    python -m bench.bench --model models/qwen2.5-coder-1.5b --contexts 4096,16384 --dtype bfloat16
    python -m bench.bench --systems autoregressive,adaptive,adaptive-no-lookup --learned   # steady state
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from triforce.cli.common import (DEFAULT_PROMPT_FILE, RunConfig, add_engine_args, add_model_args, generation_config,
                            read_text, resolve_rope, run_cli, run_config)
from bench.bench_report import hardware, hardware_line, plot, print_table, wide
from bench.hf_peers import CACHE_OF, SYSTEMS as HF, HFSystems
from bench.measure import (ALL_OURS, OURS, TIE_ULPS, build_system, counted_run, first_mismatch, level_ms_per_pass,
                           link_floor, logit_gap_ulps, system_settings, seed_config, shared_prefill, ties_only)
from bench.prompts import open_story_session
from triforce.speculative.graphs import HOT_AFTER
from bench import timeline
from bench.traffic import Traffic, bytes_read
from triforce.speculative import ModelConfig, UserError

BOOK = DEFAULT_PROMPT_FILE
DEFAULT_SYSTEMS = ",".join(OURS + HF)
# --quick: a few minutes on a loaded 2-core CPU. 1,024 tokens is the shortest context the retrieval
# level still has chunks to choose from (default budget 512); our baseline, our full engine and
# transformers' generate(), the peer every user has, each decoding 16 tokens once after a warm-up.
# One torch thread unless --threads: on a loaded 2-core machine two OpenMP threads wait on each other's
# time slices (SmolLM2, load 5: 305 s with 2 threads, 52 s with 1).
QUICK = {"contexts": "1024", "new_tokens": 16, "repeats": 1, "systems": "autoregressive,triforce,adaptive,hf-generate",
         "threads": 1}


@dataclass(frozen=True)
class BenchPlan:
    run: RunConfig  # its context is the longest of `contexts`, its max_new_tokens `new_tokens`
    contexts: tuple[int, ...]  # ascending
    systems: tuple[str, ...]
    new_tokens: int
    repeats: int
    prompt_file: str | None
    out: str | None
    plot: str | None
    accept_ties: bool
    quick: bool = False
    learned: bool = False  # adaptive systems keep what their chooser learned in the runs before
    timeline: bool = False  # one profiled run per system after the timed ones (bench/timeline.py)


def parse_args(argv) -> BenchPlan:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    add_engine_args(p)
    p.add_argument("--prompt-file", default=None, help="a book (default: the embedded book prefix)")
    p.add_argument("--contexts", default="4096", help="comma-separated context lengths")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2,
                   help="timed runs of each system after a warm-up (greedy: the median's; sampled: one seed each, pooled)")
    p.add_argument("--systems", default=None, help=f"comma-separated, from {', '.join(ALL_OURS + HF)} (default: {DEFAULT_SYSTEMS})")
    p.add_argument("--quick", action="store_true",
                   help=f"a few minutes on 2 CPU cores: context {QUICK['contexts']}, {QUICK['new_tokens']} tokens, "
                        f"{QUICK['repeats']} repeat, systems {QUICK['systems']} (unless --systems), 1 torch thread "
                        "(unless --threads)")
    p.add_argument("--out", default=None, help="write results as JSON")
    p.add_argument("--plot", default=None, help="PNG of tokens/s: against context with several contexts (default: "
                   "--out with .png, else bench.png), a bar per system with one (made when --plot or --out is given)")
    p.add_argument("--accept-ties", action="store_true",
                   help="do not fail on a transformers run whose tokens diverge only at logit ties (fed our tokens, it "
                        f"ranks each first or within {TIE_ULPS} units in the last place of the dtype of its top logit); "
                        "still shown as NO in the table")
    p.add_argument("--learned", action="store_true",
                   help="adaptive systems keep what their chooser learned in the warm-up and earlier repeats, as a "
                        "chat's later answers do (the steady state), instead of trying every mode afresh in each "
                        "timed run, as a new process does: a short run is otherwise mostly exploration")
    p.add_argument("--timeline", action="store_true",
                   help="after the timed runs, one profiled run per system of ours: where its time goes on the "
                        "device (kernels, copies, their overlap, idle), ms a token (bench/timeline.py; CUDA)")
    p.add_argument("--debug", action="store_true")
    args = p.parse_args(argv)
    contexts, new_tokens, repeats = ((QUICK["contexts"], QUICK["new_tokens"], QUICK["repeats"]) if args.quick
                                     else (args.contexts, args.new_tokens, args.repeats))
    systems_flag = args.systems or (QUICK["systems"] if args.quick else DEFAULT_SYSTEMS)
    if new_tokens < 2:
        raise UserError(f"--new-tokens must be at least 2 (got {new_tokens}): the first comes from prefill")
    if repeats < 1:
        raise UserError(f"--repeats must be at least 1 (got {repeats})")
    contexts, systems = _contexts(contexts), _systems(systems_flag)
    threads = QUICK["threads"] if args.quick and args.threads is None else args.threads
    run = run_config(args, max_new_tokens=new_tokens, context=max(contexts), threads=threads)
    return BenchPlan(run, contexts, systems, new_tokens, repeats, args.prompt_file, args.out, args.plot,
                     args.accept_ties, args.quick, args.learned, args.timeline)


def _contexts(flag: str) -> tuple[int, ...]:
    try:
        contexts = tuple(sorted({int(c) for c in flag.split(",") if c.strip()}))
    except ValueError:
        raise UserError(f"--contexts '{flag}' must be comma-separated integers, e.g. 4096,16384") from None
    if not contexts or min(contexts) <= 0:
        raise UserError("--contexts needs at least one positive length")
    return contexts


def _systems(flag: str) -> tuple[str, ...]:
    systems = tuple(s.strip() for s in flag.split(",") if s.strip())
    unknown = [s for s in systems if s not in ALL_OURS + HF]
    if unknown:
        raise UserError(f"unknown system(s) {', '.join(unknown)}: choose from {', '.join(ALL_OURS + HF)}")
    return systems


def system_configs(run: RunConfig, systems, prompt_len: int, say=None) -> dict:
    """{mode: GenerationConfig} of our systems, each from its own mode's defaults as generate.py
    resolves them (the budget comes out the same for every mode that retrieves); the budget note
    is said once."""
    cfgs = {}
    for system in [s for s in systems if s in ALL_OURS]:
        cfgs[system] = generation_config(replace(run, **system_settings(system)), prompt_len,
                                         None if cfgs else say)
    return cfgs


def bench_context(session, plan: BenchPlan, ids, context, hf=None, hf_skip=None):
    """Rows for one context: every system decodes from one prefill of the story's first `context`
    tokens (bench/prompts.py)."""
    hf_skip = dict(hf_skip or {})
    prompt = ids[:context]
    max_len = len(prompt) + plan.new_tokens
    cfgs = system_configs(session.run, plan.systems, len(prompt), session.say)
    # transformers' systems sample (or not) as ours do: the autoregressive mode's settings
    base = generation_config(replace(session.run, mode="autoregressive"), len(prompt))
    prefilled = shared_prefill(session, cfgs, prompt, max_len, f"prefill {context}") if cfgs else None
    hf_prefill = None
    if hf is not None and any(s in HF and s not in hf_skip for s in plan.systems):
        with session.console.status(f"transformers prefill {context}"):
            hf_prefill, _ = hf.prefill(prompt)
            for s in plan.systems:
                if s in CACHE_OF and s not in hf_skip:
                    why = hf.prefill_cache(s, plan.new_tokens)
                    if why:
                        hf_skip[s] = why
    systems = [s for s in plan.systems if s in ALL_OURS or (hf is not None and s in HF and s not in hf_skip)]
    results = time_systems(session, plan, systems, cfgs, base, prefilled, max_len, hf, context)
    reference = results.get("autoregressive", {}).get("tokens")
    models = session.loaded.models
    drafter_cfg = None if models.lookup else models.drafter.cfg if models.drafter is not None else session.config
    elem = 2 if str(session.dtype).endswith(("bfloat16", "float16")) else 4
    traffic = Traffic(session.config, drafter_cfg, elem, len(prompt), plan.new_tokens, seed_config(cfgs or {"-": base}),
                      lower_elem=1 if session.run.lower_weights == "int8" else elem)
    rows = [system_row(session, mode, results[mode], cfgs.get(mode, base), context, traffic, reference,
                       hf_prefill if mode in HF else prefilled.prefill_seconds)
            for mode in systems]
    for row in rows:
        if row["same_tokens"] is False:
            row.update(mismatch(session, prefilled, hf, row["system"], results[row["system"]], reference))
    for mode in plan.systems:
        if mode in HF and (hf is None or mode in hf_skip):
            rows.append({"context": context, "system": mode, "tokens_per_second": None, "same_tokens": None,
                         "skipped": hf_skip.get(mode, "transformers systems not run")})
    add_speedups(rows)
    return rows, cfgs


def system_row(session, mode, r: dict, cfg, context, traffic, reference, prefill_seconds) -> dict:
    """One system's row: its median decode speed (sampled: pooled over one seed a repetition), what
    it read and moved, per-level times."""
    seconds = statistics.median(r["times"])
    stats = r["stats"]
    decode = len(r["tokens"]) - 1
    same = None if reference is None or cfg.temperature > 0 else r["tokens"] == reference
    sampled = pooled(r["runs"]) if cfg.temperature > 0 else None
    row = {
        "context": context, "system": mode, "new_tokens": len(r["tokens"]),
        "tokens_per_second": decode / seconds, "seconds_median": seconds, "seconds_all": r["times"],
        "acceptance": stats["acceptance"], "tokens_per_full_pass": stats["tokens_per_full_pass"],
        "sampled_runs": None if sampled is None else sampled.pop("runs"),  # each repetition's seed and figures
        "passes": stats["passes"], "rebuilds": stats.get("rebuilds"),  # retrieval cache builds in the run
        "bytes_read_per_token": bytes_read(mode, stats, traffic) / max(decode, 1),
        "bytes_moved_per_token": None if stats.get("bytes_moved") is None else stats["bytes_moved"] / max(decode, 1),
        "prefill_seconds": prefill_seconds,
        "same_tokens": same, "budget": cfg.budget, "gamma1": cfg.gamma1, "gamma2": cfg.gamma2,
        "rope_scaling": session.config.rope_scaling,
        "seconds": stats["seconds"] if mode in ALL_OURS else None,
        "ms_per_pass": ms_per_pass(mode, stats, seconds),
        "link_floor": link_floor(stats, session.device) if mode in ALL_OURS else None,
        "modes": stats.get("modes") or None,  # an adaptive system's full passes per mode
        # CUDA captures and compiled widths made inside the timed runs (the warm-up should make them)
        "graphs_in_clock": r.get("graphs_in_clock") if mode in ALL_OURS else None,
        # an adaptive system: each mode's predicted ms a token at its best gamma, and all it had learned
        "estimates": stats.get("estimates") or None, "chooser_state": r.get("chooser_state"),
        "timeline": r.get("timeline"),  # --timeline: ms a token by what the device did (bench/timeline.py)
        "engine": r.get("engine"),  # how its passes ran (engine_facts)
        "tokens": r["tokens"],  # which run resolved a tie which way, when the tokens differ
    }
    if sampled is not None:
        row.update(sampled)  # pooled over the repetitions' seeds
    return row


def ms_per_pass(mode: str, stats: dict, seconds: float) -> dict:
    """{level: ms per pass}: ours from the per-level clocks; transformers' single-model systems the
    whole decode over their forward passes (assisted generation's two models are not timed apart)."""
    if mode in ALL_OURS:
        return level_ms_per_pass(stats)
    passes = stats["passes"]["verify"]
    return {"verify": 1e3 * seconds / passes} if passes and mode != "hf-assisted" else {}


def system_generators(session, cfgs: dict, prefilled, max_len: int) -> dict:
    """{mode: Generator} of our systems, built once per context through Session.generator."""
    return {mode: build_system(session, mode, cfg, prefilled, max_len) for mode, cfg in cfgs.items()}


def our_warmups(system: str) -> int:
    """Untimed runs of one of our systems: one, or for a compiled one HOT_AFTER, since a pass width
    compiles on its HOT_AFTER-th call and a greedy repetition meets the warm-up's widths again: a width
    seen once in the warm-up would compile inside the clock (the CPU rehearsal's triforce-compiled:
    0.30 tok/s, one middle pass 4.7 s)."""
    return HOT_AFTER if system_settings(system).get("compile") else 1


def time_systems(session, plan: BenchPlan, systems, cfgs, base, prefilled, max_len, hf, context) -> dict:
    """{system: its tokens (from the warm-up), top-2 margins (transformers), times and stats}, the
    repetitions alternating between systems so that drift hits all alike."""
    results = {s: {"times": [], "stats": None, "tokens": None, "margins": None, "graphs_in_clock": 0, "runs": []}
               for s in systems}
    gens = system_generators(session, cfgs, prefilled, max_len)
    for rep in range(plan.repeats + 1):  # repetition 0 is the warm-up
        seed = repetition_seed(base, rep)
        for mode in systems:
            warmups = (hf.warmups(mode) if mode in HF else our_warmups(mode)) if rep == 0 else 1
            for _ in range(warmups):
                if mode in HF:
                    tokens, seconds, stats, margins = hf.run(mode, plan.new_tokens, replace(base, seed=seed), scores=rep == 0)
                else:
                    tokens, seconds, stats, made = counted_run(gens[mode], prefilled, learned=plan.learned, seed=seed)
                    stats, margins = stats.to_dict(), None
            session.console.print(f"  [dim]{context} {'warm-up' if rep == 0 else f'rep {rep}'} {mode}: "
                                  f"{(len(tokens) - 1) / seconds:.2f} tok/s[/]")
            if rep == 0:
                results[mode]["tokens"], results[mode]["margins"] = tokens, margins
                continue
            if mode not in HF and made:
                session.console.print(f"  note: {mode}@{context} made {made} graph(s) inside the clock (a new pass "
                                      "width captured or compiled): its time includes them")
                results[mode]["graphs_in_clock"] += made
            results[mode]["times"].append(seconds)
            results[mode]["stats"] = stats
            results[mode]["runs"].append(run_record(seed, tokens, seconds, stats))
            if mode not in HF:
                results[mode]["engine"] = engine_facts(gens[mode])
            chooser = None if mode in HF else gens[mode].chooser
            if chooser is not None:  # what it believed after the run: its choices can be replayed offline
                results[mode]["chooser_state"] = chooser.state()
    if plan.timeline:
        for mode in [m for m in systems if m not in HF]:
            results[mode]["timeline"] = profiled_run(gens[mode], prefilled, plan.learned)
    return results


def repetition_seed(cfg, rep: int) -> int:
    """Sampling's seed for repetition `rep` (0: the warm-up): sampled, each timed repetition draws
    another text (seed, seed + 1, ...), so that R repetitions measure R samples of the output's law
    and not one text R times: a single 64-token text at 32K is a few full passes, and its luck moved
    session 40's sampled rows by more than the changes they judged. Greedy: always the seed."""
    return cfg.seed + max(rep - 1, 0) if cfg.temperature > 0 else cfg.seed


def run_record(seed: int, tokens, seconds: float, stats: dict) -> dict:
    """One timed run's counts: what a sampled row pools over its repetitions."""
    return {"seed": seed, "decode_tokens": len(tokens) - 1, "seconds": seconds, "full_passes": stats.get("full_passes"),
            "proposed": stats.get("proposed") or {}, "accepted": stats.get("accepted") or {}}


def pooled(runs: list[dict]) -> dict:
    """A sampled row's figures over its runs (one seed each): tokens over time, over full passes, and
    each edge's kept drafts over its proposed ones, each a ratio of sums (the law's mean, where a
    median of ratios would favour short texts)."""
    tokens, seconds = sum(r["decode_tokens"] for r in runs), sum(r["seconds"] for r in runs)
    passes = sum(r["full_passes"] or 0 for r in runs)
    edges = sorted({e for r in runs for e in r["proposed"]})
    proposed = {e: sum(r["proposed"].get(e, 0) for r in runs) for e in edges}
    accepted = {e: sum(r["accepted"].get(e, 0) for r in runs) for e in edges}
    return {"tokens_per_second": tokens / seconds, "tokens_per_full_pass": tokens / passes if passes else None,
            "acceptance": {e: accepted[e] / proposed[e] for e in edges if proposed[e]},
            "runs": [{"seed": r["seed"], "decode_tokens": r["decode_tokens"], "seconds": r["seconds"],
                      "full_passes": r["full_passes"], "tokens_per_second": r["decode_tokens"] / r["seconds"]}
                     for r in runs]}


def engine_facts(gen) -> dict:
    """How one of our systems' passes ran, which its speed depends on: plain decoding with a pass
    queued ahead of the host (engine.Generator._queued_tokens), and where the full cache is offloaded
    how its passes' new K/V reach the host store (OffloadedCache.store_writes); on CUDA, which pass
    shapes the device measured faster as one-query heads (model/folded_heads.py), so far in the process."""
    from triforce.model import folded_heads

    writes = getattr(gen.full.cache, "store_writes", None)
    facts = {"queued_ahead": gen.reads is not None, "store_writes": writes() if writes else None}
    if gen.device.type == "cuda":
        facts["folded_heads"] = folded_heads.decisions()
    return facts


def profiled_run(gen, prefilled, learned: bool) -> dict:
    """bench/timeline.py's summary of one more run of `gen`, as a timed run starts."""
    def run() -> int:
        gen.resume(prefilled.prompt, prefilled.queries, prefilled.first, learned=learned)
        return len(gen.generate(timeline.TOKENS + 1)) - 1  # the first token came from the prefill
    return timeline.profile_run(run, gen.device.type == "cuda")


def mismatch(session, prefilled, hf, mode: str, result: dict, reference) -> dict:
    """Where a greedy run first left the reference, and whether only at logit ties."""
    at = first_mismatch(result["tokens"], reference)
    found = {"first_mismatch": at}
    margins = result["margins"]
    if margins is not None and at is not None and 0 < at <= len(margins):
        found["top2_margin_at_mismatch"] = margins[at - 1]  # scores[i] picked tokens[i + 1]
    if mode in HF:  # does transformers' model rank our tokens first everywhere (ties aside)?
        disagree = hf.teacher_forced(reference)
        found["teacher_forced_disagreements"] = disagree
        found["tie_only"] = ties_only(disagree)
    elif at is not None:  # ours: a T-token verification pass rounds differently from T one-token passes
        found["logit_gap_ulps_at_mismatch"] = gap = logit_gap_ulps(session, prefilled, reference, result["tokens"], at)
        found["tie_only"] = gap <= TIE_ULPS
    return found


def add_speedups(rows) -> None:
    """Each row's speedup over our autoregressive engine and over transformers' generate()."""
    base = next((row["tokens_per_second"] for row in rows if row["system"] == "autoregressive"), None)
    hf_base = next((row["tokens_per_second"] for row in rows if row["system"] == "hf-generate"), None)
    for row in rows:
        tps = row["tokens_per_second"]
        row["speedup"] = tps / base if base and tps else None
        row["speedup_vs_hf_generate"] = tps / hf_base if hf_base and tps else None


# ---------------------------------------------------------------------------------------------- main
def rope_groups(plan: BenchPlan) -> list[tuple[dict | None, list[int]]]:
    """Contexts grouped by the RoPE scaling each needs (context + new tokens), in order."""
    base = ModelConfig.from_folder(plan.run.model)
    groups: dict = {}
    for c in plan.contexts:
        scaling = resolve_rope(base, c + plan.new_tokens, plan.run.rope_scaling).rope_scaling
        groups.setdefault(json.dumps(scaling, sort_keys=True), []).append(c)
    return [(json.loads(k), v) for k, v in groups.items()]


def main(argv=None) -> int:
    from rich.console import Console

    plan = parse_args(argv)
    if plan.quick:
        print(f"--quick: context {', '.join(map(str, plan.contexts))}, {plan.new_tokens} new tokens, {plan.repeats} "
              f"repeat after a warm-up; systems {', '.join(plan.systems)}; {plan.run.threads} torch thread(s)",
              file=sys.stderr)
    rows, session = [], None
    hw = hardware()
    for session, new_rows in bench_groups(plan, read_text(plan.prompt_file or BOOK)):
        rows += new_rows
        if plan.out:  # each context as it finishes: a run stopped at a time limit keeps what it measured
            partial = report(plan, session.run, session.draft, rows, hw, hardware_line(hw, session.run.device))
            Path(plan.out).write_text(json.dumps({**partial, "partial": "contexts measured so far"}, indent=2))
    run = session.run  # as the last session resolved it (device, lower weights)
    line = hardware_line(hw, run.device)
    out_console = wide(Console())
    drawn = (f"; sampled at {run.temperature:g} (top-p {run.top_p:g}), seeds {run.seed}-{run.seed + plan.repeats - 1} "
             "pooled" if run.temperature > 0 else "")
    out_console.print(f"{Path(run.model).name}, {run.dtype}, {plan.new_tokens} new tokens{drawn}; {line}", width=100)
    print_table(out_console, rows)
    for message in write_results(plan, run, session.draft, rows, hw, line):
        print(message)
    session.close()
    return verdict(plan, rows)


def bench_groups(plan: BenchPlan, text: str):
    """(session, rows) for each context, the models loaded once per group of contexts sharing a RoPE
    scaling."""
    groups = rope_groups(plan)
    session = None
    for scaling, contexts in groups:
        if session is not None:  # a different RoPE scaling: free the previous models before loading
            session.close()
            session = None
            gc.collect()
        session = open_story_session(replace(plan.run, context=max(contexts)), text)
        if len(groups) > 1:
            session.console.print(f"[bold]contexts {', '.join(map(str, contexts))}[/]: RoPE scaling "
                                  f"{scaling or 'none'} (models loaded for these contexts)")
        hf, hf_skip = transformers_peers(session, plan)
        ids, measured = session.prompt_ids, False
        for context in contexts:
            if context > len(ids):
                session.console.print(f"[yellow]skip:[/] the book has only {len(ids)} tokens (< {context})")
                continue
            new_rows, _ = bench_context(session, plan, ids, context, hf, hf_skip)
            if len(plan.contexts) > 1:  # each context's table as it finishes; with one, the final table says it all
                print_table(wide(session.console), new_rows)
            measured = True
            yield session, new_rows
        if not measured:  # every context skipped: the session still reports what it resolved
            yield session, []
        hf = None


def transformers_peers(session, plan: BenchPlan):
    """(HFSystems or None, {system: why it is skipped}) for the transformers systems asked for."""
    hf, hf_skip = None, {}
    if not any(s in HF for s in plan.systems):
        return hf, hf_skip
    if session.dist is not None:
        return hf, {s: "not run under tensor parallelism" for s in HF}
    if session.draft == "self":
        hf_skip["hf-assisted"] = "n/a: --draft self, no drafter model to pass as assistant_model"
    with session.console.status("loading the model(s) into transformers"):
        hf = HFSystems(session, session.config)
    return hf, hf_skip


def write_results(plan: BenchPlan, run: RunConfig, draft: str, rows, hw: dict, line: str) -> list[str]:
    """Write the JSON (--out) and the plot (always with several contexts; with one, a bar per system
    when --plot or --out asks for it); the lines saying where they are."""
    messages = []
    several = len({r["context"] for r in rows}) > 1
    if plan.out:
        Path(plan.out).write_text(json.dumps(report(plan, run, draft, rows, hw, line), indent=2))
        messages.append(f"results: {plan.out}")
    if several or plan.plot or plan.out:
        path = Path(plan.plot) if plan.plot else (Path(plan.out).with_suffix(".png") if plan.out else Path("bench.png"))
        messages.append(plot(rows, path, f"{Path(run.model).name} ({run.dtype}, greedy={run.temperature == 0}): "
                                         f"{line}"))
    return messages


def report(plan: BenchPlan, run: RunConfig, draft: str, rows, hw: dict, line: str) -> dict:
    import transformers

    return {"rows": rows, "model": run.model, "draft": draft, "dtype": run.dtype, "device": str(run.device),
            "threads": hw["torch_threads"], "hardware": hw,
            "hardware_line": line, "transformers": transformers.__version__,
            "settings": {"new_tokens": plan.new_tokens, "repeats": plan.repeats, "contexts": list(plan.contexts),
                         "temperature": run.temperature, "top_p": run.top_p, "seed": run.seed,
                         "prompt_file": str(plan.prompt_file or BOOK), "offload": run.offload,
                         "lower_weights": run.lower_weights, "learned": plan.learned,
                         "hf_assisted_defaults": {"num_assistant_tokens": 20, "schedule": "constant",
                                                  "assistant_confidence_threshold": 0.4}},
            "notes": {"bytes_read_per_token": "modelled: weights (int8 proposers: 1 byte each) + KV each pass reads, "
                                              "from counted passes",
                      "bytes_moved_per_token": "measured host->device copies (--offload host only)",
                      "ms_per_pass": "ours: each level's clock over its passes; transformers: decode time over forward "
                                     "passes (not for assisted generation)",
                      "link_floor": "--offload host: KV streamed per full pass (measured) / pinned host->device "
                                    "bandwidth measured in this run (CUDA; n/a on CPU)",
                      "timing": "decode only (first token from prefill), after a warm-up: greedy the median over "
                                "repetitions; sampled pooled over them (tokens over seconds), one seed each: seed, seed + 1, ...",
                      "prompt": "the story's first tokens (bench/prompts.py)"}}


def verdict(plan: BenchPlan, rows) -> int:
    """1 when a greedy run's tokens differ from autoregressive decoding (ties aside with --accept-ties)."""
    mismatches = [r for r in rows if r["same_tokens"] is False]
    ties = [r for r in mismatches if r.get("tie_only")]
    if ties:
        print(f"note: {', '.join(r['system'] + '@' + str(r['context']) for r in ties)} diverged only at logit ties: fed our "
              f"autoregressive tokens, the target ranks each first or within {TIE_ULPS} units in the last place of "
              f"{plan.run.dtype} of its top logit (rounding, not logic); use --dtype float32 for an exact-token comparison" +
              (" (--accept-ties: not counted as failures)" if plan.accept_ties else ""), file=sys.stderr)
        if plan.accept_ties:
            mismatches = [r for r in mismatches if not r.get("tie_only")]
    if mismatches:
        names = ", ".join(f"{r['system']}@{r['context']}" for r in mismatches)
        print(f"error: {len(mismatches)} system(s) generated different tokens than autoregressive greedy: {names}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
