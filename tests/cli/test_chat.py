"""chat.py on a tiny random model: the REPL, Ctrl-C, /reset and the saved KV cache.

Models run in float64 so "the same tokens as a fresh run" is exact whatever the chunking.
"""
import io
import os
import json
from functools import partial
import random
import re
import threading
from dataclasses import replace

import pytest
import torch

from triforce.parallel import TensorParallel
from pathlib import Path

from triforce.cli import chat
from triforce.model.loader import load_tokenizer
from triforce.runtime import book as chat_book
from triforce.cli.common import run_cli
from triforce.speculative import Generator, kvfile

from ..conftest import save_tiny, save_tokenizer
from ..runtime.test_prompt_cache import kept_files


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("book") / "book.txt"
    path.write_text(" ".join(f"t{rng.randrange(3, 64)}" for _ in range(400)))
    return path


def make_args(folder, book, cache, *extra):
    opts = chat.parse_args(["--book", str(book), "--model", str(folder), "--draft", "self", "--max-new-tokens", "14",
                            "--room", "160", "--gamma1", "2", "--gamma2", "3", "--draft-window", "32",
                            "--cache-dir", str(cache), "--no-adaptive", *extra])  # mechanics of one mode
    return replace(opts, run=replace(opts.run, dtype="float64"))  # not a command-line choice; exact comparisons need it


@pytest.fixture
def start(tiny_folder, book, tmp_path):
    def start(*extra, cache=tmp_path / "cache", stops=None):
        c = chat.start(make_args(tiny_folder, book, cache, *extra), interactive=False)
        if stops is not None:
            c.stops = stops  # a random model says EOS early; tests that need long answers drop it
        return c
    return start


def fresh_answer(c, context, n):
    """What a fresh generator (plain autoregressive decoding) says after `context`."""
    g = Generator(c.gen.models, replace(c.gen.cfg, max_new_tokens=n), "autoregressive", max_len=len(context) + n)
    g.prefill(list(context))
    return g.generate(stop_ids=c.stops)


def conversation(c):
    """The tokens the caches should hold: the book, then each turn and its (possibly cut) answer."""
    ids, previous = list(c.book.prompt), None
    for turn in c.turns:
        ids += (c.book.fmt.closing(previous.tokens) if previous else []) + c.book.fmt.question(turn.question)
        ids += turn.tokens
        previous = turn
    return ids


def check_lossless(c, answer):
    assert c.gen.context == conversation(c) and c.gen.committed == len(c.gen.context)
    start = len(c.gen.context) - len(answer.tokens)
    assert c.gen.context[start:] == answer.tokens
    assert answer.tokens == fresh_answer(c, c.gen.context[:start], c.gen.cfg.max_new_tokens)[:len(answer.tokens)]


def run_repl(c, lines, **kw):
    out = io.StringIO()
    rc = chat.repl(c, io.StringIO("".join(line + "\n" for line in lines)), out, **kw)
    return rc, out.getvalue()


# ------------------------------------------------------------------------------------- the REPL
def test_repl_answers_stats_reset_save(start, tmp_path):
    c = start()
    transcript = tmp_path / "talk.md"
    rc, out = run_repl(c, ["t5 t6 t7", "/stats", "/reset", "t5 t6 t7", "/save " + str(transcript), "/help",
                           "/nonsense", "/quit", "never read"])
    assert rc == 0
    assert len(re.findall(r"\d+ tokens · .* tokens/s · acceptance", out)) == 2  # a summary line per answer
    assert "statistic" in out and "full-cache passes" in out  # the /stats table
    assert "int8" not in out  # float64: --lower-weights auto keeps the exact weights
    assert "conversation dropped" in out and "unknown command /nonsense" in out and "/save FILE" in out
    first, second = c.log[0], c.log[2]
    assert c.log[1] is None and first.tokens == second.tokens  # after /reset: as from a fresh start
    assert dict(first.stats.accepted) == dict(second.stats.accepted)  # the same caches, too
    assert len(c.gen.context) == len(c.book.prompt) + len(c.book.fmt.question("t5 t6 t7")) + len(second.tokens)
    text = transcript.read_text()
    assert text.count("**You:** t5 t6 t7") == 2 and "(conversation reset)" in text


def test_end_of_input_and_ctrl_c_at_prompt_exit_cleanly(start):
    c = start()
    assert run_repl(c, [])[0] == 0

    class CtrlC(io.StringIO):
        def readline(self, *a):
            raise KeyboardInterrupt

    assert chat.repl(c, CtrlC(), io.StringIO()) == 0


