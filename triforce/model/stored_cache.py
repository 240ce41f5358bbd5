"""The packed model of a GGUF kept on disk, so that a second stored load maps a file instead of
parsing the GGUF, decoding every block and repacking it for the kernel (Qwen2.5-Coder-1.5B: ~6 s
and more, against 0.2 s for its dequantized folder).

The file sits beside the GGUF (models/.cache for prepared folders):
<gguf name>.<dtype>.packed.safetensors, every tensor of the model's state as loaded, and in its
metadata what it was built from: the GGUF's SHA-256, torch's version, the CPU capability torch
dispatches to (the int4 kernel packs per ISA), the dtype, the float32 route and FORMAT (bumped when
the packed buffers change), plus the GGUF's tensor table and model config, which rebuild the
modules without the GGUF.
A file whose key differs, or that does not read, is rebuilt with a one-line note on stderr.
TRIFORCE_STORED_CACHE=0 turns the cache off.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

from . import stored_avx2, stored_bf16, stored_f32
from .config import ModelConfig

FORMAT = "3"  # 2: float32 Q8_0/Q5_0 layers hold bytes (ByteCodesLinear); 3: bf16 block records (stored_bf16)


def enabled() -> bool:
    return os.environ.get("TRIFORCE_STORED_CACHE", "1") != "0"


def cache_path(gguf: Path, dtype: torch.dtype) -> Path:
    return gguf.parent / f"{gguf.name}.{str(dtype).removeprefix('torch.')}.packed.safetensors"


def cache_key(sha256: str, dtype: torch.dtype) -> dict[str, str]:
    # float32 layers hold block records (stored_avx2) or the compiled product's buffers, bf16 ones
    # stored_bf16's records, or either the int4 kernel's where their own do not build
    if dtype == torch.float32:
        route = "records" if stored_avx2.available() else "compiled" if stored_f32.available() else "int4pack"
    else:
        route = "records" if dtype == torch.bfloat16 and stored_bf16.available() else "int4pack"
    return {"gguf_sha256": sha256, "torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability(),
            "dtype": str(dtype), "route": route, "format": FORMAT}


def note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr, flush=True)


def read(path: Path, key: dict[str, str]) -> tuple[dict[str, torch.Tensor], dict, ModelConfig] | None:
    """(state, tensor table, config) from a cache file made with `key`; None when there is none, or
    it is stale or unreadable (noted)."""
    if not path.is_file():
        return None
    try:
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        stale = [name for name, value in key.items() if meta.get(name) != value]
        if stale:
            note(f"rebuilding {path.name}: made with another {', '.join(stale)}")
            return None
        table = json.loads(meta["table"])
        cfg = ModelConfig(**json.loads(meta["config"]))
        return load_file(str(path)), table, cfg  # memory-mapped: pages are read as the model touches them
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file of any kind is rebuilt, never fatal
        note(f"rebuilding {path.name}: it does not read ({type(e).__name__}: {str(e)[:80]})")
        return None


def write(path: Path, key: dict[str, str], state: dict[str, torch.Tensor], table: dict, cfg: ModelConfig) -> None:
    """The model's state under `key`, written beside and renamed into place (a reader never sees half a
    file); a folder that cannot be written is noted and skipped."""
    from safetensors.torch import save_file

    # safetensors refuses tensors sharing storage (a fused bias cut into parts): those are copied
    tensors = {name: t.clone() if t.untyped_storage().nbytes() != t.nbytes else t.contiguous()
               for name, t in state.items()}
    meta = dict(key, table=json.dumps(table), config=json.dumps(dataclasses.asdict(cfg)))
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
    except OSError as e:
        note(f"not caching the packed model at {path} ({e.strerror or e})")
        tmp.unlink(missing_ok=True)
