#!/usr/bin/env python
"""Side-by-side decoding benchmark: every engine on the same model, prompt, context, dtype, threads.

Systems: our four engines (autoregressive, speculative, retrieval, triforce) and the ones users
would pick instead: Hugging Face transformers `generate()` (greedy, its default DynamicCache) and
transformers assisted generation (`assistant_model=` the same drafter, HF's default settings:
20 assistant tokens, confidence threshold 0.4). With `--draft self` there is no separate drafter
to hand to transformers, so that row says so instead of a number.

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

Columns: decode tokens/s; speedup vs our autoregressive and vs transformers generate(); acceptance
per level; tokens per full-cache pass; bytes per token: read (modelled: weights + the KV each pass
reads, from the pass counts) and moved (measured host->device copies, with --offload host).

    python scripts/bench.py --quick
    python scripts/bench.py --contexts 4096,16384,32768 --new-tokens 128 --out bench.json   # + bench.png
    python scripts/bench.py --model models/qwen2.5-coder-1.5b --contexts 4096,16384 --dtype bfloat16
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.common import (RunConfig, add_engine_args, add_model_args, generation_config,  # noqa: E402
                            prefill_progress, read_text, resolve_rope, run_cli, run_config)
from scripts.session import open_session  # noqa: E402
from speculative import Generator, ModelConfig, UserError  # noqa: E402
from speculative.engine import synchronize  # noqa: E402

BOOK = Path(__file__).resolve().parents[1] / "speculative" / "data" / "pride_and_prejudice_ch1-9.txt"
OURS = ("autoregressive", "speculative", "retrieval", "triforce")
HF = ("hf-generate", "hf-assisted")
DEFAULT_SYSTEMS = ",".join(OURS + HF)
TIE_ULPS = 4  # a logit gap of at most 4 units in the last place of the dtype (at the top logit) is rounding


def ulps_at(values, dtype):
    """The unit in the last place of `dtype` at each value's magnitude (bf16 at 20.0: 0.125)."""
    import torch

    mag = torch.exp2(torch.floor(torch.log2(values.abs().clamp_min(torch.finfo(dtype).tiny))))
    return mag * torch.finfo(dtype).eps


def ties_only(disagreements: dict) -> bool:
    return all(ulps <= TIE_ULPS for _, ulps in disagreements.values())


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


def parse_args(argv) -> BenchPlan:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    add_engine_args(p)
    p.add_argument("--prompt-file", default=None, help="a book (default: the embedded book prefix)")
    p.add_argument("--contexts", default="4096", help="comma-separated context lengths")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--systems", default=DEFAULT_SYSTEMS, help=f"comma-separated, from {', '.join(OURS + HF)}")
    p.add_argument("--quick", action="store_true", help="a few minutes on 2 CPU cores: 2K context, 32 tokens, 1 repeat")
    p.add_argument("--out", default=None, help="write results as JSON")
    p.add_argument("--plot", default=None, help="PNG of tokens/s against context (several contexts; default: "
                   "--out with .png, else bench.png)")
    p.add_argument("--accept-ties", action="store_true",
                   help="do not fail on a transformers run whose tokens diverge only at logit ties (fed our tokens, it "
                        f"ranks each first or within {TIE_ULPS} units in the last place of the dtype of its top logit); "
                        "still shown as NO in the table")
    p.add_argument("--debug", action="store_true")
    args = p.parse_args(argv)
    contexts, new_tokens, repeats = ("2048", 32, 1) if args.quick else (args.contexts, args.new_tokens, args.repeats)
    if new_tokens < 2:
        raise UserError(f"--new-tokens must be at least 2 (got {new_tokens}): the first comes from prefill")
    if repeats < 1:
        raise UserError(f"--repeats must be at least 1 (got {repeats})")
    contexts, systems = _contexts(contexts), _systems(args.systems)
    run = run_config(args, max_new_tokens=new_tokens, context=max(contexts))
    return BenchPlan(run, contexts, systems, new_tokens, repeats, args.prompt_file, args.out, args.plot,
                     args.accept_ties)


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
    unknown = [s for s in systems if s not in OURS + HF]
    if unknown:
        raise UserError(f"unknown system(s) {', '.join(unknown)}: choose from {', '.join(OURS + HF)}")
    return systems


