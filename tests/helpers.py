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


def kept_prompt(path) -> dict:
    """A kept prompt's tensors as one whole file would hold them: for a file that holds only the tokens
    after another's (kvfile.save's `after`), each K/V joined after that file's first tokens, read the
    same way. Equal dicts: equal K/V, ids, queries and logits, bit for bit."""
    import json

    import torch
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
        link = json.loads(f.metadata()["key"]).get("continues")
    if link:
        before = kept_prompt(Path(path).with_name(link[0]))
        for name in tensors:
            if name[:2] in ("k.", "v."):
                tensors[name] = torch.cat([before[name][:, :link[1]], tensors[name]], dim=1)
    return tensors


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[n].dtype == b[n].dtype and torch_equal(a[n], b[n]) for n in a)


def torch_equal(a, b) -> bool:
    import torch

    return a.shape == b.shape and bool(torch.equal(a.view(torch.uint8) if a.is_floating_point() else a,
                                                   b.view(torch.uint8) if b.is_floating_point() else b))
