"""Text in and out: reading a prompt file with one-line errors, and the one streaming detokenizer
(generate's output, chat's answers, the API's on_text)."""
from __future__ import annotations

import re
from pathlib import Path

from triforce.model.errors import UserError


class StreamingText:
    """The text of a growing list of tokens, handed out as it becomes final. Decoding the whole list
    each time keeps multi-token characters and a tokenizer's spacing right; a piece that ends in an
    incomplete character (U+FFFD) waits for the token that completes it."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.shown = 0

    def text(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, tokens: list[int]) -> str:
        """The text the new tokens complete ('' while a character is still incomplete)."""
        self.tokens.extend(tokens)
        text = self.text()
        if text.endswith("\ufffd"):
            return ""
        piece, self.shown = text[self.shown:], len(text)
        return piece

    def rest(self) -> str:
        """Whatever has not been handed out (an incomplete character at the very end included)."""
        text = self.text()
        piece, self.shown = text[self.shown:], len(text)
        return piece


def read_text(path: str | Path, what: str = "prompt file") -> str:
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{what} {path} is a directory; give a text file inside it")
    if not path.exists():
        raise UserError(f"{what} {path} does not exist; check the path")
    data = path.read_bytes()  # a pipe too: `--prompt-file <(command)`, /dev/stdin
    if not data.strip():
        raise UserError(f"{what} {path} is empty; give it some text")
    if b"\x00" in data[:65536]:
        raise UserError(f"{what} {path} is binary, not text; give a UTF-8 text file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{what} {path} is not UTF-8 text (byte {e.start}); convert it to UTF-8") from None


# Project Gutenberg's markers: "*** START OF THE PROJECT GUTENBERG EBOOK MOBY DICK ***", "*** END OF ..."
GUTENBERG_START = re.compile(r"^\*\*\* ?START OF (?:THE|THIS) PROJECT GUTENBERG E-?BOOK[^\n]*$", re.MULTILINE | re.IGNORECASE)
GUTENBERG_END = re.compile(r"^\*\*\* ?END OF (?:THE|THIS) PROJECT GUTENBERG E-?BOOK[^\n]*$", re.MULTILINE | re.IGNORECASE)


def gutenberg_story(text: str) -> tuple[str, int]:
    """The text between Project Gutenberg's start and end markers, and how many characters around them
    were cut; a text without the markers comes back whole, with 0. The header and the licence (about
    4,500 SmolLM2 tokens in Moby Dick) are not the book: a model continuing after them starts another
    document, and a chat would spend its context on them."""
    start = GUTENBERG_START.search(text)
    end = GUTENBERG_END.search(text, start.end() if start else 0)
    if start is None and end is None:
        return text, 0
    story = text[start.end() if start else 0:end.start() if end else len(text)].strip()
    return story, len(text) - len(story)


def read_prompt_file(path: str | Path, what: str = "prompt file") -> tuple[str, str | None]:
    """A prompt file's or book's text, less Project Gutenberg's header and licence where its markers
    say (gutenberg_story), and a one-line note saying what was left out (None: nothing was). A
    prompt given as a string is taken as it is."""
    text, cut = gutenberg_story(read_text(path, what))
    if not cut:
        return text, None
    if not text:
        raise UserError(f"{what} {path} holds no text between Project Gutenberg's start and end markers; "
                        f"give a file with the book's text")
    shown = Path(path).name if Path(path).is_file() else path  # a pipe's name (63 of /dev/fd/63) says nothing
    return text, (f"{shown}: read between Project Gutenberg's start and end markers (its header and "
                  f"licence, {cut:,} characters, left out)")


# a line break between two characters that are not blank: inside a paragraph (a blank line ends one),
# the next line not indented (verse and block quotes often are)
WRAP = re.compile(r"(?<=\S)[ \t]*\r?\n(?=\S)")


def unwrapped(text: str) -> tuple[str, int]:
    """The text with its hard line wraps undone, and how many: a line break inside a paragraph becomes
    a space. Project Gutenberg's books break every line near 72 characters, where a model quoting them
    writes a space (runtime/chat.py searches this text for lookups; the model still reads the book
    as it is). Verse whose lines are not indented is joined too: that costs a lookup, never a token."""
    return WRAP.subn(" ", text)