# ------------------------------------------------------------------------------------------ hardware
def hardware() -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cpu_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "gpu": None}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def hardware_line(hw: dict, device) -> str:
    where = f"GPU {hw['gpu']}" if str(device).startswith("cuda") else "CPU only"
    return f"{where}; {hw['cpu']}, {hw['cpu_cores']} cores, {hw['torch_threads']} torch threads, torch {hw['torch']}"


# ------------------------------------------------------------------------------- bytes per pass model
def kv_bytes_per_token(cfg: ModelConfig, elem: int) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem


def weight_bytes(cfg: ModelConfig, elem: int) -> int:
    from scripts.costmodel import ModelShape

    return ModelShape.from_config(cfg, bytes_per_value=elem).weight_bytes_read


class Traffic:
    """Bytes a pass reads at each level: the weights plus the KV that level's cache holds. The
    proposing levels read `lower_elem` bytes per weight (1 with --lower-weights int8)."""

    def __init__(self, target: ModelConfig, drafter: ModelConfig, elem: int, context: int, new_tokens: int,
                 cfg, lower_elem: int | None = None):
        mean_len = context + new_tokens // 2
        lower_elem = lower_elem or elem
        self.full = weight_bytes(target, elem) + kv_bytes_per_token(target, elem) * mean_len
        self.middle = weight_bytes(target, lower_elem) + kv_bytes_per_token(target, elem) * min(cfg.budget, context)
        window = min(cfg.sink_tokens + cfg.draft_window, context)
        self.draft = weight_bytes(drafter, lower_elem) + kv_bytes_per_token(drafter, elem) * window
        self.assistant_full = weight_bytes(drafter, elem) + kv_bytes_per_token(drafter, elem) * mean_len

    def ours(self, passes: dict) -> int:
        return passes.get("verify", 0) * self.full + passes.get("middle", 0) * self.middle + passes.get("draft", 0) * self.draft


