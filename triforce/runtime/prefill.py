"""A prompt's prefill that starts from what earlier runs kept (`triforce generate`, the Python API):

- checkpoints of this very prompt, written every CHECKPOINT_SECONDS while it is prefilled, in a
  folder beside the file the prompt cache would keep it in: an interrupted prefill (Ctrl-C, a
  closed terminal, a killed job) resumes where the last checkpoint ended;
- else the longest prompt the cache kept that this one begins with (another question after the same
  document, a document that grew, a longer instruction after the same book): its first tokens' K/V
  are loaded and the prefill computes only the rest, and the prompt is kept as the K/V of the rest,
  naming that file (prompt_cache.keep's `after`).

Either way the cache ends exactly as a prefill from token 0 leaves it, so the run makes the same
tokens bit for bit: the reused tokens end on a boundary of the prefill's pieces (Settings.
prefill_chunk; 4,096 tokens on a CPU, 2,048 on a GPU), so the pieces computed after them are the
pieces a whole prefill computes, over the same K/V. A kept prompt is read whole, since its checksum
covers every byte, so one is reused only where at least half of it is.

Under tensor parallelism every rank reuses the same tokens or none does: the ranks' passes run in
lockstep.
"""
from __future__ import annotations

import json
import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from triforce.speculative import kvfile

from .prompt_cache import keep, linked_files, no_room, prompt_entry, say

# An interrupted prefill loses at most this much work; a checkpoint of a few thousand tokens costs
# well under a second to write, next to tens of seconds of prefill on a CPU
CHECKPOINT_SECONDS = float(os.environ.get("SPEC_CHECKPOINT_SECONDS", "30"))


def prefill(session, gen, on_prefill=None, watch=None) -> tuple[int, Path | None]:
    """Prefill session.prompt_ids into `gen`, resuming from checkpoints of this prompt or reusing a
    kept prompt it begins with, then keep it (prompt_cache.keep); (tokens reused, file kept or None).
    on_prefill(n): 0 when the prefill starts, then the tokens reused (one call, if any), then each
    piece computed. session.prompt_cache["reused"] says the reused tokens before on_prefill(0).
    watch(model): a context manager around the prefill (the command line's bar watches layers)."""
    prompt = session.prompt_ids
    checkpoints, writing, reused, after = None, False, 0, None
    if session.run.prompt_cache != "off":
        path, key = prompt_entry(session)
        checkpoints = kvfile.Checkpoints(path.with_suffix(".partial"), gen, key, prompt,
                                         every_seconds=CHECKPOINT_SECONDS)
        reused = resume_checkpoints(checkpoints, gen, session.dist)
        if reused:
            say(session, f"resuming the prefill from a checkpoint: {reused:,} of {len(prompt):,} tokens done")
        else:
            after = reuse_kept_prefix(session, gen, path, key)
            reused = after[1] if after else 0
        # checkpoints only of a prompt the cache could keep: they take its bytes by the end (making
        # room for them never removes the files whose tokens were just reused)
        spare = linked_files(after[0]) if after else []
        writing = _no_room(path, gen.full.cache.shape.bytes_per_token * len(prompt), spare) is None
    session.prompt_cache["reused"] = reused
    if on_prefill:
        on_prefill(0)
        if reused:
            on_prefill(reused)

    def step(n: int) -> None:
        if on_prefill:
            on_prefill(n)
        if writing:
            checkpoints.after(n)

    try:
        with watch(gen.full.model) if watch else nullcontext():
            gen.prefill(prompt, progress=step)
    except KeyboardInterrupt:
        if writing:
            say_kept(checkpoints, len(prompt), session.say if session.is_main else lambda _: None,
                     "the next run of this prompt resumes from there")
        raise
    kept = keep(session, gen, after)
    if checkpoints is not None:
        checkpoints.discard()  # the kept file holds it all now (or it was not worth keeping)
    return reused, kept


def _no_room(path: Path, size: int, spare) -> str | None:
    try:
        return no_room(path, size, spare)
    except OSError as e:
        return str(e)


def resume_checkpoints(checkpoints: kvfile.Checkpoints, gen, dist) -> int:
    """Checkpoints.resume() on every rank, or on none: unless every rank resumes from the same token
    (one rank's files gone), all start from 0, since their passes run in lockstep."""
    resumed = checkpoints.resume()
    if dist is not None and not dist.all_agree(resumed == dist.share(lambda: resumed)):
        gen.full.rollback(0)
        checkpoints.saved = resumed = 0
    return resumed


