"""A prefilled prompt kept on disk, so that the next run of the same prompt loads it instead of
prefilling it again (`triforce generate` and the Python API; a chat keeps its book the same way).

On a CPU the prefill is most of a run: the main job's 4,096 tokens take 10 of its 15 s on 2 cores,
and a user who tries other settings on the same document pays it every time. The kept file is
kvfile's (safetensors, checksummed, written atomically) with the prompt's last logits beside its
K/V and last queries, so the resumed run draws its first token from them right after the seed and
goes on exactly as after a prefill: the same tokens, greedy or sampled.

- Where: $TRIFORCE_CACHE/prompts, by default ~/.cache/triforce/prompts (model/files.py cache_home).
- Key: everything the K/V depend on (run_key: the model's files, dtype, weights' format, KV dtype,
  RoPE scaling, prefill piece, device type, torch, the tensor-parallel rank) and the prompt's ids.
  A file made for anything else, or corrupt, is never used: the run says so and prefills.
- Which prompts: Settings.prompt_cache "auto" keeps a prompt whose prefill took PROMPT_CACHE_SECONDS
  or more (a shorter one costs less to compute again than to keep), "on" every one, "off" none and
  loads none.
- Another question about a kept document: a prompt whose first tokens were reused from a kept one
  (runtime/prefill.py) is kept as the K/V of its other tokens, naming that file (kvfile.save's
  `after`), so many questions take the room of one document, and keeping one writes only its own.
- How much: the folder stays within 16 GiB ($TRIFORCE_PROMPT_CACHE_GIB sets another limit: limit_bytes),
  the least recently used files removed first (a file some other continues counts as used when
  that one is, and goes after it); no file is written that would leave the disk less
  than RESERVE_BYTES.
- Tensor parallelism: each rank keeps its own shard; a run loads only when every rank can, and keeps
  when rank 0 decides to.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

import torch

from triforce.model.errors import UserError
from triforce.model.files import cache_home
from triforce.speculative import kvfile

from . import learned

PROMPT_CACHE_SECONDS = 1.0
LIMIT_BYTES = 16 << 30
LIMIT_VARIABLE = "TRIFORCE_PROMPT_CACHE_GIB"  # another limit, in GiB (limit_bytes)
RESERVE_BYTES = 1 << 30


def folder_key(folder: str | Path) -> dict:
    """A checkpoint folder as a key: its path, config.json's hash, and its weight files by size and
    mtime (hashing gigabytes would cost more than the prefill saves)."""
    model = Path(folder).resolve()
    weights = sorted([p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in model.glob("*.safetensors"))
    return {"model": str(model), "config": kvfile.file_digest(model / "config.json"), "weights": weights}


def run_key(session) -> dict:
    """What a prompt's K/V depend on besides its ids."""
    run = session.run
    dist = session.dist
    return folder_key(run.model) | {
            "dtype": run.dtype, "device": torch.device(session.device).type, "torch": torch.__version__,
            # the K/V differ with the weights computed with (stored blocks or dense) and the cache's dtype
            "weights_format": session.weights["format"], "kv_dtype": str(session.kv_dtype),
            "rope_scaling": session.config.rope_scaling, "prefill_chunk": run.prefill_chunk,
            "tp": [dist.rank, dist.world_size] if dist else [0, 1]}


def drafter_key(session) -> dict:
    """What the drafter's StreamingLLM window over a prompt depends on besides the prompt's key."""
    run, draft = session.run, session.draft
    return {"draft": draft if draft in ("self", "lookup") else folder_key(draft), "lower_weights": run.lower_weights,
            "draft_window": run.draft_window, "sinks": run.sinks}


def ids_digest(ids: list[int]) -> str:
    return hashlib.sha256(torch.tensor(ids, dtype=torch.int64).numpy().tobytes()).hexdigest()


def prompt_entry(session) -> tuple[Path, dict]:
    """(file, key) of this session's prompt."""
    key = run_key(session) | {"kind": "prompt", "prompt": ids_digest(session.prompt_ids)}
    rank, world = key["tp"]
    # the ranks' shards share a name, then say their rank (each file's own key holds it)
    digest = hashlib.sha256(kvfile.key_text(dict(key, tp=world)).encode()).hexdigest()[:24]
    return cache_home() / "prompts" / f"{digest}{f'-rank{rank}' if world > 1 else ''}.safetensors", key