# ------------------------------------------------------------------------------------- transformers
class HFSystems:
    """transformers' generate() and assisted generation on the same checkpoint, dtype, device, threads.

    `wrap(model) -> model` is applied to the loaded target (compare_deepspeed.py: a ZeRO-3 engine's module);
    `assistant=False` loads no drafter."""

    def __init__(self, session, model_cfg: ModelConfig, wrap=None, assistant: bool = True):
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.torch, self.prefill_chunk = torch, session.run.prefill_chunk
        self.device = torch.device(session.device)
        self.target = self._load(AutoModelForCausalLM, session.run.model, model_cfg, session.dtype, wrap is None)
        if wrap is not None:
            self.target = wrap(self.target)
        self.assistant = None
        if assistant and session.draft != "self":
            self.assistant = self._load(AutoModelForCausalLM, session.draft, None, session.dtype)
        # A clean generation config: no sampling defaults or EOS from the checkpoint; EOS never stops.
        for m in (self.target, self.assistant):
            if m is not None:
                m.generation_config = GenerationConfig(eos_token_id=None, pad_token_id=None, bos_token_id=None)
        self.calls = {"target": 0, "assistant": 0, "drafted": 0}
        self.target.register_forward_hook(lambda *a: self._count("target"))
        if self.assistant is not None:
            self.assistant.register_forward_hook(lambda *a: self._count("assistant"))
            self._pending_cache = None
            original = type(self.assistant).generate

            def generate_with_prompt_cache(*a, **kw):  # hands the assistant its prefilled prompt cache
                if kw.get("past_key_values") is None and self._pending_cache is not None:
                    kw["past_key_values"], self._pending_cache = self._pending_cache, None
                out = original(self.assistant, *a, **kw)
                seqs = out.sequences if hasattr(out, "sequences") else out
                self.calls["drafted"] += seqs.shape[1] - kw["input_ids"].shape[1]
                return out

            self.assistant.generate = generate_with_prompt_cache
        self.prompt_cache = self.assistant_cache = None

    def _count(self, key):
        self.calls[key] += 1

    def _load(self, auto, folder, model_cfg, dtype, to_device=True):
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(folder)
        if model_cfg is not None and model_cfg.rope_scaling:
            params = dict(getattr(cfg, "rope_parameters", None) or {})
            params.update(model_cfg.rope_scaling)
            params.setdefault("rope_theta", model_cfg.rope_theta)
            cfg.rope_parameters = params
            cfg.max_position_embeddings = max(cfg.max_position_embeddings, model_cfg.max_positions)
        model = auto.from_pretrained(folder, config=cfg, dtype=dtype)
        return (model.to(self.device) if to_device else model).eval().requires_grad_(False)

    def _prefill(self, model, prompt: list[int]):
        from transformers import DynamicCache

        torch = self.torch
        cache = DynamicCache(config=model.config)
        chunk = max(self.prefill_chunk, 512)
        with torch.no_grad():
            for i in range(0, len(prompt), chunk):
                ids = torch.tensor([prompt[i:i + chunk]], device=self.device)
                out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return cache, out.logits[0, -1]

    def prefill(self, prompt: list[int]) -> tuple[float, int]:
        """HF's own prefill of the prompt (and the assistant's); returns (seconds, first greedy token)."""
        start = time.perf_counter()
        self.prompt_cache, logits = self._prefill(self.target, prompt)
        if self.assistant is not None:
            self.assistant_cache, _ = self._prefill(self.assistant, prompt)
        synchronize(self.device)
        self.prompt = list(prompt)
        self.first_logits = logits.float()
        self.first = int(logits.argmax())
        return time.perf_counter() - start, self.first

    def teacher_forced(self, reference: list[int]) -> dict:
        """Feed `reference` (tokens after the prompt) to the target in one pass and list where it does NOT
        rank the reference token first: {position: [logit gap between its top token and the reference token,
        the gap in units in the last place (ulps) of the model's dtype at the top logit]}."""
        torch = self.torch
        cache = copy.deepcopy(self.prompt_cache)
        with torch.no_grad():
            ids = torch.tensor([reference[:-1]], device=self.device)
            rows = self.target(input_ids=ids, past_key_values=cache, use_cache=True).logits[0].float()
        rows = torch.cat([self.first_logits[None].to(rows.device), rows])
        top = rows.max(dim=-1).values
        gaps = top - rows[torch.arange(len(reference)), torch.tensor(reference, device=rows.device)]
        ulp = ulps_at(top, self.target.dtype)
        return {i: [float(g), float(g / u)] for i, (g, u) in enumerate(zip(gaps.tolist(), ulp.tolist())) if g > 0}

    def generation_config(self, n: int, cfg, scores: bool):
        from transformers import GenerationConfig

        kw = dict(max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=None,
                  return_dict_in_generate=True, output_scores=scores)
        if cfg.temperature > 0:
            kw.update(do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)  # 0: off, as ours
        else:
            kw.update(do_sample=False)
        return GenerationConfig(**kw)

    def run(self, system: str, n_tokens: int, cfg, scores: bool = False):
        """Decode n_tokens - 1 after the prefill's first token. Returns (tokens, seconds, stats, margins)."""
        torch = self.torch
        ids = torch.tensor([self.prompt + [self.first]], device=self.device)
        cache = copy.deepcopy(self.prompt_cache)
        kw = {}
        if system == "hf-assisted":
            self._pending_cache = copy.deepcopy(self.assistant_cache)
            kw["assistant_model"] = self.assistant
        gen_cfg = self.generation_config(n_tokens - 1, cfg, scores)
        torch.manual_seed(cfg.seed)
        self.calls.update(target=0, assistant=0, drafted=0)
        synchronize(self.device)
        start = time.perf_counter()
        with torch.no_grad():
            out = self.target.generate(ids, past_key_values=cache, generation_config=gen_cfg, **kw)
        synchronize(self.device)
        seconds = time.perf_counter() - start
        tokens = [self.first] + out.sequences[0, ids.shape[1]:].tolist()
        margins = None
        if scores and out.scores:
            top2 = torch.stack([s[0].float().topk(2).values for s in out.scores])
            margins = (top2[:, 0] - top2[:, 1]).tolist()
        decode = len(tokens) - 1
        passes = self.calls["target"]
        stats = {"passes": {"verify": passes, "draft": self.calls["assistant"]}, "full_passes": passes,
                 "tokens_per_full_pass": decode / passes if passes else None, "acceptance": {}}
        if system == "hf-assisted" and self.calls["drafted"]:
            stats["acceptance"] = {"draft->verify": max(decode - passes, 0) / self.calls["drafted"]}
        del cache
        return tokens, seconds, stats, margins


