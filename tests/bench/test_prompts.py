"""The benches' prompts: a book's story from its first token, without Project Gutenberg's licence."""
from pathlib import Path

import pytest

from bench.prompts import story_prompt, story_text
from triforce.model.errors import UserError
from triforce.runtime.text import gutenberg_story

BOOK = ("The Project Gutenberg EBook of A Tale\r\n\r\nRelease Date: 1851\r\n\r\n"
        "*** START OF THIS PROJECT GUTENBERG EBOOK A TALE ***\r\n\r\nCall me Ishmael. Some years ago,\r\n"
        "never mind how long.\r\n\r\n*** END OF THIS PROJECT GUTENBERG EBOOK A TALE ***\r\n\r\n"
        "Section 1. General Terms of Use and Redistributing Project Gutenberg-tm electronic works\r\n")


class Words:
    """A tokenizer of whitespace-separated words, with the call the benches make."""

    def __init__(self):
        self.calls = []

    def encode(self, text, add_special_tokens=True):
        assert add_special_tokens is False  # a continuation: no BOS in the middle of a book
        self.calls.append(len(text))
        return [hash(word) % 1000 for word in text.split()]


def test_the_story_is_between_the_markers_with_plain_line_ends():
    assert story_text(BOOK) == "Call me Ishmael. Some years ago,\nnever mind how long."
    assert story_text("  Persuasion\r\n\r\nFinis\n") == "Persuasion\n\nFinis"  # no markers: all of it
    older = BOOK.replace("*** START OF THIS", "***START OF THE").replace("EBOOK A TALE ***\r\n\r\nSection", "E-BOOK ***\r\n\r\nSection")
    assert story_text(older).startswith("Call me Ishmael") and "General Terms" not in story_text(older)


def test_what_the_markers_leave_out_is_counted():
    story, cut = gutenberg_story(BOOK)
    assert story == "Call me Ishmael. Some years ago,\r\nnever mind how long." and cut == len(BOOK) - len(story)
    assert gutenberg_story("Persuasion\n\nFinis\n") == ("Persuasion\n\nFinis\n", 0)  # no markers: as it is
    only_end = "A tale.\n*** END OF THE PROJECT GUTENBERG EBOOK X ***\nlicence"
    assert gutenberg_story(only_end) == ("A tale.", len(only_end) - len("A tale."))


def test_a_prompt_is_the_storys_first_tokens():
    words = [f"w{i}" for i in range(3000)]
    text = "*** START OF THE PROJECT GUTENBERG EBOOK X ***\n" + " ".join(words) + "\n*** END OF THE PROJECT GUTENBERG EBOOK X ***\nlicence"
    whole = Words().encode(" ".join(words), add_special_tokens=False)
    tok = Words()
    assert story_prompt(tok, text, 100) == whole[:100]
    assert tok.calls == [8 * 100 + 64]  # a prefix of the text was enough: the book is not encoded whole
    assert story_prompt(Words(), text, None) == whole
    assert story_prompt(Words(), text, 5000) == whole  # more than it has: all of it (the bench skips that context)
    long_words = " ".join("x" * 40 + str(i) for i in range(50))  # 41-42 characters a token: the prefix falls short
    tok = Words()
    assert len(story_prompt(tok, long_words, 30)) == 30 and len(tok.calls) == 2
    near = " ".join("abcdef" + str(i % 10) for i in range(400))  # 8 characters a token: the kept ones end near the cut
    tok = Words()
    assert story_prompt(tok, near, 30) == Words().encode(near, add_special_tokens=False)[:30] and len(tok.calls) == 2


def test_an_empty_book_is_one_line_that_names_the_fix():
    with pytest.raises(UserError, match="--prompt-file"):
        story_prompt(Words(), "*** START OF THIS PROJECT GUTENBERG EBOOK X ***\n\n*** END OF THIS PROJECT GUTENBERG EBOOK X ***", 10)


def test_moby_dicks_prompt_continues_the_story_not_the_licence():
    book = Path(__file__).resolve().parents[3] / "shared" / "data" / "books" / "mobydick.txt"
    if not book.is_file():
        pytest.skip("../shared/data/books/mobydick.txt is not here")
    text = book.read_text()
    story = story_text(text)
    assert "\r" not in story and story.endswith("Moby Dick; or The Whale, by Herman Melville")
    assert "MOBY DICK; OR THE WHALE" in story[:200] and "Section 1." in text and "Section 1." not in story
