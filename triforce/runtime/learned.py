"""What an adaptive run learned about its modes, kept beside a chat's saved book or a kept prompt.

A chat's chooser (speculative/adaptive.py) starts knowing nothing: the first answer tries every mode
once, and on a 2-core CPU that cost the first answer about a tenth of its speed (Qwen2.5-Coder-1.5B
over 18K tokens of a novel: 7.1-7.6 tokens/s against 8.0 for plain decoding; session 26). The pass
costs, acceptance and round overheads it measured belong to this model, book, machine and settings,
all of which the saved cache's name already stands for, so they are kept in a small JSON file beside
it and the next start on the same book begins from them. Nothing here changes the output: the
chooser only picks which lossless mode runs each full pass.

`triforce generate` and the Python API do the same beside a kept prompt (runtime/prompt_cache.py):
a later run of the prompt, or of another that continues it (a question after a kept document),
starts from what the last one learned instead of trying every mode once.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from triforce.model.files import write_whole
from triforce.speculative import kvfile

# 2: sampling and budget in the fingerprint; 3: the retrieval cache's selection (session 52); 4: the
# verification rule in the fingerprint (session 53: block keeps more drafts than one at a time)
VERSION = 4


def state_path(cache_file: Path) -> Path:
    return cache_file.with_name(cache_file.stem + ".chooser.json")


def fingerprint(gen, threads: int) -> dict:
    """What the learned figures depend on besides the saved cache's key: the plans the chooser weighs,
    how the rounds run, and what sets the middle level's cost and every edge's acceptance (the
    retrieval budget, the sampling and how sampled drafts are verified)."""
    cfg = gen.cfg
    return {"version": VERSION, "modes": list(gen.modes), "gamma1": cfg.gamma1, "gamma2": cfg.gamma2,
            "device_rounds": gen.device_rounds, "threads": threads, "budget": cfg.budget,
            "sampling": [cfg.temperature, cfg.top_p, cfg.top_k], "verification": cfg.verification}


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


def threads() -> int:
    """The threads the figures were timed with (torch's, which a run sets)."""
    return torch.get_num_threads()


def start_for_prompt(session, gen) -> Path | None:
    """Start gen's chooser from what the last run of session's kept prompt learned, else from what the
    last run of the kept prompt it continues learned (a question after a document: kvfile.save's
    `after`), saying so; the file to keep this run's figures in, or None where the prompt is not kept
    or the run not adaptive."""
    kept = session.prompt_cache["loaded"] or session.prompt_cache["kept"]
    if gen.chooser is None or kept is None:
        return None
    own = state_path(Path(kept))
    link = kvfile.continues(kept)
    for path, whose in ((own, "the last run of this prompt"), (link and state_path(link[0]), "the last run of the prompt it continues")):
        if path is not None and load(path, gen, threads()):
            if session.is_main:
                session.say(f"starting from what {whose} learned of each mode's speed ({path.name}; a run that "
                            "differs in settings or threads learns afresh)")
            break
    return own