def test_turns_are_lossless_and_stop_at_end_of_turn(start):
    c = start(stops=frozenset())
    for q in ("t5 t6 t7", "t8 t9", "t10"):
        answer = c.ask(q)
        assert answer.status == "length" and len(answer.tokens) == 14
        check_lossless(c, answer)
    # with a stop id, the answer ends at it and nothing after it stays in the caches
    stop = c.turns[-1].tokens[3]
    c.stops = frozenset({stop})
    answer = c.ask("t11 t12")
    assert answer.status == "stop" and answer.tokens[-1] == stop and stop not in answer.tokens[:-1]
    check_lossless(c, answer)
    assert c.gen.committed == len(c.gen.context)


def test_adaptive_turns_are_lossless_and_say_their_passes(start):
    """chat.py's default: each full pass picks its mode; every turn still equals plain decoding."""
    c = start("--adaptive", stops=frozenset())
    for q in ("t5 t6 t7", "t8 t9"):
        answer = c.ask(q)
        check_lossless(c, answer)
        assert sum(answer.stats.modes.values()) == answer.stats.full_passes
        assert "passes: " in chat.summary(answer, 14)
    assert c.gen.chooser is not None and c.gen.chooser.passes == sum(t.stats.full_passes for t in c.turns)


def test_levels_passed_per_token(start):
    c = start(stops=frozenset())
    seen = []
    answer = c.ask("t5 t6", lambda new, levels: seen.append((list(new), list(levels))))
    assert [t for new, _ in seen for t in new] == answer.tokens
    levels = [lv for new, lvs in seen for lv in lvs[:len(new)]]
    assert len(levels) == len(answer.tokens) and set(levels) <= {"draft", "middle", "verify"}
    accepted = answer.stats.accepted
    assert levels.count("draft") + levels.count("middle") <= accepted["middle->verify"]
    assert levels.count("draft") <= accepted["draft->middle"]


def test_show_levels_colours(start):
    c = start()
    rc, out = run_repl(c, ["t5 t6 t7"], show_levels=True)
    assert rc == 0 and "drafter" in out and "lookup" in out and "\x1b[" in out


def test_looked_up_tokens_are_their_own_level(start, monkeypatch):
    """Adaptive chat with a model drafter: passes with lookups in its place stay lossless, and the
    tokens they propose are shown as the lookup level's (magenta with --show-levels)."""
    from triforce.speculative.adaptive import Chooser, Plan

    plans = [Plan("lookup", 3), Plan("triforce-lookup", 3), Plan("triforce", 3)]
    monkeypatch.setattr(Chooser, "_choose", lambda self: plans[self.passes % 3])
    c = start("--adaptive", stops=frozenset())
    seen = []
    answer = c.ask("t5 t6 t7 t5 t6 t7 t5 t6", lambda new, levels: seen.append((list(new), list(levels))))
    check_lossless(c, answer)
    levels = [lv for new, lvs in seen for lv in lvs[:len(new)]]
    assert set(answer.stats.modes) == {"lookup", "triforce-lookup", "triforce"}
    assert set(levels) <= {"draft", "lookup", "middle", "verify"} and "lookup" in levels
    accepted = answer.stats.accepted
    assert levels.count("lookup") <= accepted["lookup->verify"] + accepted["lookup->middle"]
    assert answer.stats.proposed["lookup->verify"] and answer.stats.proposed["lookup->middle"]


# ------------------------------------------------------------------------------------- Ctrl-C
@pytest.mark.parametrize("k", [1, 6])
def test_ctrl_c_mid_answer_then_lossless(start, k):
    c = start(stops=frozenset())
    shown = []

    def impatient(new, levels):
        shown.extend(new)
        if len(shown) >= k:
            raise KeyboardInterrupt

    stopped = c.ask("t5 t6 t7", impatient)
    assert stopped.status == "interrupted" and stopped.tokens == shown and len(shown) >= k
    assert c.gen.context[-len(shown):] == shown and c.gen.committed == len(c.gen.context)
    answer = c.ask("t8 t9")
    check_lossless(c, answer)
    # the conversation the caches hold: book, turn, the shown part of the answer, turn
    fmt = c.book.fmt
    expected = c.book.prompt + fmt.question("t5 t6 t7") + shown + fmt.closing(shown) + fmt.question("t8 t9")
    assert c.gen.context[:len(expected)] == expected


