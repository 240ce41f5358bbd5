"""A conversation about a prefilled book, as a library class: each question is appended to the
generator's caches (the book is never prefilled again), each answer streams through a callback.

    chat = open_chat(ChatOptions(Settings(model=...), "book.txt", room=2048, cache_dir=None, no_cache=False))
    answer = chat.ask("Who is the heroine?", on_tokens=...)
    chat.reset(); chat.transcript(); chat.close()
"""
from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from triforce.model.errors import UserError
from triforce.speculative.stats import Stats

from .book import (Book, ChatOptions, Reporter, book_ids, cache_root, choose_chat_model, load_or_prefill, prepare_book,
                   read_book, reading_warning, saved_cache, stop_ids)
from .book_memo import BookMemo
from . import learned
from .defaults import MODELS_DIR
from .prompt_cache import keep_window, kept_window
from .settings import generation_plan, with_sampling
from .text import unwrapped


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

    def __init__(self, gen, tokenizer, book: Book, queries, stops: frozenset, session=None,
                 learned_file: Path | None = None, window: dict | None = None):
        """`learned_file`: where what the adaptive chooser learns is kept for the next start on this
        book (runtime/learned.py); read here, rewritten after every answer. `window`: the drafter's
        StreamingLLM cache over the book (Generator.drafter_window), else computed here; a /reset
        restores it instead of computing it again."""
        self.gen, self.tok, self.book, self.queries, self.stops = gen, tokenizer, book, queries, stops
        self.session, self.learned_file = session, learned_file
        self.threads = torch.get_num_threads()
        self.is_main = session is None or session.is_main  # under torchrun only rank 0 writes files
        dist = session.dist if session is not None else None
        self.share = dist.share_input if dist is not None else (lambda read: read())  # rank 0 reads the terminal
        # under tensor parallelism a Ctrl-C (triforce-tp passes it to every rank) stops every rank's
        # answer after the same round (agreed_stop): a rank that stopped alone, or inside a forward,
        # would leave the others waiting in a collective
        self.group = dist if dist is not None and dist.group is not None else None
        self.turns: list[Answer] = []  # the conversation the caches hold
        self.log: list[Answer | None] = []  # everything said, None marking a /reset (for /save)
        self.last: Answer | None = None
        gen.resume(book.prompt, queries, window=window)
        self.window = window or gen.drafter_window()
        self.relearned = learned_file is not None and learned.load(learned_file, gen, self.threads)

    def ask(self, question: str, on_tokens=None) -> Answer:
        """Answer one question. A Ctrl-C while the question is read raises KeyboardInterrupt with
        the turn dropped; one during the answer ends it there (status 'interrupted'). Either way the
        caches hold exactly the conversation so far, so the next answer is still lossless."""
        gen = self.gen
        ids = (self.book.fmt.closing(self.turns[-1].tokens) if self.turns else []) + self.book.fmt.question(question)
        before = len(gen.context)
        if before + len(ids) + gen.cfg.max_new_tokens > gen.max_len:
            raise UserError(f"the conversation has used its {gen.max_len - len(self.book.prompt):,} tokens of "
                            f"room: /reset keeps the book and starts over (or restart with a larger ChatOptions.room)")
        gen.reset_stats()
        start = time.perf_counter()
        with agreed_stop(self.group) as stop:
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
                stop.check()

            decode_start = time.perf_counter()
            status = "interrupted"
            try:
                gen.generate(on_tokens=collect, stop_ids=self.stops)
                status = "stop" if received and received[-1] in self.stops else "length"
            except KeyboardInterrupt:
                pass
            # still inside agreed_stop: under tensor parallelism a late Ctrl-C must not skip, on one
            # rank only, what the conversation keeps of this turn
            with held_interrupts():  # a second Ctrl-C must not leave the caches half-repaired
                if len(gen.context) != first + len(received):
                    gen.truncate(first + len(received))  # drop tokens past the stop, or not yet shown
                if status == "interrupted":
                    _count_decode(gen.stats, len(received), time.perf_counter() - decode_start)
            text = self.tok.decode(received, skip_special_tokens=True, clean_up_tokenization_spaces=False).strip()
            answer = Answer(question, received, text, status, time.perf_counter() - start, gen.stats)
            self.turns.append(answer)
            self.log.append(answer)
            self.last = answer
            if self.learned_file is not None:
                learned.save(self.learned_file, gen, self.threads)
        return answer

    def reset(self) -> None:
        """Back to the book alone: the conversation was only appended, so the book's K/V are intact."""
        with held_interrupts():  # what the chooser learned of this book and machine still holds
            self.gen.resume(self.book.prompt, self.queries, learned=True, window=self.window)
        self.turns = []
        self.log.append(None)

    def transcript(self) -> str:
        lines = [f"# Chat about {self.book.name or 'a book'}", ""]
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


