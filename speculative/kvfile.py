"""A prefilled prompt on disk: save the full KV cache once, restore a Generator from it in seconds.

What a Generator needs to stand exactly where prefill(prompt) left it (minus the first sampled
token, which a chat never uses: the user's turn follows the prompt):
    K, V of the prompt      the full cache's [:length], per layer, in the model's dtype
    the prompt's token ids  so the levels know what the cache holds
    the last token's query  per layer (rotated): the retrieval cache is scored with it
`Generator.resume(prompt, queries)` then rebuilds the retrieval cache from the restored full cache
and the drafter's StreamingLLM state from the prompt's sinks and last window (both cheap next to
a prefill).

File format: safetensors (readable by any safetensors tool), written by a small streaming writer
so saving a long cache never copies it whole. Metadata holds the caller's key (what the cache
was computed from: model, dtype, prompt, RoPE scaling...) and a sha256 over the key and every
tensor byte. A file whose key differs, whose checksum fails or that does not parse is never
used: `load` raises `CacheInvalid` and the caller prefills again. Writes go to a temporary file
in the same folder and are renamed into place (os.replace), so a crash leaves no half file.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import torch

from .caches import FullCache
from .engine import Generator

FORMAT = "triforce-kv/1"
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
           torch.int64: "I64"}
_DIGEST_PLACEHOLDER = "0" * 64


class CacheInvalid(Exception):
    """The file cannot be used (corrupt, truncated, or made for something else); says why."""


def supported(gen: Generator) -> bool:
    """Only the in-memory FullCache is restorable for now (the offloaded store has its own layout)."""
    return type(gen.full.cache) is FullCache


def last_queries(gen: Generator) -> list[torch.Tensor]:
    """Per layer (Hq, D): the rotated query of the newest token, right after prefill()."""
    return [q[-1].detach().clone() for q in gen.full.cache.queries]


# ---------------------------------------------------------------------------------------- writing
def save(path: str | Path, gen: Generator, prompt: list[int], queries: list[torch.Tensor], key: dict) -> int:
    """Write the prompt's state atomically; returns the file size in bytes."""
    path = Path(path)
    n = len(prompt)
    k, v = gen.full.cache.slice(0, n)  # (layers, kv_heads, n, head_dim) views, no copy
    tensors = [("prompt", lambda: torch.tensor(prompt, dtype=torch.int64), (n,), torch.int64),
               ("queries", lambda: torch.stack(queries), (len(queries), *queries[0].shape), queries[0].dtype)]
    for layer in range(k.shape[0]):
        shape = tuple(k.shape[1:])
        tensors.append((f"k.{layer}", lambda t=k[layer]: t, shape, k.dtype))
        tensors.append((f"v.{layer}", lambda t=v[layer]: t, shape, v.dtype))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        _write_safetensors(tmp, tensors, key_text(key))
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
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise CacheInvalid(f"has format {meta.get('format')!r}, not {FORMAT}")
            if meta.get("key") != key_text(key):
                raise CacheInvalid("was made for another model, book or setting")
            digest = hashlib.sha256(meta["key"].encode())
            stored = _read(f, "prompt", digest)
            if stored.tolist() != list(prompt):
                raise CacheInvalid("holds another prompt")
            queries = _read(f, "queries", digest)
            _read_kv(f, gen.full.cache, len(prompt), digest)
            if digest.hexdigest() != meta.get("sha256"):
                raise CacheInvalid("is corrupt (checksum mismatch)")
            gen.full.cache.used = gen.full.cache.length = len(prompt)  # slot i holds token i
    except CacheInvalid:
        raise
    except Exception as e:  # safetensors / OS errors on a truncated or mangled file
        raise CacheInvalid(f"cannot be read ({type(e).__name__}: {str(e)[:80]})") from None
    return [q.to(gen.full.cache.k.device) for q in queries.unbind(0)]  # safetensors reads to the CPU


def _read(f, name: str, digest) -> torch.Tensor:
    t = f.get_tensor(name)
    digest.update(_bytes(t))
    return t


def _read_kv(f, cache: FullCache, n: int, digest) -> None:
    layers, heads, _, dim = cache.k.shape
    if n > cache.capacity:
        raise CacheInvalid(f"holds {n} tokens, more than the cache's {cache.capacity}")
    for layer in range(layers):
        for name, buf in ((f"k.{layer}", cache.k), (f"v.{layer}", cache.v)):
            t = _read(f, name, digest)
            if t.shape != (heads, n, dim) or t.dtype != buf.dtype:
                raise CacheInvalid(f"has {name} of {tuple(t.shape)} {t.dtype}, expected {(heads, n, dim)} {buf.dtype}")
            buf[layer, :, :n].copy_(t)


def file_digest(path: str | Path) -> str:
    """sha256 of a file's bytes (to key a cache by a file's contents)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
