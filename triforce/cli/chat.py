"""Chat about a book: prefill it once (and keep it on disk), then ask questions.

    triforce-chat --book persuasion.txt --context 6000
    triforce-chat --book novel.txt --model models/qwen2.5-coder-1.5b --show-levels

The book goes into the system prompt of the model's chat template. Its prefilled KV cache is
saved under --cache-dir, keyed by model, dtype, book and settings, so the next start on the same
book skips the prefill. Questions are appended to the cache (the book is never prefilled again)
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
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

try:  # importing torch takes seconds: a Ctrl-C then is an ordinary interrupt, not a traceback
    from rich.console import Console
    from rich.markup import escape

    from triforce.cli.chat_book import Book, ChatOptions, load_or_prefill, prepare_book, stop_ids
    from triforce.cli.common import (as_flags, add_engine_args, add_model_args, generation_plan, read_text,
                                replace, run_cli, run_config)
    from triforce.cli.common import open_session
    from triforce.cli.stats import modes_text, print_stats_table
    from triforce.speculative import ModelConfig, UserError
except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    sys.exit(130)
from triforce.model.loader import load_tokenizer
from triforce.speculative.stats import Stats

PROMPT = "> "
HELP = """[bold]/stats[/]       statistics of the last answer
[bold]/reset[/]       drop the conversation, keep the book
[bold]/save FILE[/]   write the transcript to FILE
[bold]/help[/]        this list
[bold]/quit[/]        leave (Ctrl-D works too)
Ctrl-C stops an answer and returns to the prompt."""
COLOURS = {"draft": "\x1b[36m", "middle": "\x1b[32m"}  # the verifier's own tokens stay plain
LEGEND = "colours: [cyan]drafter[/], [green]retrieval level[/], plain = full-cache verifier"


def parse_args(argv) -> ChatOptions:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--book", required=True, help="a UTF-8 text file")
    add_model_args(p)
    add_engine_args(p, adaptive=True)
    g = p.add_argument_group("chat")
    g.add_argument("--room", type=int, default=2048, help="tokens kept for the conversation after the book "
                   "(default %(default)s); /reset frees them")
    g.add_argument("--cache-dir", default=None, help="where prefilled books are kept "
                   "(default $XDG_CACHE_HOME/triforce-chat or ~/.cache/triforce-chat)")
    g.add_argument("--no-cache", action="store_true", help="neither read nor write a saved cache")
    g.add_argument("--show-levels", action="store_true", help="colour each token by the level that produced it")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    args = p.parse_args(argv)
    if args.room < 1:  # a UserError, like every other refused setting: one line starting "error:"
        raise UserError(f"--room must be a positive number of tokens (got {args.room})")
    if args.context is not None and args.context < 1:
        raise UserError(f"--context must be positive (got {args.context})")
    return ChatOptions(run_config(args, sampling="checkpoint"), args.book, args.room, args.cache_dir, args.no_cache, args.show_levels)


# ------------------------------------------------------------------------------- conversation
@dataclass
class Answer:
    question: str
    tokens: list[int]
    text: str
    status: str  # "stop" (end of turn), "length" (--max-new-tokens) or "interrupted" (Ctrl-C)
    seconds: float
    stats: Stats = field(repr=False)


class Chat:
    """The conversation over a prefilled book: turns are appended to the generator's caches."""

    def __init__(self, gen, tokenizer, book: Book, queries, stops: frozenset, session=None):
        self.gen, self.tok, self.book, self.queries, self.stops = gen, tokenizer, book, queries, stops
        self.session = session
        self.is_main = session is None or session.is_main  # under torchrun only rank 0 writes files
        self.out = sys.stdout if session is None else session.stdout
        dist = session.dist if session is not None else None
        self.share = dist.share if dist is not None else (lambda read: read())  # rank 0 reads the terminal
        self.turns: list[Answer] = []  # the conversation the caches hold
        self.log: list[Answer | None] = []  # everything said, None marking a /reset (for /save)
        self.last: Answer | None = None
        gen.resume(book.prompt, queries)

    def ask(self, question: str, on_tokens=None) -> Answer:
        """Answer one question. A Ctrl-C while the question is read raises KeyboardInterrupt with
        the turn dropped; one during the answer ends it there (status 'interrupted'). Either way the
        caches hold exactly the conversation so far, so the next answer is still lossless."""
        gen = self.gen
        ids = (self.book.fmt.closing(self.turns[-1].tokens) if self.turns else []) + self.book.fmt.question(question)
        before = len(gen.context)
        if before + len(ids) + gen.cfg.max_new_tokens > gen.max_len:
            raise UserError(f"the conversation has used its {gen.max_len - len(self.book.prompt):,} tokens of "
                            f"room: /reset keeps the book and starts over (or restart with a larger --room)")
        gen.reset_stats()
        start = time.perf_counter()
        try:
            gen.extend(ids)
        except KeyboardInterrupt:
            with held_interrupts():
                gen.truncate(before)
            raise
        first = len(gen.context) - 1  # extend sampled the answer's first token
        received: list[int] = []

        def collect(new, levels):
            received.extend(new)
            if on_tokens is not None:
                on_tokens(new, levels)

        decode_start = time.perf_counter()
        status = "interrupted"
        try:
            gen.generate(on_tokens=collect, stop_ids=self.stops)
            status = "stop" if received and received[-1] in self.stops else "length"
        except KeyboardInterrupt:
            pass
        with held_interrupts():  # a second Ctrl-C must not leave the caches half-repaired
            if len(gen.context) != first + len(received):
                gen.truncate(first + len(received))  # drop tokens past the stop, or not yet shown
            if status == "interrupted":
                _count_decode(gen.stats, len(received), time.perf_counter() - decode_start)
        text = self.tok.decode(received, skip_special_tokens=True).strip()
        answer = Answer(question, received, text, status, time.perf_counter() - start, gen.stats)
        self.turns.append(answer)
        self.log.append(answer)
        self.last = answer
        return answer

    def reset(self) -> None:
        """Back to the book alone: the conversation was only appended, so the book's K/V are intact."""
        with held_interrupts():
            self.gen.resume(self.book.prompt, self.queries)
        self.turns = []
        self.log.append(None)

    def transcript(self) -> str:
        lines = [f"# Chat about {self.book.name}", ""]
        for a in self.log:
            if a is None:
                lines += ["---", "*(conversation reset)*", ""]
            else:
                end = {"interrupted": " *(stopped)*", "length": " *(cut at --max-new-tokens)*"}.get(a.status, "")
                lines += ["**You:** " + a.question, "", "**Assistant:** " + a.text + end, ""]
        return "\n".join(lines).rstrip() + "\n"

    def close(self) -> None:
        if self.session is not None:
            self.session.close()


