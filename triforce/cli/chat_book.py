"""chat.py's book: read, tokenized and wrapped in the model's chat template, then its KV cache
prefilled once and kept on disk (keyed by model, dtype, book and settings), so the next start on
the same book loads it instead of prefilling."""
from __future__ import annotations

import hashlib
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.markup import escape

from triforce.cli.common import RunConfig, context_positions, read_text
from triforce.cli.progress import prefill_progress
from triforce.speculative import ModelConfig, UserError, kvfile

SYSTEM = ("You are a helpful assistant. The user wants to talk about the book {name}, given below. Answer "
          "their questions from the book's text, quote it where that helps, and say so when the book does not tell.")
TRUNCATED = " Only the end of the book fits: the text below is its last {kept:,} tokens."
MARKS = {"book": "@@BOOK@@", "question": "@@QUESTION@@", "answer": "@@ANSWER@@"}
# An interrupted prefill loses at most this much work; a checkpoint of a few thousand tokens costs
# well under a second to write, next to tens of seconds of prefill on a CPU
CHECKPOINT_SECONDS = float(os.environ.get("SPEC_CHECKPOINT_SECONDS", "30"))
PLAIN = ("{system}\n\n", "\n\n", "User: ", "\nAssistant:", "\n\n")  # for tokenizers without a chat template


@dataclass(frozen=True)
class ChatOptions:
    """chat.py's command line: the run, and what the book and its saved cache need."""
    run: RunConfig
    book: str  # the book's file
    room: int  # tokens kept for the conversation after the book
    cache_dir: str | None
    no_cache: bool
    show_levels: bool


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


def prepare_book(opts: ChatOptions, tok, console, interactive: bool, text: str | None = None) -> Book:
    """Read (unless `text` is the book, already read), tokenize and wrap the book; tell the user its
    size and whether it fits. It is never cut silently: a book too long is an error naming
    --context, or, at a terminal, a question."""
    path, room = Path(opts.book), opts.room
    text = read_text(path, "book") if text is None else text
    ids = tok.encode(text, add_special_tokens=False, split_special_tokens=True)
    digest = hashlib.sha256(text.encode()).hexdigest()
    book = wrap_book(tok, path.name, digest, ids, opts.run.context)
    cfg = ModelConfig.from_folder(opts.run.model)
    limit = context_positions(cfg, opts.run.rope_scaling)
    cut = f", keeping the last {book.kept:,} (--context)" if book.kept < book.tokens else ""
    console.print(f"[bold]{escape(path.name)}[/]: {book.tokens:,} tokens{cut}; {len(book.prompt):,} with the system "
                  f"prompt and chat template{'' if book.fmt.templated else ' (plain: the tokenizer has none)'}")
    if len(book.prompt) + room <= limit:
        reach = (f"the model's {cfg.max_positions:,} positions" if len(book.prompt) + room <= cfg.max_positions
                 else f"{limit:,} positions with RoPE scaling")
        console.print(f"fits {reach}, with {room:,} tokens for the conversation")
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
    stretch = {"none": "; or drop --rope-scaling none (YaRN then stretches the positions)",
               "auto": ""}.get(opts.run.rope_scaling, "; or raise the --rope-scaling factor")
    raise UserError(f"{problem}; rerun with --context {fit} to keep the last {fit:,} tokens of the book{stretch}")


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
    saved cache exists (on every rank), else by prefilling (and saving for next time). The prefill
    writes checkpoints as it goes (beside the saved cache), so an interrupted one resumes."""
    path = key = None
    if not opts.no_cache:
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
        queries = _prefill(gen, book, session, console, path, key)
    return queries


def _prefill(gen, book: Book, session, console, path: Path | None, key: dict | None) -> list[torch.Tensor]:
    """Prefill the book, resuming from (and writing) checkpoints when there is a place to keep them."""
    checkpoints = None
    if path is not None:
        checkpoints = kvfile.Checkpoints(path.with_suffix(".partial"), gen, key, book.prompt,
                                         every_seconds=CHECKPOINT_SECONDS)
        resumed = checkpoints.resume()
        dist = session.dist
        if dist is not None and not dist.all_agree(resumed == dist.share(lambda: resumed)):
            # ranks feed the same passes in lockstep: unless all resume from the same token, none does
            gen.full.rollback(0)
            checkpoints.saved = resumed = 0
        if resumed:
            console.print(f"resuming the prefill from a checkpoint: {resumed:,} of {len(book.prompt):,} tokens "
                          f"done ({resumed / len(book.prompt):.0%})")
    done = checkpoints.saved if checkpoints else 0
    start = time.perf_counter()
    progress, advance = prefill_progress(console, len(book.prompt), done=done)

    def step(n: int) -> None:
        if session.is_main:
            advance(n)
        if checkpoints is not None:
            checkpoints.after(n)

    with progress:
        gen.prefill(book.prompt, progress=step)
    seconds = time.perf_counter() - start
    computed = len(book.prompt) - done
    console.print(f"prefilled {computed:,} tokens in {seconds:.1f} s ({computed / seconds:,.0f} tokens/s)"
                  + (f", {done:,} more from checkpoints" if done else ""))
    queries = kvfile.last_queries(gen)
    if path is not None:
        _save(path, gen, book, queries, key, console)
        checkpoints.discard()  # the saved file holds it all now
    return queries


def _save(path: Path, gen, book: Book, queries, key: dict, console) -> None:
    shape = gen.full.cache.shape
    size = shape.bytes_per_token * len(book.prompt)
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
