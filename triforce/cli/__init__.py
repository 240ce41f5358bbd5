"""The command line: `triforce-generate`, `triforce-chat`, `triforce-prepare`, `triforce-tp` (or
`python -m triforce generate|chat|prepare|tp`). Flags become runtime settings here; everything
else is library code in triforce.runtime."""
from __future__ import annotations

import os


def prepare_process() -> None:
    """What a command-line process sets before torch loads, called first by every entry point (never
    at import): OpenMP threads that sleep rather than spin while they wait, so that a busy machine's
    cores are not fought over (triforce.runtime.defaults has the measurements); no model hub; freed
    memory kept for reuse (triforce.runtime.memory)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from triforce.runtime.defaults import open_busy_window
    from triforce.runtime.memory import reuse_freed_memory

    reuse_freed_memory()  # before the weights load, so that they too come from the heap it keeps
    open_busy_window()  # other work's share of the cores, counted while this start imports and loads

