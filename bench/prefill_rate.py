"""Prefill rate: ours against transformers', same machine, same process, same token ids.

    python -m bench.prefill_rate --model models/smollm2-135m --tokens 4096 --dtype bfloat16 --threads 2

Ours is `Generator(..., "autoregressive").prefill(ids)` (pieces of --chunk tokens through a FullCache).
The peer is transformers' own model with SDPA attention and a KV cache under inference_mode, fed in
each --hf-chunks way (0 = the whole prompt in one call) and credited with its fastest: the comparison
is against its strongest configuration, not its default. Systems alternate within each repetition,
after a warm-up each (the prompt's first 1,024 tokens), so load from other jobs falls on both; times
are the best of --repeats.
The last position's logits of the two are compared too: equal outputs make the rates comparable.
"ours" is the engine as it runs here: bf16 pieces' attention through our kernel, or on a CPU with AMX
through torch's SDPA (attention.prefill_kernel_serves); --sdpa-too adds the other path ("ours-sdpa" or
"ours-kernel").
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from triforce.cli.common import DEFAULT_MODEL, DEFAULT_PROMPT_FILE, read_text, run_cli


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", action="append", help=f"HF checkpoint folder, repeatable (default: {DEFAULT_MODEL})")
    p.add_argument("--prompt-file", default=str(DEFAULT_PROMPT_FILE), help="text to prefill (its last --tokens tokens)")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--chunk", type=int, default=None, help="our prefill chunk (default: GenerationConfig's)")
    p.add_argument("--hf-chunks", default="0,512", help="transformers' feeds to try, comma-separated (0 = one call)")
    p.add_argument("--sdpa-too", action="store_true",
                   help="also time ours with the bf16 prefill attention this CPU does not default to "
                        "(our kernel, or torch's SDPA)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--debug", action="store_true")
    args = p.parse_args(argv)
    args.model = args.model or [str(DEFAULT_MODEL)]
    args.hf_chunks = [int(c) for c in args.hf_chunks.split(",") if c.strip()]
    if args.repeats < 1 or args.tokens < 1 or not args.hf_chunks or min(args.hf_chunks) < 0:
        p.error("--repeats and --tokens must be >= 1, --hf-chunks one or more sizes >= 0")
    return args


def prompt_ids(folder: str, text: str, tokens: int) -> list[int]:
    from triforce.model.loader import load_tokenizer
    from triforce.speculative import UserError

    ids = load_tokenizer(folder)(text)["input_ids"]
    if len(ids) < tokens:
        raise UserError(f"the prompt file has {len(ids):,} tokens, fewer than --tokens {tokens:,}; give a longer text")
    return ids[-tokens:]


def ours_prefill(model, ids: list[int], chunk: int, kernel: bool | None = None):
    """Seconds for our prefill of ids, and the last position's logits; `kernel`: bf16 pieces' attention
    through our kernel (True), torch's SDPA (False) or the engine's choice here (None;
    attention.PREFILL_KERNEL)."""
    import torch

    from triforce.model import attention

    from triforce.speculative import GenerationConfig
    from triforce.speculative.engine import Generator, Models

    gen = Generator(Models(model, None), GenerationConfig(max_new_tokens=1, prefill_chunk=chunk),
                    "autoregressive", max_len=len(ids) + 1)
    attention.PREFILL_KERNEL = kernel
    try:
        start = time.perf_counter()
        gen.prefill(ids)
        seconds = time.perf_counter() - start
    finally:
        attention.PREFILL_KERNEL = None
    gen.full.cache.rollback(len(ids) - 1)  # the last token again, for its logits (not timed)
    with torch.inference_mode():
        logits = gen.full.model(torch.tensor(ids[-1:]), gen.full.cache)[-1]
    return seconds, logits


WARMUP_TOKENS = 1024


def hf_prefill(model, ids: list[int], chunk: int):
    """Seconds for transformers' prefill of ids in pieces of `chunk` (0: one call), and the last logits."""
    import torch
    from transformers import DynamicCache

    x = torch.tensor([ids])
    step = chunk or len(ids)
    with torch.inference_mode():
        start = time.perf_counter()
        cache = DynamicCache(config=model.config)
        for i in range(0, len(ids), step):
            out = model(input_ids=x[:, i:i + step], past_key_values=cache, use_cache=True, logits_to_keep=1)
        seconds = time.perf_counter() - start
    return seconds, out.logits[0, -1].float()


def load_pair(folder: str, dtype_name: str, tokens: int):
    """Our model and transformers' from the same folder, in the same dtype."""
    import torch
    from transformers import AutoModelForCausalLM

    from triforce.model.config import ModelConfig
    from triforce.model.loader import load_model
    from triforce.speculative import UserError

    cfg = ModelConfig.from_folder(folder)
    if tokens > cfg.max_positions:
        raise UserError(f"--tokens {tokens:,} exceeds {folder}'s {cfg.max_positions:,} positions; lower --tokens")
    dtype = getattr(torch, dtype_name)
    ours = load_model(folder, dtype, "cpu", max_len=tokens + 1)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
    return ours, hf.eval().requires_grad_(False)


