"""Chat about a book: prefill it once (and keep it on disk), then ask questions.

    triforce-chat --book persuasion.txt --context 6000
    triforce-chat --book novel.txt --model models/qwen2.5-coder-1.5b --show-levels

The book goes into the system prompt of the model's chat template. Its prefilled KV cache is
saved under --cache-dir, keyed by model, dtype, book and settings, so the next start on the same
book skips the prefill (and an adaptive chat starts from what the last one learned of each mode's
speed there, kept beside it). Questions are appended to the cache (the book is never prefilled again)
and answers stream as the engine accepts tokens.
Commands: /stats /reset /save FILE /help /quit. Ctrl-C stops an answer; Ctrl-D or Ctrl-C at the
prompt quits.
"""
from __future__ import annotations

import time

_T0 = time.perf_counter()  # the startup time is reported: it is what the saved cache buys

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

try:  # importing torch takes seconds: a Ctrl-C then is an ordinary interrupt, not a traceback
    from rich.console import Console
    from rich.markup import escape

    from triforce.cli.common import (add_engine_args, add_model_args, as_flags, check_flags, open_session, run_cli,
                                     run_config)
    from triforce.cli.progress import prefill_progress, watch_layers
    from triforce.cli.stats import modes_text, print_stats_table
    from triforce.model.errors import UserError
    from triforce.runtime.book import ChatOptions, Reporter
    from triforce.runtime.chat import Answer, Chat, open_chat
    from triforce.runtime.text import StreamingText
except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    sys.exit(130)

PROMPT = "> "
HELP = """[bold]/stats[/]       statistics of the last answer
[bold]/reset[/]       drop the conversation, keep the book
[bold]/save FILE[/]   write the transcript to FILE
[bold]/help[/]        this list
[bold]/quit[/]        leave (Ctrl-D works too)
Ctrl-C stops an answer and returns to the prompt."""
COLOURS = {"draft": "\x1b[36m", "lookup": "\x1b[35m", "middle": "\x1b[32m"}  # the verifier's own tokens stay plain
LEGEND = "colours: [cyan]drafter[/], [magenta]lookup[/], [green]retrieval level[/], plain = full-cache verifier"


def parse_args(argv) -> ChatOptions:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--book", required=True, help="a UTF-8 text file")
    add_model_args(p)
    # default: the strongest prepared model that reads a book this long (triforce.runtime.book)
    p.set_defaults(model=None)
    add_engine_args(p, adaptive=True)
    g = p.add_argument_group("chat")
    g.add_argument("--room", type=int, default=2048, help="tokens kept for the conversation after the book "
                   "(default %(default)s); /reset frees them")
    g.add_argument("--cache-dir", default=None, help="where prefilled books are kept, with what the adaptive "
                   "chooser learned of each mode's speed on them (default $XDG_CACHE_HOME/triforce-chat or "
                   "~/.cache/triforce-chat)")
    g.add_argument("--no-cache", action="store_true", help="neither read nor write a saved cache (nor what "
                   "the chooser learned)")
    g.add_argument("--show-levels", action="store_true", help="colour each token by the level that produced it")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    args = p.parse_args(argv)
    if args.room < 1:  # a UserError, like every other refused setting: one line starting "error:"
        raise UserError(f"--room must be a positive number of tokens (got {args.room})")
    if args.context is not None and args.context < 1:
        raise UserError(f"--context must be positive (got {args.context})")
    run = run_config(args, sampling=None)
    check_flags(run)  # before the book or the model is read
    return ChatOptions(run, args.book, args.room, args.cache_dir, args.no_cache, args.show_levels)


def summary(a: Answer, max_new_tokens: int) -> str:
    s = a.stats
    parts = [f"{len(a.tokens)} tokens", f"{s.tokens_per_second:.1f} tokens/s" if s.tokens_per_second else "- tokens/s"]
    acc = [f"{k.replace('->', '→')} {v:.2f}" for k, v in s.to_dict()["acceptance"].items() if v is not None]
    if acc:
        parts.append("acceptance " + ", ".join(acc))
    if s.modes:
        parts.append("passes: " + modes_text(s.modes))
    parts.append(f"{a.seconds:.1f} s")
    parts += {"interrupted": ["stopped"], "length": [f"cut at {max_new_tokens} (--max-new-tokens)"]}.get(a.status, [])
    return " · ".join(parts)


class AnswerPrinter:
    """Writes an answer as its tokens arrive (triforce.runtime.text.StreamingText), each piece
    coloured by the level that proposed its last token when asked."""

    def __init__(self, tok, out, colour: bool):
        self.text, self.out, self.colour = StreamingText(tok), out, colour

    def __call__(self, new: list[int], levels: list[str]) -> None:
        for token, level in zip(new, levels):
            piece = self.text.push([token])
            if piece and self.colour and level in COLOURS:
                piece = f"{COLOURS[level]}{piece}\x1b[0m"
            self.out.write(piece)
        self.out.flush()