def say_kept(checkpoints: kvfile.Checkpoints, total: int, warn, next_start: str) -> None:
    """An interrupted prefill: write what the cache holds as a last checkpoint, and say how much."""
    try:
        checkpoints.flush()
    except (OSError, KeyboardInterrupt):
        pass  # the checkpoints written before stand
    warn(f"the prefill stopped: {checkpoints.saved:,} of {total:,} tokens ({checkpoints.saved / total:.0%}) are kept; "
         f"{next_start}")


def reuse_kept_prefix(session, gen, path: Path, key: dict) -> tuple[Path, int] | None:
    """Load the longest piece-aligned prefix of this prompt that a kept prompt holds into gen's full
    cache; (that file, the tokens loaded), or None: none fits, a file failed, or the ranks disagree."""
    prompt, dist = session.prompt_ids, session.dist
    found = longest_kept_prefix(path, key, prompt, gen.full.cache.max_feed)
    if dist is not None:
        rank = key["tp"][0]
        mine = None if found is None else (found[0].name.replace(f"-rank{rank}.", "."), found[1])
        if not dist.all_agree(mine == dist.share(lambda: mine)):
            found = None
    if found is None:
        return None
    file, upto = found
    start = time.perf_counter()
    try:
        kvfile.load_prefix(file, gen, key, prompt, upto)
        loaded = True
    except kvfile.CacheInvalid as e:
        say(session, f"the kept prompt {file} {e}: prefilling without it")
        file.unlink(missing_ok=True)
        loaded = False
    if dist is not None and not dist.all_agree(loaded):
        loaded = False
    if not loaded:
        gen.full.cache.rollback(0)
        return None
    gen.restored(prompt[:upto])
    gen.stats.prefill_seconds += time.perf_counter() - start
    try:
        os.utime(file)  # recently used: the last to be removed
    except OSError:
        pass
    say(session, f"reusing the first {upto:,} of {len(prompt):,} prompt tokens from the kept prompt {file} "
                  f"({time.perf_counter() - start:.1f} s); prefilling the other {len(prompt) - upto:,}")
    return file, upto


def longest_kept_prefix(path: Path, key: dict, prompt: list[int], piece: int) -> tuple[Path, int] | None:
    """(file, tokens) of the kept prompt beside `path` made with this run's key (but another prompt)
    that shares the most whole prefill pieces with `prompt`, leaving at least one token of it to
    compute, and whose load reads at most twice the tokens it gives; of those sharing as many, the one
    whose load reads the least: where only a document's tokens are shared, the document's file rather
    than a question's that continues it (kvfile.save's `after`). None where none fits."""
    rank, world = key["tp"]
    kept = _kept_prompts(path, key, rank if world > 1 else None)
    ids = torch.tensor(prompt, dtype=torch.int64)
    best = None  # (tokens, -tokens read, file)
    for file, (saved, _) in kept.items():
        n = min(saved.shape[0], len(prompt) - 1)  # the prompt's last token is always computed: its logits
        differ = (saved[:n] != ids[:n]).nonzero()
        upto = (int(differ[0]) if differ.numel() else n) // piece * piece
        read = _tokens_read(kept, file)
        if upto > 0 and read is not None and 2 * upto >= read and (best is None or (upto, -read) > best[:2]):
            best = (upto, -read, file)
    return None if best is None else (best[2], best[0])


def _kept_prompts(path: Path, key: dict, rank: int | None) -> dict[Path, tuple[torch.Tensor, tuple | None]]:
    """The kept prompts beside `path` (this rank's) made with `key` but for their prompt: file ->
    (its prompt's ids, (file, tokens) it continues or None)."""
    from safetensors import safe_open

    wanted = json.loads(kvfile.key_text({k: v for k, v in key.items() if k != "prompt"}))
    kept = {}
    for file in path.parent.glob(f"*-rank{rank}.safetensors" if rank is not None else "*.safetensors"):
        if file == path or ".window-" in file.name:
            continue
        try:
            with safe_open(str(file), framework="pt") as f:
                file_key = json.loads((f.metadata() or {}).get("key") or "null")
                if not isinstance(file_key, dict):
                    continue
                link = file_key.pop("continues", None)
                if {k: v for k, v in file_key.items() if k != "prompt"} != wanted:
                    continue
                kept[file] = (f.get_tensor("prompt"), (path.with_name(Path(link[0]).name), int(link[1])) if link else None)
        except Exception:  # a damaged or foreign file: not a candidate (a load would say why)
            continue
    return kept


def _tokens_read(kept: dict, file: Path) -> int | None:
    """The tokens a load from `file` reads: its own and those of every file it continues, whole (None
    where one is not kept)."""
    read = 0
    for _ in range(kvfile.MAX_LINKS):
        if file not in kept:
            return None
        saved, link = kept[file]
        read += saved.shape[0] - (link[1] if link else 0)
        if link is None:
            return read
        file = link[0]
    return None