# ---------------------------------------------------------------------------------------- our engines
def run_system(session, mode, cfg, prefilled, max_len, models=None):
    gen = Generator(models or session.loaded.models, cfg, mode, max_len=max_len, prefilled=prefilled)
    synchronize(gen.device)
    start = time.perf_counter()
    tokens = gen.generate()
    synchronize(gen.device)
    return tokens, time.perf_counter() - start, gen.stats


def _full_cache_factory(session, cfg):
    if session.run.offload != "host":
        return None
    from offload import full_cache_factory

    return full_cache_factory(device=session.device, prefill_chunk=cfg.prefill_chunk)


def logit_gap_ulps(session, prefilled, reference, tokens, at: int) -> float:
    """At the first greedy mismatch: the target's logit gap between the autoregressive token and
    the other run's, teacher-forced on the common prefix in one pass, in units in the last place of
    the dtype at the top logit. A few ulps is a tie that rounding (a T-token pass vs T one-token
    passes) may break either way; more is a real divergence."""
    import torch

    cache, model = prefilled.cache, session.loaded.models.target
    cache.rollback(len(prefilled.prompt))
    with torch.no_grad():
        logits = model(torch.tensor(reference[:at], device=session.device), cache)[-1]
    cache.rollback(len(prefilled.prompt))
    gap = (logits[reference[at]] - logits[tokens[at]]).abs()
    return float(gap / ulps_at(logits.max(), model.embed.weight.dtype))