def restore(session, gen) -> Path | None:
    """Stand `gen` where prefill(session.prompt_ids) would, from a kept file (its loading counted as
    the prefill's time); the file, or None when the prompt must be prefilled."""
    if session.run.prompt_cache == "off":
        return None
    path, key = prompt_entry(session)
    start = time.perf_counter()
    loaded = None
    if path.exists():
        try:
            loaded = kvfile.load_prompt(path, gen, key, session.prompt_ids)
        except kvfile.CacheInvalid as e:
            say(session, f"the kept prompt {path} {e}: prefilling it again")
    if session.dist is not None and not session.dist.all_agree(loaded is not None):
        if loaded is not None:  # another rank's file is unusable: all ranks prefill, in lockstep
            gen.full.cache.rollback(0)
        return None
    if loaded is None:
        return None
    queries, logits = loaded
    window = kept_window(session, path, key)
    gen.resume(session.prompt_ids, queries, logits=logits, window=window)
    gen.stats.prefill_seconds = time.perf_counter() - start
    if window is None:  # computed by this resume: kept for the next
        keep_window(session, gen.drafter_window(), path, key)
    try:
        os.utime(path)  # recently used: the last to be removed
    except OSError:
        pass
    say(session, f"loaded the prefilled prompt from {path} in {gen.stats.prefill_seconds:.1f} s "
                  "(Settings.prompt_cache off: prefill it)")
    return path


def keep(session, gen, after: tuple[Path, int] | None = None) -> Path | None:
    """After prefill(session.prompt_ids): write the prompt's state for the next run, if the setting
    (and under tensor parallelism rank 0) says so and the disk has room; the file, or None. `after`
    (file, tokens): the prefill reused that kept prompt's first tokens, so only the others are
    written, with a link to it (kvfile.save), unless it and they together are over the limit."""
    setting = session.run.prompt_cache
    wanted = setting == "on" or setting == "auto" and gen.stats.prefill_seconds >= PROMPT_CACHE_SECONDS
    if session.dist is not None:
        wanted = bool(session.dist.follow_main(int(wanted)))
    if not wanted or gen.prompt_logits is None:
        return None
    path, key = prompt_entry(session)
    per_token, tokens = gen.full.cache.shape.bytes_per_token, len(session.prompt_ids)
    chain = linked_files(after[0]) if after else []
    if after and (not chain or per_token * (tokens - after[1]) + sum(_size(f) for f in chain) > limit_bytes()):
        after, chain = None, []  # its first tokens' file is gone, or the two are over the limit: keep it whole
    size = per_token * (tokens - (after[1] if after else 0))
    try:
        full = no_room(path, size, spare=chain)
        if full:
            say(session, f"not keeping the prefilled prompt: {full}")
            return None
        start = time.perf_counter()
        kvfile.save(path, gen, session.prompt_ids, kvfile.last_queries(gen), key, logits=gen.prompt_logits, after=after)
        keep_window(session, gen.drafter_window(), path, key)
    except OSError as e:
        say(session, f"could not keep the prefilled prompt ({e}); the next run prefills it again")
        return None
    what = f"the {tokens - after[1]:,} tokens after those of {after[0].name}, " if after else ""
    say(session, f"kept the prefilled prompt in {path} ({what}{_gib(size)}, {time.perf_counter() - start:.1f} s): "
                  "the next run of this prompt skips its prefill (Settings.prompt_cache off: neither)")
    return path


def limit_bytes() -> int:
    """The folder's limit: $TRIFORCE_PROMPT_CACHE_GIB gibibytes, else LIMIT_BYTES. A 7B model's K/V at
    128K tokens take about 64 GiB, over the default, which is sized for a laptop's disk."""
    value = os.environ.get(LIMIT_VARIABLE)
    if not value:
        return LIMIT_BYTES
    try:
        gib = float(value)
        if gib < 0:
            raise ValueError
    except ValueError:
        raise UserError(f"{LIMIT_VARIABLE}={value!r} is not a size in GiB; set a number such as 64, or unset it "
                        f"for the default {_gib(LIMIT_BYTES)}") from None
    return int(gib * 2**30)


def no_room(path: Path, size: int, spare=()) -> str | None:
    """Why `size` bytes cannot be kept at `path` (over the folder's limit, or the disk's room once the
    least recently used files but `spare` made way), or None when they can; OSError where the folder
    cannot be made."""
    limit = limit_bytes()
    if size > limit:
        return (f"{_gib(size)} is over the prompt cache's {_gib(limit)} "
                f"({LIMIT_VARIABLE}={-(-size // 2**30) + 1} would keep it)")
    path.parent.mkdir(parents=True, exist_ok=True)
    make_room(path.parent, limit - size, spare)
    if shutil.disk_usage(path.parent).free < size + RESERVE_BYTES:
        return f"{_gib(size)} would leave {path.parent} short of space"
    return None


