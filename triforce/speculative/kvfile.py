"""A prefilled prompt on disk: save the full KV cache once, restore a Generator from it in seconds,
and checkpoint a long prefill as it goes so an interruption loses at most one checkpoint.

What a Generator needs to stand exactly where prefill(prompt) left it (minus the first sampled
token, which a chat never uses: the user's turn follows the prompt):
    K, V of the prompt      the full cache's [:length], per layer, in the model's dtype
    the prompt's token ids  so the levels know what the cache holds
    the last token's query  per layer (rotated): the retrieval cache is scored with it
`Generator.resume(prompt, queries)` then rebuilds the retrieval cache from the restored full cache
and the drafter's StreamingLLM state from the prompt's sinks and last window (both cheap next to
a prefill). Any full cache works (`model.kv.FullKV`: on the device, or offloaded to host memory).

File format: safetensors (readable by any safetensors tool), written by a small streaming writer
so saving a long cache never copies it whole. Metadata holds the caller's key (what the cache
was computed from: model, dtype, prompt, RoPE scaling...) and a sha256 over the key and every
tensor byte. A file whose key differs, whose checksum fails or that does not parse is never
used: `load` raises `CacheInvalid` and the caller prefills again. Writes go to a temporary file
in the same folder and are renamed into place (os.replace), so a crash leaves no half file.

A kept prompt may hold only the tokens after another's (save's `after`: a second question about a
document kept with the first): its key names that file and how many of its tokens come first, and
loading reads that file's first, then its own. Links never loop (each file was kept after the one
it names) and are followed at most MAX_LINKS deep.

Checkpoints (`Checkpoints`) are files of the same format in a folder beside the final file, one per
stretch of prefilled tokens [start, end), each keyed by the caller's key and the prompt up to its
end. A restart loads the longest valid run of them from token 0, discards the rest, and prefill
continues after it.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import time
from pathlib import Path

import torch

from .engine import Generator

FORMAT = "triforce-kv/1"
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
           torch.int64: "I64"}
_DIGEST_PLACEHOLDER = "0" * 64
MAX_LINKS = 64


class CacheInvalid(Exception):
    """The file cannot be used (corrupt, truncated, or made for something else); says why."""


def last_queries(gen: Generator) -> list[torch.Tensor]:
    """Per layer (Hq, D): the rotated query of the newest token, right after prefill()."""
    return [q[-1].detach().clone() for q in gen.full.cache.queries]


# ---------------------------------------------------------------------------------------- writing
def save(path: str | Path, gen: Generator, prompt: list[int], queries: list[torch.Tensor], key: dict,
         logits: torch.Tensor | None = None, after: tuple[Path, int] | None = None) -> int:
    """Write the prompt's state atomically; returns the file size in bytes. With `logits` (the
    prompt's last position), load_prompt can draw the first token again. With `after` (file, tokens):
    the K/V of only the tokens after the first `tokens`, which the kept prompt `file` in the same
    folder holds (made with the same key but another prompt that begins with them); the key names it."""
    n, start = len(prompt), 0
    if after is not None:
        key, start = key | {"continues": [Path(after[0]).name, after[1]]}, after[1]
    tensors = [("prompt", lambda: torch.tensor(prompt, dtype=torch.int64), (n,), torch.int64),
               ("queries", lambda: torch.stack(queries), (len(queries), *queries[0].shape), queries[0].dtype)]
    if logits is not None:
        tensors.append(("logits", lambda: logits, tuple(logits.shape), logits.dtype))
    return _write_atomic(Path(path), tensors + _kv_tensors(gen.full.cache, start, n), key_text(key))


def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor], key: dict) -> int:
    """Named tensors in the same format, atomically (a drafter's window beside a saved prompt)."""
    return _write_atomic(Path(path), [(name, lambda t=t: t, tuple(t.shape), t.dtype) for name, t in tensors.items()],
                         key_text(key))


def load_tensors(path: str | Path, key: dict, names) -> dict[str, torch.Tensor]:
    """save_tensors' tensors `names` of a file made for `key`; CacheInvalid as `load`."""
    return _checked(path, key_text(key), lambda f, digest: {name: _read(f, name, digest) for name in names})


def _kv_tensors(cache, start: int, end: int) -> list:
    """(name, make, shape, dtype) of every layer's K and V over tokens [start, end), read lazily."""
    shape = cache.shape
    dims = (shape.num_kv_heads, end - start, shape.head_dim)
    out = []
    for layer in range(shape.num_layers):
        out.append((f"k.{layer}", lambda layer=layer: cache.read(layer, start, end)[0], dims, shape.dtype))
        out.append((f"v.{layer}", lambda layer=layer: cache.read(layer, start, end)[1], dims, shape.dtype))
    return out


def _write_atomic(path: Path, tensors: list, key: str) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        _write_safetensors(tmp, tensors, key)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path.stat().st_size


def _write_safetensors(path: Path, tensors: list, key_text: str) -> None:
    """Header first (offsets are known from the shapes), then each tensor streamed; the digest is
    patched into its fixed-width placeholder in the header at the end."""
    header, offset = {}, 0
    for name, _, shape, dtype in tensors:
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": FORMAT, "key": key_text, "sha256": _DIGEST_PLACEHOLDER}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes with spaces
    digest = hashlib.sha256(key_text.encode())
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, make, _, _ in tensors:
            data = _bytes(make())
            digest.update(data)
            f.write(data)
        field = f'"sha256":"{_DIGEST_PLACEHOLDER}"'.encode()
        f.seek(8 + raw.index(field) + len('"sha256":"'))
        f.write(digest.hexdigest().encode())
        f.flush()
        os.fsync(f.fileno())


def _bytes(t: torch.Tensor):
    """The tensor's raw bytes as a buffer (bf16 included: numpy has no bf16, so view as bytes first)."""
    return t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()


def key_text(key: dict) -> str:
    return json.dumps(key, sort_keys=True, default=str)


# ---------------------------------------------------------------------------------------- reading
def load(path: str | Path, gen: Generator, key: dict, prompt: list[int]) -> list[torch.Tensor]:
    """Read a saved prompt into gen's full cache and return its queries; `gen.resume(prompt, queries)`
    then makes it live. Raises CacheInvalid, having changed no length pointer, when the file is not
    exactly what `key` and `prompt` describe. K/V are copied into the cache's slots while the
    checksum is computed (one pass, one layer in memory at a time); the cache's length becomes the
    prompt's only once every byte is checked."""
    return _load(path, gen, key, prompt, with_logits=False)[0]


def load_prompt(path: str | Path, gen: Generator, key: dict, prompt: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """load's queries, and the prompt's last logits from a file saved with them (else CacheInvalid):
    `gen.resume(prompt, queries, logits=logits)` then stands where prefill(prompt) left it."""
    return _load(path, gen, key, prompt, with_logits=True)


def _load(path, gen: Generator, key: dict, prompt: list[int], with_logits: bool):
    read = _read_linked(Path(path), gen.full.cache, key, prompt, len(prompt), whole=True)
    if with_logits and "logits" not in read:
        raise CacheInvalid("holds no logits")
    gen.full.cache.fill(len(prompt))
    return [q.to(gen.device) for q in read["queries"].unbind(0)], read.get("logits")  # safetensors reads to the CPU


def load_prefix(path: str | Path, gen: Generator, key: dict, prompt: list[int], upto: int) -> None:
    """Read the K/V of prompt[:upto] into gen's full cache from a file saved (by save) for a prompt
    that begins with those ids, made with `key` but for its prompt; the cache then holds upto tokens
    (`gen.restored(prompt[:upto])` makes them live; prefill continues after them). The whole file is
    read, as its checksum covers every byte: worth it where most of it is used. CacheInvalid as `load`."""
    _read_linked(Path(path), gen.full.cache, key, prompt, upto, whole=False)
    gen.full.cache.fill(upto)


def continues(path: str | Path) -> tuple[Path, int] | None:
    """(file, tokens) that a kept prompt saved with save's `after` continues, read from its header;
    None for a whole one (or a file that cannot be read: its load says why)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            link = json.loads((f.metadata() or {}).get("key") or "{}").get("continues")
        return (Path(path).with_name(Path(link[0]).name), int(link[1])) if link else None
    except Exception:
        return None


def _read_linked(path: Path, cache, key: dict, prompt: list[int], upto: int, whole: bool, links: int = 0) -> dict:
    """Read prompt[:upto]'s K/V into the cache from the kept prompt `path` and those it continues
    (each checked whole); its tensors other than K/V by name. `whole`: the file is prompt's, made with
    `key`; else any prompt's that begins with prompt[:upto], made with `key` but its prompt."""
    if links > MAX_LINKS:
        raise CacheInvalid(f"continues more than {MAX_LINKS} kept prompts")
    base = _run_text(key, whole)
    link = None

    def body(f, digest):
        nonlocal link
        link = json.loads(f.metadata()["key"]).get("continues")
        start = int(link[1]) if link else 0
        read = {name: _read(f, name, digest) for name in ("prompt", "queries", "logits") if name in f.keys()}
        saved = read["prompt"]  # in the order save() wrote them
        if whole and saved.tolist() != list(prompt):
            raise CacheInvalid("holds another prompt")
        if saved.shape[0] < upto or saved[:upto].tolist() != list(prompt[:upto]):
            raise CacheInvalid(f"does not begin with this prompt's first {upto} tokens")
        _read_kv(f, cache, start, saved.shape[0], digest, upto=max(upto, start))
        return read

    read = _checked(path, key_text(key), body, same=lambda stored: _run_text(json.loads(stored), whole) == base)
    if link:
        parent = path.with_name(Path(link[0]).name)
        if not parent.exists():
            raise CacheInvalid(f"continues {parent.name}, which is no longer kept")
        _read_linked(parent, cache, key, prompt, min(upto, int(link[1])), whole=False, links=links + 1)
    return read


def _run_text(key: dict, whole: bool) -> str:
    """A key's text without its link to another file, and, unless `whole`, without its prompt."""
    return key_text({k: v for k, v in key.items() if k != "continues" and (whole or k != "prompt")})


def _checked(path: str | Path, key: str, body, same=None):
    """body(file, digest) over a file whose format and key are right (its key's text is `key`, or
    same(its key's text) holds); CacheInvalid unless the digest of the stored key and of every byte
    body read matches the stored one."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise CacheInvalid(f"has format {meta.get('format')!r}, not {FORMAT}")
            stored = meta.get("key")
            if not (same(stored) if same and stored else stored == key):
                raise CacheInvalid("was made for another model, book or setting")
            digest = hashlib.sha256(stored.encode())
            result = body(f, digest)
            if digest.hexdigest() != meta.get("sha256"):
                raise CacheInvalid("is corrupt (checksum mismatch)")
            return result
    except CacheInvalid:
        raise
    except Exception as e:  # safetensors / OS errors on a truncated or mangled file
        raise CacheInvalid(f"cannot be read ({type(e).__name__}: {str(e)[:80]})") from None


def _read(f, name: str, digest) -> torch.Tensor:
    t = f.get_tensor(name)
    digest.update(_bytes(t))
    return t


def _read_kv(f, cache, start: int, end: int, digest, upto: int | None = None) -> None:
    """The file's K/V of tokens [start, end) into the cache, those before `upto` (default: all)."""
    shape, upto = cache.shape, end if upto is None else upto
    if upto > cache.capacity:
        raise CacheInvalid(f"holds {upto} tokens, more than the cache's {cache.capacity}")
    expected = (shape.num_kv_heads, end - start, shape.head_dim)
    for layer in range(shape.num_layers):
        k, v = _read(f, f"k.{layer}", digest), _read(f, f"v.{layer}", digest)
        for name, t in ((f"k.{layer}", k), (f"v.{layer}", v)):
            if tuple(t.shape) != expected or t.dtype != shape.dtype:
                raise CacheInvalid(f"has {name} of {tuple(t.shape)} {t.dtype}, expected {expected} {shape.dtype}")
        if upto > start:
            cache.write(layer, start, k[:, :upto - start], v[:, :upto - start])


def file_digest(path: str | Path) -> str:
    """sha256 of a file's bytes (to key a cache by a file's contents)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------- checkpoints
class Checkpoints:
    """A prefill of `prompt` into `gen` that survives being interrupted.

        cp = Checkpoints(folder, gen, key, prompt)
        done = cp.resume()                      # tokens restored from earlier checkpoints (0: none)
        gen.prefill(prompt, progress=lambda n: cp.after(n))   # continues after them
        kvfile.save(...); cp.discard()          # the final file replaces the checkpoints

    A checkpoint is written when `every_seconds` have passed since the last one (or, in tests,
    every `every_tokens` tokens), after a prefill piece completed, so an interruption loses at most
    that much work. Each checkpoint holds its own tokens only: writing them costs the same bytes as
    the final file, once."""

    def __init__(self, folder: str | Path, gen: Generator, key: dict, prompt: list[int],
                 every_seconds: float = 30.0, every_tokens: int | None = None):
        self.folder, self.gen, self.key, self.prompt = Path(folder), gen, key, list(prompt)
        self.every_seconds, self.every_tokens = every_seconds, every_tokens
        self.saved = 0  # prompt tokens held by valid checkpoints
        self.last_time = time.monotonic()

    def _key(self, start: int, end: int) -> str:
        prefix = hashlib.sha256(torch.tensor(self.prompt[:end], dtype=torch.int64).numpy().tobytes()).hexdigest()
        return key_text({**self.key, "checkpoint": [start, end], "prompt_prefix": prefix})

    def _path(self, start: int, end: int) -> Path:
        return self.folder / f"{start:010d}-{end:010d}.safetensors"

    def resume(self) -> int:
        """Load the longest valid run of checkpoints from token 0 into the full cache; delete the others.
        Returns the tokens restored; the generator's full level then holds them (prefill continues)."""
        cache = self.gen.full.cache
        files = sorted(self.folder.glob("*.safetensors")) if self.folder.is_dir() else []
        for path in files:
            start, end = _range(path)
            try:
                if start != self.saved or not start < end <= len(self.prompt):
                    raise CacheInvalid("does not continue the checkpoints before it")
                _checked(path, self._key(start, end), lambda f, digest: _read_kv(f, cache, start, end, digest))
            except CacheInvalid:
                path.unlink(missing_ok=True)  # recomputed, never used
                continue
            self.saved = end
        if self.saved:
            cache.fill(self.saved)
            self.gen.restored(self.prompt[:self.saved])
        return self.saved

    def after(self, _new_tokens: int = 0) -> None:
        """A prefill piece completed: write a checkpoint of what is new, if one is due."""
        done = min(self.gen.full.cache.length, len(self.prompt))
        due = (done - self.saved >= self.every_tokens if self.every_tokens
               else time.monotonic() - self.last_time >= self.every_seconds)
        if done > self.saved and due:
            self._write(self.saved, done)

    def flush(self) -> None:
        """Write a checkpoint of every completed piece not yet saved (an interrupted prefill)."""
        done = min(self.gen.full.cache.length, len(self.prompt))
        if done > self.saved:
            self._write(self.saved, done)

    def _write(self, start: int, end: int) -> None:
        _write_atomic(self._path(start, end), _kv_tensors(self.gen.full.cache, start, end), self._key(start, end))
        self.saved, self.last_time = end, time.monotonic()

    def discard(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _range(path: Path) -> tuple[int, int]:
    try:
        start, end = path.stem.split("-")
        return int(start), int(end)
    except ValueError:
        return -1, -1