def first_mismatch(tokens, reference):
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def bench_context(session, plan: BenchPlan, ids, context, hf=None, hf_skip=None):
    hf_skip = hf_skip or {}
    prompt = ids[-context:]
    # budgets/gammas resolved for the richest mode, used by all
    cfg = generation_config(replace(session.run, mode="triforce"), len(prompt), session.console)
    max_len = len(prompt) + plan.new_tokens
    seed_gen = Generator(session.loaded.models, cfg, "autoregressive", max_len=max_len,
                         full_cache_factory=_full_cache_factory(session, cfg))
    progress, advance = prefill_progress(session.console, len(prompt), f"prefill {context}")
    with progress:
        seed_gen.prefill(prompt, progress=advance)
    prefilled = seed_gen.snapshot()
    systems = [s for s in plan.systems if s in OURS or (hf is not None and s in HF and s not in hf_skip)]
    hf_prefill = None
    if hf is not None and any(s in HF for s in systems):
        with session.console.status(f"transformers prefill {context}"):
            hf_prefill, _ = hf.prefill(prompt)
    results = {s: {"times": [], "stats": None, "tokens": None, "margins": None} for s in systems}
    for rep in range(plan.repeats + 1):  # repetition 0 is the warm-up
        for mode in systems:
            if mode in HF:
                tokens, seconds, stats, margins = hf.run(mode, plan.new_tokens, cfg, scores=rep == 0)
            else:
                tokens, seconds, stats = run_system(session, mode, cfg, prefilled, max_len)
                stats, margins = stats.to_dict(), None
            session.console.print(f"  [dim]{context} {'warm-up' if rep == 0 else f'rep {rep}'} {mode}: "
                                  f"{(len(tokens) - 1) / seconds:.2f} tok/s[/]")
            if rep == 0:
                results[mode]["tokens"], results[mode]["margins"] = tokens, margins
                continue
            results[mode]["times"].append(seconds)
            results[mode]["stats"] = stats
    reference = results.get("autoregressive", {}).get("tokens")
    drafter_cfg = session.loaded.models.drafter.cfg if session.loaded.models.drafter is not None else session.config
    elem = 2 if str(session.dtype).endswith(("bfloat16", "float16")) else 4
    traffic = Traffic(session.config, drafter_cfg, elem, len(prompt), plan.new_tokens, cfg,
                      lower_elem=1 if session.run.lower_weights == "int8" else elem)
    rows = []
    for mode in systems:
        r = results[mode]
        seconds = statistics.median(r["times"])
        stats = r["stats"]
        decode = len(r["tokens"]) - 1
        if mode == "hf-generate":
            read = stats["full_passes"] * traffic.full
        elif mode == "hf-assisted":
            read = stats["full_passes"] * traffic.full + stats["passes"]["draft"] * traffic.assistant_full
        else:
            read = traffic.ours(stats["passes"])
        same = None if reference is None or cfg.temperature > 0 else r["tokens"] == reference
        row = {
            "context": context, "system": mode, "new_tokens": len(r["tokens"]),
            "tokens_per_second": decode / seconds, "seconds_median": seconds, "seconds_all": r["times"],
            "acceptance": stats["acceptance"], "tokens_per_full_pass": stats["tokens_per_full_pass"],
            "passes": stats["passes"], "bytes_read_per_token": read / max(decode, 1),
            "bytes_moved_per_token": None if stats.get("bytes_moved") is None else stats["bytes_moved"] / max(decode, 1),
            "prefill_seconds": hf_prefill if mode in HF else prefilled.prefill_seconds,
            "same_tokens": same, "budget": cfg.budget, "gamma1": cfg.gamma1, "gamma2": cfg.gamma2,
            "rope_scaling": session.config.rope_scaling,
        }
        if mode not in OURS:
            row["seconds"] = None
        else:
            row["seconds"] = stats["seconds"]
        if same is False:
            at = first_mismatch(r["tokens"], reference)
            row["first_mismatch"] = at
            if r["margins"] is not None and at is not None and 0 < at <= len(r["margins"]):
                row["top2_margin_at_mismatch"] = r["margins"][at - 1]  # scores[i] picked tokens[i + 1]
            if mode in HF:  # does transformers' model rank our tokens first everywhere (ties aside)?
                disagree = hf.teacher_forced(reference)
                row["teacher_forced_disagreements"] = disagree
                row["tie_only"] = ties_only(disagree)
            elif at is not None:  # ours: a T-token verification pass rounds differently from T one-token passes
                row["logit_gap_ulps_at_mismatch"] = gap = logit_gap_ulps(session, prefilled, reference, r["tokens"], at)
                row["tie_only"] = gap <= TIE_ULPS
        rows.append(row)
    for mode in plan.systems:
        if mode in HF and (hf is None or mode in hf_skip):
            rows.append({"context": context, "system": mode, "tokens_per_second": None, "same_tokens": None,
                         "skipped": hf_skip.get(mode, "transformers systems not run")})
    base = next((row["tokens_per_second"] for row in rows if row["system"] == "autoregressive"), None)
    hf_base = next((row["tokens_per_second"] for row in rows if row["system"] == "hf-generate"), None)
    for row in rows:
        tps = row["tokens_per_second"]
        row["speedup"] = tps / base if base and tps else None
        row["speedup_vs_hf_generate"] = tps / hf_base if hf_base and tps else None
    return rows, cfg


# ------------------------------------------------------------------------------------------- output
def _mib(x):
    return "-" if x is None else f"{x / 2**20:,.1f}"


