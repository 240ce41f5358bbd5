#!/usr/bin/env python
"""Chat about a book: prefill it once (and keep it on disk), then ask questions.

    python scripts/chat.py --book persuasion.txt --context 6000
    python scripts/chat.py --book novel.txt --model models/qwen2.5-coder-1.5b --show-levels

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

import argparse  # noqa: E402
import hashlib  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

try:  # importing torch takes seconds: a Ctrl-C then is an ordinary interrupt, not a traceback
    import torch  # noqa: E402
    from rich.console import Console  # noqa: E402
    from rich.markup import escape  # noqa: E402

    from scripts.common import (RunConfig, add_engine_args, add_model_args, checked_generation_config,  # noqa: E402
                                prefill_progress, read_text, replace, resolve_rope, run_cli, run_config)
    from scripts.session import open_session, print_stats_table  # noqa: E402
    from speculative import ModelConfig, UserError, kvfile  # noqa: E402
except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    sys.exit(130)
from model.loader import load_tokenizer  # noqa: E402
from speculative.stats import Stats  # noqa: E402

SYSTEM = ("You are a helpful assistant. The user wants to talk about the book {name}, given below. Answer "
          "their questions from the book's text, quote it where that helps, and say so when the book does not tell.")
TRUNCATED = " Only the end of the book fits: the text below is its last {kept:,} tokens."
MARKS = {"book": "@@BOOK@@", "question": "@@QUESTION@@", "answer": "@@ANSWER@@"}
PLAIN = ("{system}\n\n", "\n\n", "User: ", "\nAssistant:", "\n\n")  # for tokenizers without a chat template
PROMPT = "> "
HELP = """[bold]/stats[/]       statistics of the last answer
[bold]/reset[/]       drop the conversation, keep the book
[bold]/save FILE[/]   write the transcript to FILE
[bold]/help[/]        this list
[bold]/quit[/]        leave (Ctrl-D works too)
Ctrl-C stops an answer and returns to the prompt."""
COLOURS = {"draft": "\x1b[36m", "middle": "\x1b[32m"}  # the verifier's own tokens stay plain
LEGEND = "colours: [cyan]drafter[/], [green]retrieval level[/], plain = full-cache verifier"


@dataclass(frozen=True)
class ChatOptions:
    run: RunConfig
    book: str  # the book's file
    room: int  # tokens kept for the conversation after the book
    cache_dir: str | None
    no_cache: bool
    show_levels: bool


def parse_args(argv) -> ChatOptions:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--book", required=True, help="a UTF-8 text file")
    add_model_args(p)
    add_engine_args(p)
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
    return ChatOptions(run_config(args), args.book, args.room, args.cache_dir, args.no_cache, args.show_levels)


# ------------------------------------------------------------------------------------ the prompt
class ChatFormat:
    """The model's chat template cut into the pieces a growing conversation appends, as text:
    book head/tail (the system message around the book), question head/tail (a user turn and the
    assistant header) and the answer end (what closes an assistant turn, e.g. <|im_end|>\\n)."""

    def __init__(self, tokenizer, system: str):
        self.tok = tokenizer
        parts = _template_parts(tokenizer, system)
        self.templated = parts is not None
        head, self.book_tail, self.turn_head, self.turn_tail, self.answer_end = parts or PLAIN
        self.book_head = head.format(system=system) if parts is None else head

    def encode(self, text: str) -> list[int]:
        # user text is never read as control tokens: a book quoting "<|im_end|>" stays text
        return self.tok.encode(text, add_special_tokens=False, split_special_tokens=True) if text else []

    def markup(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False) if text else []

    def book(self, book_ids: list[int]) -> list[int]:
        return self.markup(self.book_head) + book_ids + self.markup(self.book_tail)

    def question(self, text: str) -> list[int]:
        return self.markup(self.turn_head) + self.encode(text) + self.markup(self.turn_tail)

    def closing(self, answer: list[int]) -> list[int]:
        """Tokens that close an assistant turn which produced `answer` (its end token may be there)."""
        end = self.markup(self.answer_end)
        return end[1:] if end and answer and answer[-1] == end[0] else end


def _template_parts(tok, system: str):
    if not getattr(tok, "chat_template", None):
        return None
    sys_msg = {"role": "system", "content": f"{system}\n\n{MARKS['book']}"}
    user = {"role": "user", "content": MARKS["question"]}
    render = lambda msgs, gen: tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)  # noqa: E731
    try:
        a = render([sys_msg], False)
        b = render([sys_msg, user], True)
        c = render([sys_msg, user, {"role": "assistant", "content": MARKS["answer"]}], False)
    except Exception:  # templates without a system role raise; the plain format still works
        return None
    if a.count(MARKS["book"]) != 1 or not b.startswith(a) or b.count(MARKS["question"]) != 1 \
            or c.count(MARKS["answer"]) != 1:
        return None
    head, tail = a.split(MARKS["book"])
    q_head, q_tail = b[len(a):].split(MARKS["question"])
    return head, tail, q_head, q_tail, c.split(MARKS["answer"])[1] or "\n"


def stop_ids(tok, fmt: ChatFormat, model_dir: str) -> frozenset:
    """EOS, the template's end-of-turn token and generation_config.json's eos ids."""
    import json

    ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    end = fmt.markup(fmt.answer_end)
    if end and end[0] in tok.all_special_ids:
        ids.add(end[0])
    try:
        eos = json.loads((Path(model_dir) / "generation_config.json").read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    except (OSError, ValueError):
        pass
    return frozenset(ids)


@dataclass
class Book:
    name: str
    digest: str  # sha256 of the file
    tokens: int  # the whole book
    kept: int  # the book tokens in the prompt
    prompt: list[int]
    fmt: ChatFormat


def wrap_book(tok, name: str, digest: str, ids: list[int], keep: int | None) -> Book:
    kept = len(ids) if keep is None else min(keep, len(ids))
    system = SYSTEM.format(name=name) + (TRUNCATED.format(kept=kept) if kept < len(ids) else "")
    fmt = ChatFormat(tok, system)
    return Book(name, digest, len(ids), kept, fmt.book(ids[len(ids) - kept:]), fmt)


def context_limit(run: RunConfig) -> int:
    """Positions the model takes: its own (with its config's scaling), or those of an explicit
    --rope-scaling yarn:F / linear:F. 'auto' does not stretch a chat: the user decides."""
    cfg = ModelConfig.from_folder(run.model)
    if run.rope_scaling in ("auto", "none"):
        return cfg.max_positions
    return resolve_rope(cfg, 0, run.rope_scaling).max_positions


def prepare_book(opts: ChatOptions, tok, console, interactive: bool, text: str | None = None) -> Book:
    """Read (unless `text` is the book, already read), tokenize and wrap the book; tell the user its
    size and whether it fits. It is never cut silently: a book too long is an error naming
    --context, or, at a terminal, a question."""
    path, room = Path(opts.book), opts.room
    text = read_text(path, "book") if text is None else text
    ids = tok.encode(text, add_special_tokens=False, split_special_tokens=True)
    digest = hashlib.sha256(text.encode()).hexdigest()
    book = wrap_book(tok, path.name, digest, ids, opts.run.context)
    limit = context_limit(opts.run)
    cut = f", keeping the last {book.kept:,} (--context)" if book.kept < book.tokens else ""
    console.print(f"[bold]{escape(path.name)}[/]: {book.tokens:,} tokens{cut}; {len(book.prompt):,} with the system "
                  f"prompt and chat template{'' if book.fmt.templated else ' (plain: the tokenizer has none)'}")
    if len(book.prompt) + room <= limit:
        console.print(f"fits the model's {limit:,}-token context, with {room:,} tokens for the conversation")
        return book
    # the system prompt's size once the book is cut (the cut adds a note saying so)
    overhead = len(wrap_book(tok, path.name, digest, ids + [0], len(ids)).prompt) - len(ids)
    fit = (limit - room - overhead) // 100 * 100
    problem = (f"{path.name} does not fit: {len(book.prompt):,} tokens plus {room:,} for the conversation "
               f"exceed the model's {limit:,}-token context")
    if fit < 1:
        raise UserError(f"{problem}; lower --room")
    console.print(f"[yellow]{escape(problem)}.[/]")
    if interactive and _confirm(f"Keep only the last {fit:,} tokens of the book (--context {fit})? [y/N] "):
        book = wrap_book(tok, path.name, digest, ids, fit)
        console.print(f"keeping the last {book.kept:,} tokens of the book ({len(book.prompt):,} with the template); "
                      f"pass --context {fit} to skip this question next time")
        return book
    raise UserError(f"{problem}; rerun with --context {fit} to keep the last {fit:,} tokens of the book, "
                    f"or stretch the positions with --rope-scaling yarn:F")


def _confirm(question: str) -> bool:
    try:
        return input(question).strip().lower() in ("y", "yes")
    except (EOFError, KeyboardInterrupt):
        return False


# ------------------------------------------------------------------------------ prefill or load
def cache_key(session, book: Book) -> dict:
    """Everything the saved K/V depends on. The prompt ids cover book, --context, template and
    tokenizer; the weights are identified by size and mtime (hashing gigabytes would cost more
    than the prefill saves)."""
    run = session.run
    model = Path(run.model).resolve()
    weights = sorted([p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in model.glob("*.safetensors"))
    dist = session.dist
    return {"model": str(model), "config": kvfile.file_digest(model / "config.json"), "weights": weights,
            "dtype": run.dtype, "device": torch.device(session.device).type, "torch": torch.__version__,
            "rope_scaling": session.config.rope_scaling, "prefill_chunk": run.prefill_chunk,
            "tp": [dist.rank, dist.world_size] if dist else [0, 1], "book": book.digest, "context": book.kept,
            "prompt": hashlib.sha256(torch.tensor(book.prompt).numpy().tobytes()).hexdigest()}


def cache_path(cache_dir: str | None, book: Book, key: dict) -> Path:
    root = cache_dir or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "triforce-chat"
    digest = hashlib.sha256(kvfile.key_text(key).encode()).hexdigest()[:16]
    stem = "".join(c if c.isalnum() or c in "-_" else "_" for c in Path(book.name).stem)[:40]
    rank = f"-rank{key['tp'][0]}" if key["tp"][1] > 1 else ""
    return Path(root).expanduser() / f"{stem}-{digest}{rank}.safetensors"


def load_or_prefill(opts: ChatOptions, session, gen, book: Book, console) -> list[torch.Tensor]:
    """The book's last-token queries, with its K/V in gen's full cache: from disk when a valid
    saved cache exists (on every rank), else by prefilling (and saving for next time)."""
    path = None
    if opts.no_cache:
        pass
    elif not kvfile.supported(gen):
        console.print("[yellow]note:[/] the saved-cache file works with the in-memory cache only; prefilling")
    else:
        key = cache_key(session, book)
        path = cache_path(opts.cache_dir, book, key)
    queries = None
    if path is not None and path.exists():
        start = time.perf_counter()
        try:
            queries = kvfile.load(path, gen, key, book.prompt)
            console.print(f"loaded the prefilled book from {escape(str(path))} in {time.perf_counter() - start:.1f} s")
        except kvfile.CacheInvalid as e:
            console.print(f"[yellow]the saved cache {escape(str(path))} {escape(str(e))}: rebuilding it[/]")
    if session.dist is not None and not session.dist.all_agree(queries is not None):
        if queries is not None:  # the failing rank's console is quiet: say why this rank prefills
            console.print("[yellow]another tensor-parallel rank's saved cache is unusable: rebuilding them all[/]")
        queries = None
    if queries is None:
        start = time.perf_counter()
        progress, advance = prefill_progress(console, len(book.prompt))
        with progress:
            gen.prefill(book.prompt, progress=advance if session.is_main else None)
        seconds = time.perf_counter() - start
        console.print(f"prefilled {len(book.prompt):,} tokens in {seconds:.1f} s "
                      f"({len(book.prompt) / seconds:,.0f} tokens/s)")
        queries = kvfile.last_queries(gen)
        if path is not None:
            _save(path, gen, book, queries, key, console)
    return queries


def _save(path: Path, gen, book: Book, queries, key: dict, console) -> None:
    cache = gen.full.cache
    size = 2 * cache.k[:, :, :len(book.prompt)].numel() * cache.k.element_size()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if shutil.disk_usage(path.parent).free < size + (256 << 20):
            console.print(f"[yellow]not saving the prefilled book: {_mib(size)} needed, "
                          f"{escape(str(path.parent))} is short of space (--cache-dir elsewhere)[/]")
            return
        size = kvfile.save(path, gen, book.prompt, queries, key)
        console.print(f"saved it to {escape(str(path))} ({_mib(size)}): the next start on this book skips the prefill")
    except OSError as e:
        console.print(f"[yellow]could not save the prefilled book ({escape(str(e))}); the next start prefills again[/]")


def _mib(size: int) -> str:
    return f"{size / 2**20:,.1f} MiB"


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
            lower = chat.session.run.lower_weights if chat.session is not None else "same"
            print_stats_table(console, chat.gen.mode, chat.last.stats, lower)
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
    cfg = checked_generation_config(run, len(book.prompt), console)  # bad settings are refused before the weights load
    session = open_session(replace(run, max_new_tokens=total, context=None), None)
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


def cli() -> int:
    """Console entry point (setup.py: triforce-chat=scripts.chat:cli)."""
    return run_cli(main)


if __name__ == "__main__":
    sys.exit(cli())
