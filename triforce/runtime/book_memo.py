"""What a chat start on a saved book would compute again from the same files: the book's token ids
(and those of its text with the line wraps undone, which lookups search), and the pieces of the chat
template with the stop ids they imply. Kept beside the saved books (`<cache dir>/memo/`).

A start that loads a prefilled book is otherwise mostly this work: on the 2-core Xeon, SmolLM2 over
*Persuasion* spent 1.2 s encoding the book twice (115,861 tokens) and 1.9 s rendering the template,
most of it importing transformers, which nothing else in a chat needs where the tokenizer takes the
`tokenizers` path (model/tokenizer.py).

Every entry is keyed by what it is a function of: the tokenizer folder's files (their bytes, hashed on
each start: ~25 ms for Qwen's 11 MB), the versions of `tokenizers` and transformers, and the text or
the system prompt. A changed file, or an upgraded library, misses and computes afresh. A template that
reads the clock (`strftime_now`, e.g. Llama 3.1's "Today Date") is rendered on every start, as before.
Entries are written to a temporary name and renamed into place, so a crash or two ranks writing at
once leave a whole file or none; a file that does not read back is computed again.
"""
from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Callable

import numpy as np

from triforce.model.files import write_whole
from triforce.model.tokenizer import files_digest

VERSION = 1  # of what the entries hold; a change here misses every older entry
TEMPLATE_FILES = ("tokenizer_config.json", "chat_template.jinja", "chat_template.json")
CLOCK = b"strftime_now"  # transformers' template global for the current date


class BookMemo:
    """Entries for one tokenizer folder under `root` (the chat's cache directory)."""

    def __init__(self, root: str | Path, folder: str | Path):
        self.root = Path(root) / "memo"
        self.tokenizer = files_digest(folder)  # the tokenizer files' bytes and the libraries' versions
        self.dated = _reads_clock(Path(folder))

    def ids(self, text: str, encode: Callable[[str], list[int]]) -> list[int]:
        """encode(text), remembered by the text's bytes."""
        path = self._path("ids", hashlib.sha256(text.encode()).hexdigest(), ".npy")
        try:
            saved = np.load(path, allow_pickle=False)
            if saved.ndim == 1 and saved.dtype == np.int64:
                return saved.tolist()
        except (OSError, ValueError, EOFError):
            pass  # none yet, or not a whole array: encode
        ids = encode(text)
        array = io.BytesIO()
        np.save(array, np.asarray(ids, dtype=np.int64))
        write_whole(path, array.getvalue())  # best effort: a cache that cannot be written costs the work again
        return ids

    def record(self, system: str, compute: Callable[[], dict]) -> dict:
        """compute(), a JSON-able record of the chat template for this system prompt, remembered unless
        the template reads the clock."""
        if self.dated:
            return compute()
        path = self._path("format", system, ".json")
        try:
            return json.loads(path.read_text())["record"]
        except (OSError, ValueError, KeyError, TypeError):
            pass
        record = compute()
        write_whole(path, json.dumps({"record": record}).encode())
        return record

    def _path(self, kind: str, what: str, suffix: str) -> Path:
        key = json.dumps([VERSION, kind, self.tokenizer, what])
        return self.root / (hashlib.sha256(key.encode()).hexdigest()[:40] + suffix)


def _reads_clock(folder: Path) -> bool:
    for name in TEMPLATE_FILES:
        try:
            if CLOCK in (folder / name).read_bytes():
                return True
        except OSError:
            continue
    return False
