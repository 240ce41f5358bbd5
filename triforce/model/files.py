"""Small files a start keeps for the next one (a digest, a tokenizer's backend, a chat's memo): written
whole or not at all."""
from __future__ import annotations

import os
from pathlib import Path


def cache_home() -> Path:
    """Where runs keep what later runs reuse: $TRIFORCE_CACHE, else ~/.cache/triforce
    ($XDG_CACHE_HOME honoured). The tests point it at a folder of their own."""
    home = os.environ.get("TRIFORCE_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "triforce"
    return Path(home).expanduser()


def write_whole(path: str | Path, data: bytes) -> bool:
    """Write `data` to a temporary name beside `path` and rename it into place, so that a reader (another
    rank, the next start after a crash) finds the whole file or none. Best effort: False where the folder
    cannot be made or written (read-only, full, a file in the way), and the caller's work is only not
    kept."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.part")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        os.replace(tmp, path)
        return True
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # no folder to hold it: nothing was written
            pass
        return False