def measure(folder: str, text: str, tokens: int, dtype: str, chunk: int, hf_chunks: list[int], repeats: int,
            sdpa_too: bool = False) -> dict:
    """One row: both prefills of the same ids, alternating, best of `repeats` after a warm-up each
    (the first WARMUP_TOKENS: allocator and kernel choice settle; a whole long prompt would double
    the run)."""
    ids = prompt_ids(folder, text, tokens)
    ours, hf = load_pair(folder, dtype, tokens)
    runs = {"ours": lambda part: ours_prefill(ours, part, chunk)}
    kernel_default = attention_default()
    other = "ours-sdpa" if kernel_default else "ours-kernel"
    if sdpa_too:
        runs[other] = lambda part: ours_prefill(ours, part, chunk, kernel=not kernel_default)
    runs.update({f"hf:{c}": (lambda part, c=c: hf_prefill(hf, part, c)) for c in hf_chunks})
    for run in runs.values():
        run(ids[:WARMUP_TOKENS])
    times, logits = {name: [] for name in runs}, {}
    for rep in range(repeats):
        for name, run in runs.items():
            seconds, logits[name] = run(ids)
            times[name].append(seconds)
            # each prefill of a long prompt takes a minute or more on a CPU: one line as each ends,
            # on stderr (the table and --out JSON stay clean)
            print(f"prefill_rate: {Path(folder).name} {name} repeat {rep + 1} of {repeats}: {tokens:,} tokens "
                  f"in {seconds:.1f} s ({tokens / seconds:,.1f} tokens/s)", file=sys.stderr, flush=True)
    best = {name: min(t) for name, t in times.items()}
    hf_best = min((n for n in runs if n.startswith("hf:")), key=best.get)
    sdpa = {}
    if sdpa_too:
        kernel, via_sdpa = ("ours", other) if kernel_default else (other, "ours")
        sdpa = {"ours_kernel_tokens_per_s": tokens / best[kernel], "ours_sdpa_tokens_per_s": tokens / best[via_sdpa],
                "kernel_over_sdpa": best[via_sdpa] / best[kernel],
                "sdpa_last_logits_max_abs_diff": (logits[kernel] - logits[via_sdpa]).abs().max().item()}
    return {**sdpa, "prefill_attention": "kernel" if kernel_default else "sdpa", "model": Path(folder).name, "dtype": dtype, "tokens": tokens, "chunk": chunk,
            "hf_chunk": int(hf_best.split(":")[1]), "ours_tokens_per_s": tokens / best["ours"],
            "hf_tokens_per_s": tokens / best[hf_best], "ratio": best[hf_best] / best["ours"],
            "seconds": times, "last_logits_max_abs_diff": (logits["ours"] - logits[hf_best]).abs().max().item(),
            "same_next_token": int(logits["ours"].argmax()) == int(logits[hf_best].argmax())}


def attention_default() -> bool:
    """Whether the engine's bf16 prefill pieces take our kernel on this CPU (else torch's SDPA)."""
    from triforce.model import attention

    return attention.prefill_kernel_serves()


def table(rows: list[dict], threads: int):
    from rich.table import Table

    t = Table(title=f"prefill rate, {threads} thread(s): ours vs transformers (best of its feeds)")
    sdpa = any("kernel_over_sdpa" in r for r in rows)
    # with --sdpa-too "ours" is one of the two paths (the caption says which)
    for col in ("model", "dtype", "tokens", *(("kernel tok/s", "SDPA tok/s", "kernel/SDPA") if sdpa else ("ours tok/s",)),
                "hf tok/s", "hf feed", "ours/hf", "|dlogit|"):
        t.add_column(col, justify="left" if col in ("model", "dtype") else "right")
    t.caption = f"ours: bf16 pieces' attention through {'our kernel' if attention_default() else 'SDPA (a CPU with AMX)'}"
    for r in rows:
        extra = ((f"{r['ours_kernel_tokens_per_s']:,.1f}", f"{r['ours_sdpa_tokens_per_s']:,.1f}", f"{r['kernel_over_sdpa']:.2f}x")
                 if "kernel_over_sdpa" in r else ("-", "-", "-"))
        t.add_row(r["model"], r["dtype"], f"{r['tokens']:,}", *(extra if sdpa else (f"{r['ours_tokens_per_s']:,.1f}",)),
                  f"{r['hf_tokens_per_s']:,.1f}", f"{r['hf_chunk'] or 'one call'}", f"{r['ratio']:.2f}x",
                  f"{r['last_logits_max_abs_diff']:.2g}")
    return t


def main(argv=None) -> int:
    import torch
    from rich.console import Console

    from triforce.speculative import GenerationConfig

    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    chunk = args.chunk or GenerationConfig().prefill_piece("cpu")
    GenerationConfig(prefill_chunk=chunk)  # refuses a bad --chunk, naming it
    text = read_text(args.prompt_file)
    rows = [measure(m, text, args.tokens, args.dtype, chunk, args.hf_chunks, args.repeats, args.sdpa_too)
            for m in args.model]
    Console(width=None if sys.stdout.isatty() else 120).print(table(rows, torch.get_num_threads()))  # logs: no wrap
    if args.out:
        meta = {"threads": torch.get_num_threads(), "torch": torch.__version__, "repeats": args.repeats,
                "timing": "best of repeats after a warm-up, systems alternating in one process"}
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