def _count_decode(stats: Stats, tokens: int, seconds: float) -> None:
    """generate() records nothing when interrupted; /stats should still describe the partial answer."""
    stats.new_tokens, stats.decode_tokens, stats.decode_seconds = tokens, max(tokens - 1, 0), seconds


@contextmanager
def held_interrupts():
    """Ignore Ctrl-C while caches are made consistent (signals can only be handled in the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda *_: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


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
    """Writes an answer as its tokens arrive; decoding the whole answer each time keeps multi-token
    characters and spacing right (a piece ending in U+FFFD waits for the rest of its character)."""

    def __init__(self, tok, out, colour: bool):
        self.tok, self.out, self.colour = tok, out, colour
        self.tokens: list[int] = []
        self.shown = 0

    def __call__(self, new: list[int], levels: list[str]) -> None:
        for token, level in zip(new, levels):
            self.tokens.append(token)
            text = self.tok.decode(self.tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            if text.endswith("\ufffd"):
                continue
            piece, self.shown = text[self.shown:], len(text)
            if piece and self.colour and level in COLOURS:
                piece = f"{COLOURS[level]}{piece}\x1b[0m"
            self.out.write(piece)
        self.out.flush()


# ------------------------------------------------------------------------------------- the REPL
def repl(chat: Chat, stdin, out, show_levels: bool = False) -> int:
    """Read questions and commands until /quit, end of input or Ctrl-C at the prompt."""
    console = Console(file=out, highlight=False, soft_wrap=True, force_terminal=show_levels or None)
    console.print(f"[dim]Ask about {escape(chat.book.name)}. /help lists the commands; Ctrl-C stops an answer, "
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
        console.print(f"[red]{escape(str(e))}[/]")
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
    """Everything before the first question: book, model, and the book's KV cache."""
    console = Console(stderr=True, quiet=int(os.environ.get("RANK", "0")) != 0)
    run = opts.run
    ModelConfig.from_folder(run.model)  # a missing or broken model folder: one clear line, before any work
    text = read_text(opts.book, "book")  # so is a bad book file: before the tokenizer's slow import
    tok = load_tokenizer(run.model)
    if interactive is None:
        interactive = sys.stdin.isatty() and int(os.environ.get("WORLD_SIZE", "1")) == 1
    book = prepare_book(opts, tok, console, interactive, text)
    total = len(book.prompt) + opts.room
    # the session sizes RoPE, the memory check and the model for "prompt + new tokens": for a chat
    # that is the book plus the conversation's room, and the book is already cut to --context
    run, cfg = generation_plan(run, len(book.prompt), lambda note: console.print(f"[yellow]note:[/] {escape(as_flags(note))}"))  # bad settings are refused before the weights load
    session = open_session(replace(run, max_new_tokens=total, context=None), None, modes=(run.mode,), tokenizer=tok)
    gen = session.generator(cfg, max_len=total)
    queries = load_or_prefill(opts, session, gen, book, console)
    chat = Chat(gen, session.tokenizer, book, queries, stop_ids(tok, book.fmt, run.model), session)
    console.print(f"ready in {time.perf_counter() - _T0:.1f} s")
    return chat


def main(argv=None) -> int:
    opts = parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        # run_cli turns SIGTERM into a Ctrl-C, which here would only stop an answer: quit instead
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    chat = start(opts)
    if not chat.is_main and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # other ranks follow rank 0's input, not the keyboard
    try:
        return repl(chat, sys.stdin, chat.out, opts.show_levels)
    finally:
        chat.close()


def cli() -> None:
    """Console entry point (triforce-chat, python -m triforce chat)."""
    sys.exit(run_cli(main))


if __name__ == "__main__":
    cli()