@pytest.mark.parametrize("at_call", [1, 2, 4, 7, 10, 14])  # prefill, draft, middle, full, middle, full
def test_ctrl_c_inside_a_forward_then_lossless(start, at_call):
    """Ctrl-C lands inside some level's forward (the question's prefill, a draft, a middle or a
    full-cache pass): the next answer is still exactly right."""
    c = start(stops=frozenset())
    c.ask("t3 t4")
    model = c.gen.models.target
    calls = 0

    def forward(*a, **kw):
        nonlocal calls
        calls += 1
        if calls == at_call:
            raise KeyboardInterrupt
        return type(model).forward(model, *a, **kw)

    model.forward = forward
    try:
        try:
            c.ask("t5 t6 t7")
        except KeyboardInterrupt:
            assert at_call == 1  # during the question's prefill: the turn is dropped
    finally:
        del model.forward
    check_lossless(c, c.ask("t8 t9"))


# ------------------------------------------------------------------------------------- KV file
def test_cache_round_trip(start, tmp_path, capsys):
    first = start(stops=frozenset())
    assert "saved it to" in capsys.readouterr().err
    a = first.ask("t5 t6 t7")
    second = start(stops=frozenset())
    assert "loaded the prefilled book" in capsys.readouterr().err
    n = len(first.book.prompt)
    assert torch.equal(first.gen.full.cache.k[:, :, :n], second.gen.full.cache.k[:, :, :n])
    b = second.ask("t5 t6 t7")
    assert a.tokens == b.tokens
    assert dict(a.stats.accepted) == dict(b.stats.accepted) and a.stats.full_passes == b.stats.full_passes
    check_lossless(second, b)
    nocache = start("--no-cache", stops=frozenset())
    assert nocache.ask("t5 t6 t7").tokens == a.tokens


