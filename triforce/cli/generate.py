"""The main job: generate from a (long) prompt with one of the four engines.

    triforce-generate                                  # embedded default: a book prefix, smollm2
    triforce-generate --prompt-file book.txt --context 16384 --max-new-tokens 256
    triforce-generate --mode autoregressive --json     # one JSON object on stdout
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from triforce.cli.common import (DEFAULT_PROMPT_FILE, RunConfig, add_engine_args, add_model_args,
                            read_text, run_cli, run_config)
from triforce.cli.progress import prefill_progress


@dataclass(frozen=True)
class GenerateOptions:
    run: RunConfig
    prompt: str | None  # the prompt text itself, or None: read prompt_file
    prompt_file: str | None
    json: bool


def parse_args(argv) -> GenerateOptions:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    add_engine_args(p, adaptive=True)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="a text file (a whole book is fine); default: an embedded book prefix")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    args = p.parse_args(argv)
    embedded = args.prompt is None and args.prompt_file is None  # the book prefix: its last 4,096 tokens
    context = 4096 if embedded and args.context is None else args.context
    # The embedded job continues a novel: the model's own distribution (temperature 1) does not loop
    # there, where SmolLM2's chat settings (0.2 / top-p 0.9) and greedy decoding do (README, "the
    # main job"); a prompt of the user's gets the checkpoint's settings
    sampling = "model" if embedded else "checkpoint"
    return GenerateOptions(run_config(args, sampling=sampling, context=context), args.prompt,
                           str(DEFAULT_PROMPT_FILE) if embedded else args.prompt_file, args.json)


def main(argv=None) -> int:
    opts = parse_args(argv)
    run = opts.run
    text = opts.prompt if opts.prompt is not None else read_text(opts.prompt_file)
    # imported here, not at the top, so that torch first loads under run_cli, where a Ctrl-C during
    # its import is a clean "interrupted"
    from triforce.cli.session import Session

    session = Session(run, text)
    console, out = session.console, session.stdout
    ids = session.prompt_ids
    cfg = session.plan_generation()  # bad settings are refused before the weights load
    session.load(modes=(session.run.mode,))
    gen = session.generator(cfg, max_len=len(ids) + run.max_new_tokens)

    progress, advance = prefill_progress(console, len(ids))
    with progress if session.is_main else _null():
        gen.prefill(ids, progress=advance if session.is_main else None)

    tokenizer = session.tokenizer
    generated: list[int] = []
    shown = 0

    def stream(new_tokens, _level):
        nonlocal shown
        generated.extend(new_tokens)
        if opts.json or not session.is_main:
            return
        text_so_far = tokenizer.decode(generated, skip_special_tokens=True)
        if text_so_far.endswith("\ufffd"):  # a multi-byte character still incomplete
            return
        out.write(text_so_far[shown:])
        out.flush()
        shown = len(text_so_far)

    tokens = gen.generate(on_tokens=stream)
    stats = gen.stats
    if not session.is_main:
        return 0
    text_out = tokenizer.decode(tokens, skip_special_tokens=True)
    if opts.json:
        out.write(json.dumps(session.report(cfg, tokens, text_out, stats)) + "\n")
    else:
        out.write(text_out[shown:] + "\n")
        session.print_stats(stats, cfg)
    session.close()
    return 0


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def cli() -> None:
    """Console entry point (triforce-generate, python -m triforce generate)."""
    sys.exit(run_cli(main))


if __name__ == "__main__":
    cli()