# ------------------------------------------------------------------------------------- the REPL
def repl(chat: Chat, stdin, out, show_levels: bool = False) -> int:
    """Read questions and commands until /quit, end of input or Ctrl-C at the prompt."""
    console = Console(file=out, highlight=False, soft_wrap=True, force_terminal=show_levels or None)
    console.print(f"[dim]Ask about {escape(chat.book.name or 'the book')}. /help lists the commands; Ctrl-C stops an answer, "
                  f"Ctrl-D quits.[/]")
    if show_levels:
        console.print(LEGEND)
    while True:
        line = chat.share(lambda: _read_line(stdin, out))
        if line is None:
            out.write("\n")
            out.flush()
            return 0
        line = line.strip()
        try:
            if line.startswith("/"):
                if not _command(chat, line, console):
                    return 0
            elif line:
                _answer(chat, line, out, console, show_levels)
        except KeyboardInterrupt:  # outside an answer (e.g. printing a table): back to the prompt
            out.write("\n")


def _read_line(stdin, out) -> str | None:
    try:
        if stdin is sys.stdin and stdin.isatty() and out is sys.stdout:
            return input(PROMPT)  # line editing and history
        out.write(PROMPT)
        out.flush()
        line = stdin.readline()
        return line if line else None
    except (EOFError, KeyboardInterrupt):
        return None


def _answer(chat: Chat, question: str, out, console, show_levels: bool) -> None:
    printer = AnswerPrinter(chat.tok, out, colour=show_levels)
    try:
        answer = chat.ask(question, printer)
    except KeyboardInterrupt:
        console.print("\n[yellow]stopped before the answer began; the question was dropped[/]")
        return
    except UserError as e:
        console.print(f"[red]{escape(as_flags(str(e)))}[/]")
        return
    out.write("\n")
    console.print(f"[dim]{summary(answer, chat.gen.cfg.max_new_tokens)}[/]")


def _command(chat: Chat, line: str, console) -> bool:
    """Run a /command; False means quit."""
    name, _, arg = line.partition(" ")
    if name in ("/quit", "/exit", "/q"):
        return False
    if name == "/help":
        console.print(HELP)
    elif name == "/stats":
        if chat.last is None:
            console.print("no answer yet: ask a question first")
        else:
            session = chat.session
            lower = session.run.lower_weights if session is not None else "same"
            choices = session.choices(chat.gen.cfg) if session is not None else ()
            print_stats_table(console, chat.gen.mode, chat.last.stats, lower,
                              session.device if session is not None else None, choices)
    elif name == "/reset":
        chat.reset()
        console.print("conversation dropped; the book is still loaded")
    elif name == "/save":
        _save_transcript(chat, arg.strip(), console)
    else:
        console.print(f"unknown command {escape(name)}: /help lists the commands")
    return True


def _save_transcript(chat: Chat, target: str, console) -> None:
    if not target:
        console.print("usage: /save FILE")
        return
    path = Path(target).expanduser()
    try:
        if chat.is_main:
            path.write_text(chat.transcript(), encoding="utf-8")
        n = sum(a is not None for a in chat.log)
        console.print(f"saved {n} answer{'s' * (n != 1)} to {escape(str(path))}")
    except OSError as e:
        console.print(f"[red]could not write {escape(str(path))}: {escape(str(e.strerror or e))}[/]")


# ------------------------------------------------------------------------------------- start-up
def start(opts: ChatOptions, interactive: bool | None = None) -> Chat:
    """Everything before the first question (triforce.runtime.chat.open_chat), said on the console."""
    console = Console(stderr=True, quiet=int(os.environ.get("RANK", "0")) != 0)
    if interactive is None:
        interactive = sys.stdin.isatty() and int(os.environ.get("WORLD_SIZE", "1")) == 1
    chat = open_chat(opts, ConsoleReporter(console), _confirm if interactive else None,
                     open_session=lambda run, tok: open_session(run, None, modes=(run.mode,), tokenizer=tok))
    console.print(f"ready in {time.perf_counter() - _T0:.1f} s")
    return chat


def _confirm(question: str) -> bool:
    try:
        return input(question).strip().lower() in ("y", "yes")
    except (EOFError, KeyboardInterrupt):
        return False


class ConsoleReporter(Reporter):
    """The library's notes and warnings on the console, in command-line words; prefills as a bar."""

    def __init__(self, console):
        self.console = console

    def note(self, text: str) -> None:
        self.console.print(escape(as_flags(text)))

    def warn(self, text: str) -> None:
        self.console.print(f"[yellow]{escape(as_flags(text))}[/]")

    def progress(self, total: int, done: int = 0, label: str = "prefill"):
        return prefill_progress(self.console, total, label, done)

    def watch(self, model, advance):
        return watch_layers(model, advance)


def main(argv=None) -> int:
    opts = parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        # run_cli turns SIGTERM into a Ctrl-C, which here would only stop an answer: quit instead
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    chat = start(opts)
    if not chat.is_main and threading.current_thread() is threading.main_thread():
        # other ranks follow rank 0's input; a Ctrl-C reaches them only to stop an answer (chat.agreed_stop)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return repl(chat, sys.stdin, chat.session.stdout, opts.show_levels)
    finally:
        chat.close()


def cli() -> None:
    """Console entry point (triforce-chat, python -m triforce chat)."""
    sys.exit(run_cli(main))


if __name__ == "__main__":
    cli()
