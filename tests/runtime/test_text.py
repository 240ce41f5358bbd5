"""Reading a prompt or a book from a path that is not a regular file: a pipe (`--prompt-file
<(command)`, /dev/stdin) is read like a file; /dev/null is an empty text."""
from __future__ import annotations

import os
import threading

import pytest

from triforce.model.errors import UserError
from triforce.runtime.text import read_prompt_file

STORY = "It is a truth universally acknowledged, that a single man in possession of a good fortune..."


def test_a_pipe_is_read_like_a_file(tmp_path):
    fifo = tmp_path / "prompt"
    os.mkfifo(fifo)
    header = "*** START OF THE PROJECT GUTENBERG EBOOK X ***\n"
    writer = threading.Thread(target=lambda: fifo.write_text(f"The header\n{header}{STORY}\n*** END OF THE PROJECT GUTENBERG EBOOK X ***\nlicence"))
    writer.start()
    text, note = read_prompt_file(fifo)
    writer.join()
    assert text == STORY and note.startswith(f"{fifo}: read between")


def test_dev_null_is_an_empty_text_not_a_missing_file():
    with pytest.raises(UserError, match="/dev/null is empty"):
        read_prompt_file("/dev/null")
    with pytest.raises(UserError, match="does not exist"):
        read_prompt_file("/nonexistent/prompt.txt")