WINDOW = ("k", "v", "state", "prompt")  # Generator.drafter_window()'s tensors, in the order they are written


def window_entry(session, path: Path, key: dict) -> tuple[Path, dict]:
    """(file, key) of the drafter's window beside a kept prompt `path` whose key is `key`."""
    key = key | {"drafter": drafter_key(session)}
    rank, world = key["tp"]
    digest = hashlib.sha256(kvfile.key_text(dict(key, tp=world)).encode()).hexdigest()[:12]
    shard = f"-rank{rank}" if world > 1 else ""  # the ranks' files end alike (prompt_entry, book.cache_path)
    return path.with_name(f"{path.stem.removesuffix(shard)}.window-{digest}{shard}.safetensors"), key


def kept_window(session, path: Path, key: dict) -> dict | None:
    """The drafter's window kept beside the prompt `path` (key `key`), where every rank has one."""
    file, file_key = window_entry(session, path, key)
    window = None
    if file.exists():
        try:
            window = kvfile.load_tensors(file, file_key, WINDOW)
        except kvfile.CacheInvalid as e:
            say(session, f"the kept drafter window {file} {e}: computing it again")
            file.unlink(missing_ok=True)  # so that the window computed now is kept in its place
    if session.dist is not None and not session.dist.all_agree(window is not None):
        return None  # ranks restore or compute it together: computing runs collectives
    return window


def keep_window(session, window: dict | None, path: Path, key: dict) -> None:
    """Write the drafter's window beside the prompt `path`, unless it is there already; best effort."""
    file, file_key = window_entry(session, path, key)
    if window is None or file.exists():
        return
    try:
        kvfile.save_tensors(file, {name: window[name] for name in WINDOW}, file_key)
    except OSError:
        pass  # the next load computes it, as before


def make_room(folder: Path, room: int, spare=()) -> None:
    """Remove kept prompts (and checkpoints of interrupted prefills: runtime/prefill.py), least
    recently used first, until those left take at most `room` bytes; never the files in `spare`. A
    file that others continue (kvfile.save's `after`) counts as used when the latest of them was,
    and goes after them: none is left naming a removed file."""
    files, parents = {}, {}
    for f in [*folder.glob("*.safetensors"), *folder.glob("*.partial/*.safetensors")]:
        try:
            files[f] = [f.stat().st_mtime, f.stat().st_size, 0]  # used, bytes, files it continues
        except OSError:  # removed meanwhile (another rank, another run)
            pass
    for f in files:
        if f.parent == folder and ".window-" not in f.name:
            parents[f] = [link for link in linked_files(f)[1:] if link in files]
    for f, links in parents.items():
        files[f][2] = len(links)
        for link in links:
            files[link][0] = max(files[link][0], files[f][0])
    total = sum(size for _, size, _ in files.values())
    spare = set(spare)
    for f, (_, size, _) in sorted(files.items(), key=lambda item: (item[1][0], -item[1][2])):
        if total <= room:
            break
        if f not in spare:
            f.unlink(missing_ok=True)
            learned.state_path(f).unlink(missing_ok=True)  # what runs of that prompt learned (if any)
            total -= size


def linked_files(path: Path) -> list[Path]:
    """The kept prompt `path` and those it continues, nearest first, as far as they exist; [] where
    it does not."""
    chain = []
    while path is not None and path.exists() and path not in chain and len(chain) <= kvfile.MAX_LINKS:
        chain.append(path)
        link = kvfile.continues(path)
        path = link[0] if link else None
    return chain


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def describe(cache: dict, setting: str) -> str:
    """The statistics' line: where this run's prompt K/V came from, or why they were not kept."""
    if cache["loaded"]:  # the file's name is in the note above the text; a table cell would cut it
        return "loaded: a run before kept this prompt's prefill"
    reused = f"{cache['reused']:,} tokens reused from a run before, " if cache.get("reused") else ""
    if cache["kept"]:
        return f"{reused}kept: the next run of this prompt skips its prefill"
    if setting == "off":
        return "off (--prompt-cache off)"
    return f"{reused}not kept ({'--prompt-cache on, but it could not be written' if setting == 'on' else f'prefills under {PROMPT_CACHE_SECONDS:g} s are not'})"


def say(session, note: str) -> None:
    if session.is_main:
        session.say(note)


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