class AgreedStop:
    """A Ctrl-C noted rather than raised; check() raises KeyboardInterrupt on every rank once any
    rank has noted one (an all-reduce of a flag, after each round's tokens)."""

    def __init__(self, group):
        self.group, self.asked = group, False

    def check(self) -> None:
        if self.group is not None and not self.group.all_agree(not self.asked):
            raise KeyboardInterrupt


@contextmanager
def agreed_stop(group):
    """While an answer is made under tensor parallelism (`group`, else nothing changes): a Ctrl-C
    only notes a stop, taken by every rank at the same round (AgreedStop.check); raised where it
    came, it could leave a forward half run between two all-reduces."""
    stop = AgreedStop(group)
    if group is None or threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = signal.signal(signal.SIGINT, lambda *_: setattr(stop, "asked", True))
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


def refer_lookups(gen, tok, text: str, report: Reporter, memo: BookMemo | None = None) -> None:
    """Where the run looks drafts up, have it search the book with its line wraps undone too, beside
    the conversation: a quotation then matches across the book's line breaks (a book of 100K tokens
    tokenizes again in about a second)."""
    if gen.lookup is None:
        return
    flat, joined = unwrapped(text)
    if joined and gen.refer_lookups_to(memo.ids(flat, book_ids(tok)) if memo is not None else book_ids(tok)(flat)):
        report.note(f"lookups also search the book with its {joined:,} line wraps undone")


def open_chat(opts: ChatOptions, report: Reporter | None = None, confirm: Callable[[str], bool] | None = None,
              tokenizer=None, open_session=None) -> Chat:
    """Everything before the first question: the book (read and checked before any weights load),
    the model, and the book's KV cache (loaded from disk, or prefilled and saved). `confirm` may ask
    the user whether to cut a book too long (None: refuse, naming the setting); `open_session(run,
    tokenizer)` makes the Session (the command line's shows a spinner), by default a plain one."""
    from triforce.model.config import ModelConfig
    from triforce.model.loader import load_tokenizer

    from .session import Session

    report = report or Reporter()
    text = read_book(opts.book, report)  # a bad book file: one clear line, before anything loads
    run = opts.run
    if run.model is None:  # the strongest prepared model that reads a book this long
        model, why = choose_chat_model(len(text), opts.room, MODELS_DIR)
        run = replace(run, model=model)
        report.note(why)
    ModelConfig.from_folder(run.model)  # so is a missing or broken model folder
    run = with_sampling(run, "checkpoint")  # the checkpoint's own settings: lossless, no penalties
    opts = replace(opts, run=run)
    tok = tokenizer or load_tokenizer(run.model)
    # the folder's own tokenizer, unchanged: what its files compute, a start on them computed before
    memo = BookMemo(cache_root(opts.cache_dir), run.model) if tokenizer is None and not opts.no_cache else None
    book = prepare_book(opts, tok, report, confirm, text, memo)
    warning = reading_warning(run.model, book.tokens)
    if warning:
        report.warn(warning)
    total = len(book.prompt) + opts.room
    # the session sizes RoPE, the memory check and the model for "prompt + new tokens": for a chat
    # that is the book plus the conversation's room, and the book is already cut to Settings.context
    run, cfg = generation_plan(run, len(book.prompt), report.note)  # bad settings refused before the weights load
    sized = replace(run, max_new_tokens=total, context=None)
    if open_session is None:
        session = Session(sized, None, tok, say=report.note).load((run.mode,))
    else:
        session = open_session(sized, tok)
    gen = session.generator(cfg, max_len=total)
    queries = load_or_prefill(opts, session, gen, book, report)
    refer_lookups(gen, tok, text, report, memo)
    cache_file, key = saved_cache(opts, session, book)
    # the drafter's window over the book: the prefill's, else kept beside the saved book (0.5-0.75 s of
    # a SmolLM2 start to compute again), else computed by the Chat and kept there for the next start
    window = gen.drafter_window() or (kept_window(session, cache_file, key) if cache_file is not None else None)
    chat = Chat(gen, tok, book, queries, stop_ids(book.fmt, run.model), session,
                learned.state_path(cache_file) if cache_file is not None else None, window)
    if cache_file is not None:
        keep_window(session, chat.window, cache_file, key)
    if chat.relearned:
        report.note("starting from what the last chat on this book learned of each mode's speed")
    return chat
