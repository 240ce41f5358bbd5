"""bench.gpu_stage: the model split in two halves that each fit a device call, joined and prepared
there; a missing half or file is one line, not a traceback."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GGUF = ROOT / "models" / ".cache" / "smollm2-135m.gguf"


def stage(*args):
    return subprocess.run([sys.executable, "-m", "bench.gpu_stage", *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, timeout=600, stdin=subprocess.DEVNULL)


def one_line_error(done, *words):
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and all(w in lines[0] for w in words), done.stderr


def test_pack_without_the_model_says_how_to_get_it(tmp_path):
    one_line_error(stage("pack", "--models", tmp_path), "missing", "triforce prepare")


def test_unpack_without_half_a_names_it(tmp_path):
    (tmp_path / ".stage" / "b").mkdir(parents=True)
    (tmp_path / ".stage" / "b" / "manifest.json").write_text('{"gguf": "x.gguf", "sha256": "0", "bytes": 2}')
    (tmp_path / ".stage" / "b" / "x.gguf.part-b").write_bytes(b"b")
    one_line_error(stage("unpack", "--models", tmp_path, "--half-a", tmp_path / "nowhere"), "x.gguf.part-a", "missing")


@pytest.mark.slow
@pytest.mark.skipif(not GGUF.is_file(), reason="models/.cache/smollm2-135m.gguf missing: run triforce-prepare")
def test_pack_then_unpack_prepares_the_model(tmp_path):
    """Both halves fit a call's 64 MiB beside the working tree; joined, they prepare the model."""
    import shutil

    models = tmp_path / "models"
    (models / ".cache").mkdir(parents=True)
    (models / ".cache" / GGUF.name).symlink_to(GGUF)
    book = tmp_path / "book.txt"
    book.write_text("It was a dark and stormy night. " * 1000)
    packed = stage("pack", "--models", models, "--book", book)
    assert packed.returncode == 0, packed.stderr
    for half in ("a", "b"):
        assert sum(f.stat().st_size for f in (models / ".stage" / half).iterdir()) < 56 * 2**20
    assert (models / ".stage" / "b" / "book.txt").read_text() == book.read_text()
    there = tmp_path / "there"
    shutil.copytree(models / ".stage", there / ".stage")
    shutil.copytree(models / ".stage" / "a", tmp_path / "stage")
    unpacked = stage("unpack", "--models", there, "--half-a", tmp_path / "stage")
    assert unpacked.returncode == 0, unpacked.stderr[-2000:]
    assert (there / "smollm2-135m" / "config.json").is_file()
    assert (there / ".cache" / GGUF.name).read_bytes() == GGUF.read_bytes()