def print_table(console, rows, title="decode throughput, side by side"):
    from rich.table import Table

    table = Table(title=title)
    for col in ("context", "system", "tok/s", "vs ours AR", "vs HF generate", "acceptance", "tok/full pass",
                "MiB read/tok (model)", "MiB moved/tok", "same tokens"):
        table.add_column(col, justify="right")
    for r in rows:
        if r.get("skipped"):
            table.add_row(str(r["context"]), r["system"], "-", "-", "-", f"[yellow]{r['skipped'].split(',')[0]}[/]", "-", "-",
                          "-", "-")
            continue
        acc = ", ".join(f"{k} {v:.2f}" for k, v in (r["acceptance"] or {}).items() if v is not None) or "-"
        same = {None: "-", True: "yes", False: "[red]NO[/]"}[r["same_tokens"]]
        if r["same_tokens"] is False and r.get("first_mismatch") is not None:
            same += f" [red](token {r['first_mismatch']}"
            if r.get("top2_margin_at_mismatch") is not None:
                same += f", HF top-2 gap {r['top2_margin_at_mismatch']:.3f}"
            if r.get("tie_only"):
                same += "; ties only"
            same += ")[/]"
        table.add_row(str(r["context"]), r["system"], f"{r['tokens_per_second']:.2f}",
                      f"{r['speedup']:.2f}x" if r["speedup"] else "-",
                      f"{r['speedup_vs_hf_generate']:.2f}x" if r["speedup_vs_hf_generate"] else "-", acc,
                      f"{r['tokens_per_full_pass']:.2f}" if r["tokens_per_full_pass"] else "-",
                      _mib(r["bytes_read_per_token"]), _mib(r["bytes_moved_per_token"]), same)
    console.print(table)


def wide(console):
    """The console itself on a terminal; redirected to a file or pipe, one that does not wrap the table."""
    from rich.console import Console

    if console.is_terminal:
        return console
    return Console(file=console.file, width=200, quiet=console.quiet)


def plot(rows, path: Path, title: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install -e '.[bench]')"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    systems = list(dict.fromkeys(r["system"] for r in rows if r.get("tokens_per_second")))
    for s in systems:
        pts = sorted((r["context"], r["tokens_per_second"]) for r in rows if r["system"] == s and r.get("tokens_per_second"))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s,
                linestyle="-" if s in OURS else "--")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["context"] for r in rows}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{int(x):,}"))
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"


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
    rows, session = [], None
    for session, new_rows in bench_groups(plan, read_text(plan.prompt_file or BOOK)):
        rows += new_rows
    run = session.run  # as the last session resolved it (device, lower weights)
    hw = hardware()
    line = hardware_line(hw, run.device)
    out_console = wide(Console())
    print_table(out_console, rows, title=f"decode throughput, side by side — {Path(run.model).name}, {run.dtype}; {line}")
    for message in write_results(plan, run, session.draft, rows, hw, line):
        print(message)
    session.close()
    return verdict(plan, rows)


def bench_groups(plan: BenchPlan, text: str):
    """(session, rows) for each group of contexts sharing a RoPE scaling, the models loaded per group."""
    groups = rope_groups(plan)
    session = None
    for scaling, contexts in groups:
        if session is not None:  # a different RoPE scaling: free the previous models before loading
            session.close()
            session = None
            gc.collect()
        session = open_session(replace(plan.run, context=max(contexts)), text)
        if len(groups) > 1:
            session.console.print(f"[bold]contexts {', '.join(map(str, contexts))}[/]: RoPE scaling "
                                  f"{scaling or 'none'} (models loaded for these contexts)")
        hf, hf_skip = transformers_peers(session, plan)
        ids, rows = session.prompt_ids, []
        for context in contexts:
            if context > len(ids):
                session.console.print(f"[yellow]skip:[/] the book has only {len(ids)} tokens (< {context})")
                continue
            new_rows, _ = bench_context(session, plan, ids, context, hf, hf_skip)
            rows += new_rows
            print_table(wide(session.console), new_rows)
        hf = None
        yield session, rows


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
    """Write the JSON (--out) and the plot (several contexts); the lines saying where they are."""
    messages = []
    several = len({r["context"] for r in rows}) > 1
    if plan.out:
        Path(plan.out).write_text(json.dumps(report(plan, run, draft, rows, hw, line), indent=2))
        messages.append(f"results: {plan.out}")
    if several:
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
                         "lower_weights": run.lower_weights,
                         "hf_assisted_defaults": {"num_assistant_tokens": 20, "schedule": "constant",
                                                  "assistant_confidence_threshold": 0.4}},
            "notes": {"bytes_read_per_token": "modelled: weights (int8 proposers: 1 byte each) + KV each pass reads, "
                                              "from counted passes",
                      "bytes_moved_per_token": "measured host->device copies (--offload host only)",
                      "timing": "decode only (first token from prefill), median over repetitions after a warm-up"}}


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
