"""The drafter's StreamingLLM window over a prompt (Generator.drafter_window) restored instead of
computed again: by a chat's /reset, by a chat start on a saved book, and by a generate run that loads
a kept prompt. A sampled answer is the test: the drafts, and so the draws, follow the window's bits."""
from __future__ import annotations

import logging

import pytest

import triforce
from triforce.runtime.chat import open_chat
from triforce.speculative import windows

from ..conftest import tiny_with_tokenizer
from .test_book_memo import QUESTION, options
from .test_prompt_cache import FIXED, PROMPT

SAMPLED = ("--temperature", "1", "--seed", "4", "--no-adaptive", "--mode", "triforce", "--budget", "128",
           "--chunk-size", "16")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_with_tokenizer(tmp_path_factory, "window", seed=12)


@pytest.fixture
def window_passes(monkeypatch) -> list[int]:
    """The drafter windows computed (windows.prefill calls), by prompt length."""
    calls = []
    computed = windows.prefill

    def counted(level, seq, n):
        calls.append(n)
        return computed(level, seq, n)

    monkeypatch.setattr(windows, "prefill", counted)
    return calls


def answer(c) -> list[int]:
    return c.ask(QUESTION).tokens


def test_chat_starts_and_resets_restore_the_window(folder, book, tmp_path, window_passes):
    uncached = open_chat(options(folder, book, tmp_path / "unused", *SAMPLED, "--no-cache"))
    expected = answer(uncached)
    uncached.reset()  # restored from the window the prefill left
    assert answer(uncached) == expected
    uncached.close()
    assert window_passes == [len(uncached.book.prompt)]  # the prefill's own, and no other

    cache = tmp_path / "cache"
    open_chat(options(folder, book, cache, *SAMPLED)).close()  # prefills the book, keeps it and its window
    [window_file] = cache.glob("*.window-*.safetensors")
    window_passes.clear()
    loaded = open_chat(options(folder, book, cache, *SAMPLED))
    assert answer(loaded) == expected and window_passes == []
    loaded.close()

    window_file.unlink()  # computed again, then kept again
    again = open_chat(options(folder, book, cache, *SAMPLED))
    assert answer(again) == expected and window_passes == [len(again.book.prompt)]
    again.close()
    assert window_file.exists()


def test_a_window_made_for_another_drafter_setting_is_not_used(folder, book, tmp_path, window_passes):
    cache = tmp_path / "cache"
    open_chat(options(folder, book, cache, *SAMPLED)).close()
    window_passes.clear()
    # int8 proposer weights: a window of the same shape, other values
    other = open_chat(options(folder, book, cache, *SAMPLED, "--lower-weights", "int8"))
    other_answer = answer(other)
    other.close()
    assert window_passes == [len(other.book.prompt)]
    assert len(list(cache.glob("*.window-*.safetensors"))) == 2
    fresh = open_chat(options(folder, book, tmp_path / "unused", *SAMPLED, "--lower-weights", "int8", "--no-cache"))
    assert answer(fresh) == other_answer


def test_generate_loads_the_window_beside_a_kept_prompt(model, cache, window_passes, caplog):
    settings = dict(model=str(model), mode="triforce", temperature=1.0, seed=9, **FIXED)
    expected = triforce.generate(PROMPT, prompt_cache="off", **settings).tokens
    triforce.generate(PROMPT, prompt_cache="on", **settings)
    [window] = cache.glob("*.window-*.safetensors")
    window_passes.clear()
    assert triforce.generate(PROMPT, prompt_cache="on", **settings).tokens == expected
    assert window_passes == []
    data = bytearray(window.read_bytes())
    data[-40] ^= 0xFF
    window.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="triforce"):
        assert triforce.generate(PROMPT, prompt_cache="on", **settings).tokens == expected
    assert f"the kept drafter window {window} is corrupt (checksum mismatch): computing it again" in caplog.text
    assert len(window_passes) == 1  # and kept again in the damaged file's place
    assert triforce.generate(PROMPT, prompt_cache="on", **settings).tokens == expected and len(window_passes) == 1