def test_what_the_chooser_learned_is_kept_for_the_next_start(start, tmp_path, capsys):
    """An adaptive chat keeps its chooser's figures beside the saved cache: the next start on the
    book begins from them (no first tries), still lossless; another setting, a damaged file or
    --no-cache start afresh without a word; /reset keeps what was learned. One thread throughout: the
    figures are kept per thread count, and an automatic count follows the load at each start (a
    loaded CI machine gave the second start another count, which rightly started afresh)."""
    start = partial(start, "--threads", "1")
    first = start("--adaptive", stops=frozenset())
    assert not first.relearned
    first.ask("t5 t6 t7")
    kept = sorted((tmp_path / "cache").glob("*.chooser.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text())["state"]["costs"]["verify"]
    capsys.readouterr()
    second = start("--adaptive", stops=frozenset())
    assert second.relearned and "learned of each mode's speed" in capsys.readouterr().err
    assert all(used is not None for used in second.gen.chooser.last_used.values())
    assert second.gen.chooser.summary() == first.gen.chooser.summary()
    check_lossless(second, second.ask("t5 t6 t7"))
    chooser = second.gen.chooser
    second.reset()
    assert second.gen.chooser is chooser
    assert not start("--adaptive", "--gamma2", "2", stops=frozenset()).relearned  # other plans
    kept[0].write_text("{not json")
    assert not start("--adaptive", stops=frozenset()).relearned
    assert not start("--adaptive", "--no-cache", stops=frozenset()).relearned
    assert not start(stops=frozenset()).relearned  # one mode: no chooser, nothing kept or read


@pytest.mark.parametrize("where", ["data", "header", "truncated"])
def test_damaged_cache_is_rebuilt(start, tmp_path, capsys, where):
    reference = start(stops=frozenset()).ask("t5").tokens
    [path] = kept_files(tmp_path / "cache")  # the saved book (the drafter's window beside it aside)
    data = bytearray(path.read_bytes())
    if where == "data":
        data[-50] ^= 0x01
    elif where == "header":
        data[30] ^= 0x01
    else:
        data = data[:len(data) // 2]
    path.write_bytes(bytes(data))
    capsys.readouterr()
    rebuilt = start(stops=frozenset())
    err = " ".join(capsys.readouterr().err.split())  # rich wraps at 80 columns where a path ends
    assert "rebuilding it" in err and "prefilled" in err and "loaded" not in err
    assert rebuilt.ask("t5").tokens == reference
    start()
    assert "loaded the prefilled book" in capsys.readouterr().err  # rewritten whole


def test_interrupted_prefill_resumes_from_checkpoints(start, tmp_path, capsys, monkeypatch):
    """Ctrl-C in the middle of the book's prefill keeps the checkpoints written so far; the next start
    says how much it resumes from, computes only the rest, and answers as an uninterrupted start does."""
    reference = start("--no-cache", stops=frozenset()).ask("t5 t6").tokens
    monkeypatch.setattr(chat_book, "CHECKPOINT_SECONDS", 0.0)  # a checkpoint after every prefill piece
    pieces = []
    real_after = chat_book.kvfile.Checkpoints.after

    def interrupt_after_two(self, n):
        real_after(self, n)
        pieces.append(n)
        if len(pieces) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(chat_book.kvfile.Checkpoints, "after", interrupt_after_two)
    capsys.readouterr()
    with pytest.raises(KeyboardInterrupt):
        start("--prefill-chunk", "64", stops=frozenset())
    monkeypatch.setattr(chat_book.kvfile.Checkpoints, "after", real_after)
    assert len(list((tmp_path / "cache").glob("*.partial/*.safetensors"))) == 2
    said = " ".join(capsys.readouterr().err.split())  # Ctrl-C says what the next start gets
    assert "the prefill stopped: 128 of" in said and "are kept; the next start on this book resumes from there" in said
    resumed = start("--prefill-chunk", "64", stops=frozenset())
    err = " ".join(capsys.readouterr().err.split())
    assert "resuming the prefill from a checkpoint: 128 of" in err and "128 more from checkpoints" in err
    assert resumed.ask("t5 t6").tokens == reference
    assert not list((tmp_path / "cache").glob("*.partial"))  # the saved file replaced the checkpoints
    start("--prefill-chunk", "64")
    assert "loaded the prefilled book" in capsys.readouterr().err


def test_whole_book_past_the_trained_positions_gets_yarn(tmp_path, capsys):
    """By default chat takes the whole book, stretching RoPE with YaRN (said once); only past what the
    scaling supports (32x the trained positions) is it refused, naming the largest --context."""
    folder = tmp_path / "short-model"
    save_tiny(folder, seed=1, vocab=64, max_pos=64)
    save_tokenizer(folder, vocab=64)
    book = tmp_path / "book.txt"
    book.write_text(" ".join(f"t{3 + i % 7}" for i in range(300)))
    c = chat.start(make_args(folder, book, tmp_path / "cache"), interactive=False)
    err = " ".join(capsys.readouterr().err.split())
    assert c.book.kept == c.book.tokens == 300 and "applying YaRN RoPE scaling" in err
    assert "fits 2,048 positions with RoPE scaling, with 160 tokens for the conversation" in err
    assert c.ask("t5").tokens
    book.write_text(" ".join(f"t{3 + i % 7}" for i in range(64 * 32)))
    assert run_cli(chat.main, ["--book", str(book), "--model", str(folder), "--room", "100"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "does not fit" in err and "2,048-token context" in err and re.search(r"--context 1\d\d\d to keep", err)


def test_mismatched_cache_is_refused(start, tmp_path):
    c = start()
    [path] = kept_files(tmp_path / "cache")  # the saved book (the drafter's window beside it aside)
    key = chat_book.cache_key(c.session, c.book)
    kvfile.load(path, c.gen, key, c.book.prompt)  # the right key loads
    with pytest.raises(kvfile.CacheInvalid, match="another model, book or setting"):
        kvfile.load(path, c.gen, {**key, "dtype": "bfloat16"}, c.book.prompt)
    with pytest.raises(kvfile.CacheInvalid, match="another prompt"):
        kvfile.load(path, c.gen, key, c.book.prompt[:-1] + [5])


# ------------------------------------------------------------------------------------- the book
@pytest.mark.parametrize("content,message", [(None, "does not exist"), (b"  \n", "is empty"),
                                             (b"t1\x00\x01", "binary"), (b"t5 \xff\xfe t6", "not UTF-8"),
                                             (b"*** START OF THE PROJECT GUTENBERG EBOOK X ***\n \n"
                                              b"*** END OF THE PROJECT GUTENBERG EBOOK X ***\nt5 t6",
                                              "holds no text between Project Gutenberg's start and end markers")])
def test_bad_book_is_one_line(tiny_folder, tmp_path, capsys, content, message):
    path = tmp_path / "book.txt"
    if content is not None:
        path.write_bytes(content)
    assert run_cli(chat.main, ["--book", str(path), "--model", str(tiny_folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: book") and message in err and "\n" not in err


def test_long_book_is_not_truncated_silently(tiny_folder, tmp_path, capsys):
    path = tmp_path / "long.txt"
    path.write_text(" ".join(f"t{3 + i % 60}" for i in range(4500)))  # the tiny model takes 4096 positions
    argv = ["--book", str(path), "--model", str(tiny_folder), "--room", "100", "--rope-scaling", "none"]
    assert run_cli(chat.main, argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "does not fit" in err and "--context 3900" in err and "drop --rope-scaling none" in err
    args = chat.parse_args(argv + ["--context", "3900"])
    tok = load_tokenizer(tiny_folder)
    said = io.StringIO()
    book = chat_book.prepare_book(args, tok, chat.ConsoleReporter(chat.Console(file=said, width=200)))
    ids = tok.encode(path.read_text(), add_special_tokens=False, split_special_tokens=True)
    head = len(book.fmt.markup(book.fmt.book_head))
    assert book.kept == 3900 and book.prompt[head:head + 3900] == ids[-3900:]
    assert len(book.prompt) + 100 <= 4096
    assert "fits the model's 4,096 positions, with 100 tokens for the conversation" in said.getvalue()


def test_room_errors_name_the_flag(tiny_folder, start, tmp_path, capsys):
    """The library names ChatOptions.room; the command line says --room, at start and in an answer."""
    path = tmp_path / "short.txt"
    path.write_text(" ".join(f"t{3 + i % 60}" for i in range(200)))
    argv = ["--book", str(path), "--model", str(tiny_folder), "--room", "5000", "--rope-scaling", "none"]
    assert run_cli(chat.main, argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "does not fit" in err and err.rstrip().endswith("lower --room"), err
    c = start("--room", "20")
    rc, out = run_repl(c, [" ".join(["t5"] * 40)])
    said = " ".join(out.split())
    assert rc == 0 and "used its 20 tokens of room" in said and "a larger --room" in said, said


def test_a_gutenberg_books_header_and_licence_are_left_out(tiny_folder, tmp_path, capsys):
    """A Project Gutenberg file: the model reads the story between the markers, and the note says what
    was left out; a book without markers is read whole (every other test here)."""
    rng = random.Random(7)
    story = " ".join(f"t{rng.randrange(3, 64)}" for _ in range(300))
    text = ("The Project Gutenberg EBook of Tiny\r\n\r\n*** START OF THIS PROJECT GUTENBERG EBOOK TINY ***\r\n\r\n"
            + story + "\r\n\r\n*** END OF THIS PROJECT GUTENBERG EBOOK TINY ***\r\n" + " t9" * 200)
    path = tmp_path / "tiny.txt"
    path.write_text(text, newline="")
    c = chat.start(make_args(tiny_folder, path, tmp_path / "cache"), interactive=False)
    said = " ".join(capsys.readouterr().err.split())
    assert (f"tiny.txt: read between Project Gutenberg's start and end markers (its header and licence, "
            f"{len(text) - len(story):,} characters, left out)") in said
    ids = load_tokenizer(tiny_folder).encode(story, add_special_tokens=False, split_special_tokens=True)
    head = len(c.book.fmt.markup(c.book.fmt.book_head))
    assert c.book.tokens == len(ids) and c.book.prompt[head:head + len(ids)] == ids
    check_lossless(c, c.ask("t5 t6"))
    c.close()


def test_a_book_from_a_pipe_goes_unnamed(tiny_folder, tmp_path, capsys):
    """`--book <(command)`: the book is read from the pipe; the system prompt names no book (a pipe's
    name, 63 of /dev/fd/63, says nothing of it), the notes name the path, and the saved cache is a
    book's."""
    fifo = tmp_path / "63"
    os.mkfifo(fifo)
    text = " ".join(f"t{3 + (i * 7) % 60}" for i in range(300))
    writer = threading.Thread(target=lambda: fifo.write_text(text))
    writer.start()
    c = chat.start(make_args(tiny_folder, fifo, tmp_path / "cache"), interactive=False)
    writer.join()
    said = " ".join(capsys.readouterr().err.split())
    assert c.book.name == "" and f"{fifo}: {c.book.tokens:,} tokens" in said
    system = c.book.fmt.book_head
    assert "the book given below" in system and " 63" not in system
    assert [p.name.startswith("book-") for p in (tmp_path / "cache").glob("*.safetensors")] == [True, True]
    check_lossless(c, c.ask("t5 t6"))
    c.close()


def test_chat_template_pieces(tiny_folder):
    tok = load_tokenizer(tiny_folder)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fmt = chat_book.ChatFormat(tok, "about t9")
    assert fmt.templated and fmt.book_head == "<|im_start|>system\nabout t9\n\n" and fmt.book_tail == "<|im_end|>\n"
    assert fmt.turn_head == "<|im_start|>user\n" and fmt.turn_tail == "<|im_end|>\n<|im_start|>assistant\n"
    assert fmt.answer_end == "<|im_end|>\n"
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert end in chat_book.stop_ids(fmt, str(tiny_folder))
    assert fmt.closing([5, end]) == [] and fmt.closing([5, 6]) == [end]  # "\n" is no token here
    assert fmt.encode("t5 <|im_end|>")[-1] != end  # user text never becomes a control token
    assert not chat_book.ChatFormat(load_tokenizer(tiny_folder), "x").templated  # no template: plain


# ------------------------------------------------------------------------------------- TP input
def _share_worker(rank, port, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    lines = iter(["t5 t6", "/quit"])

    def read():
        assert rank == 0, "only rank 0 reads the terminal"
        return next(lines)

    group = TensorParallel(rank, 2, rank, "cpu", timeout=60.0, group=dist.group.WORLD)
    got = [group.share(read), group.share(read), group.all_agree(rank == 0), group.all_agree(True)]
    (out_dir / f"rank{rank}").write_text(repr(got))
    group.close()


def test_rank0_input_is_broadcast(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_share_worker, args=(port, tmp_path), nprocs=2)
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}").read_text() == repr(["t5 t6", "/quit", False, True])


# ------------------------------------------------------------------------------------- real model
SMOLLM = Path(__file__).resolve().parents[2] / "models" / "smollm2-135m"


@pytest.mark.slow
@pytest.mark.skipif(not SMOLLM.is_dir(), reason="models/smollm2-135m missing: run triforce-prepare")
def test_smollm2_chat_template_cache_and_lossless_turns(tmp_path, capsys):
    """SmolLM2's ChatML template, the answer ending at <|im_end|>, the saved cache, lossless turns."""
    book = Path(__file__).resolve().parents[2] / "triforce" / "data" / "pride_and_prejudice_ch1-9.txt"
    opts = chat.parse_args(["--book", str(book), "--model", str(SMOLLM), "--draft", "self", "--context", "600",
                            "--max-new-tokens", "24", "--room", "200", "--budget", "256", "--temperature", "0",
                            "--cache-dir", str(tmp_path)])  # greedy: compared with autoregressive decoding
    args = replace(opts, run=replace(opts.run, dtype="float64"))
    first = chat.start(args, interactive=False)
    assert first.book.fmt.templated and first.book.fmt.answer_end == "<|im_end|>\n"
    im_end = first.tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end in first.stops and first.book.prompt[-2:] == first.book.fmt.markup("<|im_end|>\n")
    a = first.ask("Who is Mr. Bingley?")
    check_lossless(first, a)
    capsys.readouterr()
    second = chat.start(args, interactive=False)
    assert "loaded the prefilled book" in capsys.readouterr().err
    b = second.ask("Who is Mr. Bingley?")
    assert a.tokens == b.tokens
    check_lossless(second, second.ask("And his sister?"))


def test_lookups_search_the_book_with_its_line_wraps_undone(tiny_folder, tmp_path, capsys):
    """A hard-wrapped book: an adaptive chat's lookups search its text with the wraps undone beside
    the conversation (the model still reads the book as it is), and its answers stay lossless."""
    from triforce.runtime.text import unwrapped

    rng = random.Random(5)
    lines = [" ".join(f"t{rng.randrange(3, 64)}" for _ in range(8)) for _ in range(30)]
    wrapped = tmp_path / "wrapped.txt"
    wrapped.write_text("\n".join(lines[:15]) + "\n\n  " + "\n".join(lines[15:]) + "\n")
    flat, joined = unwrapped(wrapped.read_text())
    assert joined == 28 and "\n\n  " in flat  # a blank line and an indented line keep their breaks
    c = chat.start(make_args(tiny_folder, wrapped, tmp_path / "cache", "--adaptive"), interactive=False)
    said = " ".join(capsys.readouterr().err.split())  # the console may wrap a note
    assert f"lookups also search the book with its {joined} line wraps undone" in said
    tok = load_tokenizer(str(tiny_folder))
    assert c.gen.lookup.reference.tolist() == tok.encode(flat, add_special_tokens=False, split_special_tokens=True)
    assert c.gen.matches.reference.tolist() == c.gen.lookup.reference.tolist()
    check_lossless(c, c.ask(" ".join(lines[3].split()[:4])))
    c.close()
