"""What an adaptive chat learned about its modes, kept beside the book's saved cache.

A chat's chooser (speculative/adaptive.py) starts knowing nothing: the first answer tries every mode
once, and on a 2-core CPU that cost the first answer about a tenth of its speed (Qwen2.5-Coder-1.5B
over 18K tokens of a novel: 7.1-7.6 tokens/s against 8.0 for plain decoding; session 26). The pass
costs, acceptance and round overheads it measured belong to this model, book, machine and settings,
all of which the saved cache's name already stands for, so they are kept in a small JSON file beside
it and the next start on the same book begins from them. Nothing here changes the output: the
chooser only picks which lossless mode runs each full pass.
"""
from __future__ import annotations

import json
from pathlib import Path

from triforce.model.files import write_whole

VERSION = 1


def state_path(cache_file: Path) -> Path:
    return cache_file.with_name(cache_file.stem + ".chooser.json")


def fingerprint(gen, threads: int) -> dict:
    """What the learned figures depend on besides the saved cache's key: the plans the chooser weighs
    and how the rounds run."""
    cfg = gen.cfg
    return {"version": VERSION, "modes": list(gen.modes), "gamma1": cfg.gamma1, "gamma2": cfg.gamma2,
            "device_rounds": gen.device_rounds, "threads": threads}


def save(path: Path, gen, threads: int) -> None:
    """Write the chooser's state (nothing without a chooser); a failed write is left unsaid: the next
    start only learns afresh."""
    if gen.chooser is None:
        return
    data = {"fingerprint": fingerprint(gen, threads), "state": gen.chooser.state()}
    write_whole(path, json.dumps(data).encode())  # a reader never sees half a file


def load(path: Path, gen, threads: int) -> bool:
    """Start gen's chooser from what a chat with the same fingerprint learned; False when there is
    nothing usable (no file, another setting, an unreadable file: the chooser then learns afresh)."""
    if gen.chooser is None or not path.is_file():
        return False
    try:
        data = json.loads(path.read_text())
        if data.get("fingerprint") != fingerprint(gen, threads):
            return False
        gen.chooser.restore(data["state"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False  # restore() changes nothing before the data has parsed
    return True
