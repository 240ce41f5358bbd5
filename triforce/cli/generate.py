"""The main job: generate from a (long) prompt with one of the four engines.

    triforce-generate                                  # embedded default: a book prefix, SmolLM2
    triforce-generate --prompt-file book.txt --context 16384 --max-new-tokens 256
    triforce-generate --mode autoregressive --json     # one JSON object on stdout

The same run as `triforce.generate(...)` in Python (triforce.runtime.api.run_generation).
"""
from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager
from dataclasses import dataclass

from triforce.cli.common import (DEFAULT_PROMPT_FILE, Settings, add_engine_args, add_model_args, check_flags,
                                 make_settings, open_session, run_cli)
from triforce.cli.progress import prefill_progress, watch_layers
from triforce.runtime.text import read_prompt_file


@dataclass(frozen=True)
class GenerateOptions:
    run: Settings
    prompt: str | None  # the prompt text itself, or None: read prompt_file
    prompt_file: str | None
    json: bool


def parse_args(argv) -> GenerateOptions:
    from triforce.runtime.api import job_settings

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    add_engine_args(p, adaptive=True)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="a text file (a whole book is fine); default: an embedded book prefix")
    p.add_argument("--prompt-cache", choices=("auto", "on", "off"), default="auto",
                   help="keep the prefilled prompt on disk ($TRIFORCE_CACHE/prompts, by default "
                        "~/.cache/triforce/prompts), and load it when the same prompt runs again with the "
                        "same model and settings: auto (default) keeps a prompt whose prefill took 1 s or "
                        "more, on every one, off neither keeps nor loads")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    args = p.parse_args(argv)
    run = make_settings(args, None)
    check_flags(run)  # before anything reads a file or imports torch
    embedded = args.prompt is None and args.prompt_file is None
    run = job_settings(run, embedded)
    return GenerateOptions(run, args.prompt, str(DEFAULT_PROMPT_FILE) if embedded else args.prompt_file, args.json)


def main(argv=None) -> int:
    opts = parse_args(argv)
    text, note = (opts.prompt, None) if opts.prompt is not None else read_prompt_file(opts.prompt_file)
    # imported here, not at the top, so that torch first loads under run_cli, where a Ctrl-C during
    # its import is a clean "interrupted"
    from triforce.cli.stats import print_session_stats
    from triforce.runtime.api import run_generation

    session = open_session(opts.run, text, load=False)
    if note and session.is_main:
        session.say(note)
    out = session.stdout
    bar: dict = {}  # made when the prefill starts: its clock and rate then leave out compiling and loading

    def on_prefill(n: int) -> None:
        if n == 0:  # tokens reused from a kept prompt or a checkpoint show as done, outside the rate
            bar["reused"] = session.prompt_cache["reused"]
            bar["progress"], bar["advance"] = prefill_progress(session.console, len(session.prompt_ids),
                                                               done=bar["reused"])
            bar["progress"].start()
        elif not bar.pop("reused", 0):  # (the reused tokens' own call, right after 0: the bar has them)
            bar["advance"](n)

    @contextmanager
    def watching(model):
        """The bar moves within pieces while the prefill runs, and stops as it ends, before what is
        said next (the kept prompt, or where an interrupted prefill can resume)."""
        try:
            with watch_layers(model, bar.get("advance")):
                yield
        finally:
            if "progress" in bar:
                bar["progress"].stop()

    def write(piece: str) -> None:
        if not opts.json:
            out.write(piece)
            out.flush()

    try:
        result = run_generation(session, on_text=write, on_prefill=on_prefill if session.is_main else None,
                                watch_prefill=watching)
    finally:
        if "progress" in bar:
            bar["progress"].stop()
    if not session.is_main:
        return 0
    if opts.json:
        out.write(json.dumps(result.report) + "\n")
    else:
        out.write("\n")
        print_session_stats(session, result.stats, result.config)
    session.close()
    return 0


def cli() -> None:
    """Console entry point (triforce-generate, python -m triforce generate)."""
    sys.exit(run_cli(main))


if __name__ == "__main__":
    cli()
