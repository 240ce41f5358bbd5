"""Running the front ends (`python -m triforce generate|chat`) as fresh processes, as a user would."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def command(front: str, *args) -> list[str]:
    """`triforce <front>` on one thread and, unless a test names a device, on the CPU (the default suite
    tests the CPU path on any machine; tests/test_gpu.py covers CUDA); chat neither reads nor writes
    the user's saved KV caches."""
    extra = ["--no-cache"] if front == "chat" else []
    if "--device" not in map(str, args):
        extra += ["--device", "cpu"]
    return [sys.executable, "-m", "triforce", front, "--threads", "1", *extra, *map(str, args)]


def run(front: str, *args, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    # no standard input: chat is not interactive and, should it start, ends at once
    return subprocess.run(command(front, *args), capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})


def assert_one_line_error(proc: subprocess.CompletedProcess, *words: str) -> None:
    """A non-zero exit, no traceback, and a last stderr line 'error: ...' holding every word."""
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error:"), proc.stderr
    for word in words:
        assert word.lower() in lines[-1].lower(), lines[-1]
