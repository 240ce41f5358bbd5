"""A chat start on a saved book reads what the last start on the same files computed (runtime/book_memo.py):
the book's ids, its unwrapped text's ids and the chat template's pieces, and so never imports
transformers where the tokenizer takes the `tokenizers` path; anything changed computes afresh."""
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path


from triforce.cli import chat
from triforce.runtime import book_memo
from triforce.runtime.book_memo import BookMemo
from triforce.runtime.chat import open_chat


ROOT = Path(__file__).resolve().parents[2]
QUESTION = "Who is Anne?"


def options(folder: Path, book: Path, cache: Path, *extra: str):
    opts = chat.parse_args(["--book", str(book), "--model", str(folder), "--draft", "self", "--max-new-tokens", "8",
                            "--temperature", "0", "--room", "64", "--cache-dir", str(cache), *extra])
    return replace(opts, run=replace(opts.run, dtype="float64"))


def what_a_start_has(c) -> dict:
    answer = c.ask(QUESTION)
    return {"prompt": c.book.prompt, "stops": sorted(c.stops), "answer": answer.tokens,
            "parts": [c.book.fmt.book_head, c.book.fmt.book_tail, c.book.fmt.turn_head, c.book.fmt.turn_tail,
                      c.book.fmt.answer_end],
            "reference": c.gen.lookup.reference.tolist() if c.gen.lookup is not None and c.gen.lookup.reference is not None else None}


FRESH_START = """
import json, sys
from dataclasses import replace
from pathlib import Path
from triforce.runtime.chat import open_chat
from tests.runtime.test_book_memo import options, what_a_start_has
c = open_chat(options(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])))
seen = what_a_start_has(c)
seen["transformers"] = "transformers" in sys.modules
print(json.dumps(seen))
"""


def test_a_second_start_reads_the_memo_and_not_transformers(folder, book, tmp_path):
    cache = tmp_path / "cache"
    first = open_chat(options(folder, book, cache))
    expected = what_a_start_has(first)
    first.close()
    assert expected["parts"][0].startswith("<|im_start|>system") and expected["reference"]  # the unwrapped book
    assert len(list((cache / "memo").glob("*.npy"))) == 2 and len(list((cache / "memo").glob("*.json"))) == 1
    out = subprocess.run([sys.executable, "-c", FRESH_START, str(folder), str(book), str(cache)],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen.pop("transformers") is False
    assert seen == expected


def test_a_callers_tokenizer_or_no_cache_keeps_no_memo(folder, book, tmp_path):
    from triforce.model.loader import load_tokenizer

    tok = load_tokenizer(folder)
    open_chat(options(folder, book, tmp_path / "given"), tokenizer=tok).close()  # the caller's may differ from its files
    assert (tmp_path / "given").is_dir() and not (tmp_path / "given" / "memo").exists()
    open_chat(options(folder, book, tmp_path / "none", "--no-cache")).close()
    assert not (tmp_path / "none").exists()


def counting(result):
    calls = []
    return calls, lambda *args: calls.append(args) or result


def test_the_memo_misses_whatever_its_entries_depend_on(folder, tmp_path):
    model = tmp_path / "tokenizer"
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (folder / name).exists():
            (model / name).write_bytes((folder / name).read_bytes())
    memo = BookMemo(tmp_path / "cache", model)
    calls, encode = counting([5, 6, 7])
    assert memo.ids("some text", encode) == [5, 6, 7] and memo.ids("some text", encode) == [5, 6, 7]
    assert len(calls) == 1
    assert memo.ids("other text", encode) == [5, 6, 7] and len(calls) == 2  # another text
    records, render = counting({"parts": ["a", "b", "c", "d", "e"], "stops": [1]})
    assert memo.record("system one", render) == memo.record("system one", render) == {"parts": list("abcde"), "stops": [1]}
    assert len(records) == 1
    memo.record("system two", render)
    assert len(records) == 2  # another system prompt
    # a changed tokenizer file misses every entry
    config = model / "tokenizer_config.json"
    config.write_text(config.read_text().replace("}", ', "model_max_length": 77}', 1))
    again = BookMemo(tmp_path / "cache", model)
    assert again.tokenizer != memo.tokenizer
    again.ids("some text", encode)
    again.record("system one", render)
    assert len(calls) == 3 and len(records) == 3
    # an entry that does not read back is computed again, and rewritten
    for path in (tmp_path / "cache" / "memo").iterdir():
        path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    assert again.ids("some text", encode) == [5, 6, 7] and len(calls) == 4
    assert again.record("system one", render)["stops"] == [1] and len(records) == 4
    again.ids("some text", encode)
    assert len(calls) == 4


def test_a_template_that_reads_the_clock_renders_every_time(tmp_path):
    model = tmp_path / "tokenizer"
    model.mkdir()
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": "Today {{ strftime_now('%d %b %Y') }}"}))
    memo = BookMemo(tmp_path / "cache", model)
    assert memo.dated
    records, render = counting({"parts": None, "stops": []})
    memo.record("s", render)
    memo.record("s", render)
    assert len(records) == 2
    calls, encode = counting([1])
    memo.ids("t", encode)
    memo.ids("t", encode)
    assert len(calls) == 1  # ids do not depend on the date


def test_a_cache_directory_that_cannot_be_written_costs_only_the_work(folder, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    memo = BookMemo(blocked, folder)
    calls, encode = counting([3])
    assert memo.ids("t", encode) == [3] and memo.ids("t", encode) == [3] and len(calls) == 2
    assert book_memo.VERSION >= 1
