"""Build the model from a GGUF file, its matrices packed as stored (weights="stored") or dense.

A folder made by triforce-prepare records the GGUF it was dequantized from (.prepared.json,
"source_gguf" and "source_sha256"); `gguf_origin` finds that file, so the same folder loads either
way. Which way is the default is measured, once per dtype, by `stored_kernel_pays`.
"""
from __future__ import annotations

import functools
import hashlib
import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from .config import ModelConfig
from .errors import UserError
from .gguf_blocks import BLOCK, FORMS, STORED_TYPES, Blocks, GgufCheckpoint
from . import stored_avx2, stored_bf16, stored_cache, stored_f32
from .rope import Rotary
from .stored import ByteCodesLinear, PackedLinear, StackedOutputs, _int4_kernels_available, concat_blocks, packed_from_blocks
from .transformer import Linear, Transformer
from .files import write_whole

WEIGHTS = ("auto", "stored", "dequantized")
MARKER = ".prepared.json"


def gguf_origin(folder: str | Path) -> Path | None:
    """The GGUF a prepared folder was dequantized from, when it is still there and its SHA-256 is
    the one recorded: else None (the folder's own safetensors are then the model)."""
    folder = Path(folder)
    try:
        meta = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    recorded = meta.get("source_gguf")  # absolute, or relative to the folder
    candidates = [folder / recorded] if recorded else []
    candidates.append(folder.parent / ".cache" / f"{folder.name}.gguf")  # prepare's default cache
    for path in candidates:
        if path.is_file() and _sha256(path) == meta.get("source_sha256"):
            return path
    return None


@functools.lru_cache(maxsize=8)
def _sha256_cached(path: str, *stamp) -> str:  # stamp: the file's version, part of the key only
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _sha256(path: Path) -> str:
    """The file's SHA-256, hashed once per version of the file and remembered beside it
    (<gguf>.sha256.json, as the packed cache sits there): hashing took 0.3 s of every start for
    SmolLM2's 98 MB and about 3 s for a 1 GB GGUF. A version is the file's size, modification and
    change times and inode, as git's index and make tell a changed file: a write to the file, a copy
    over it or a rename onto it changes its change time, which no tool can set."""
    st = path.stat()
    stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}
    remembered = path.parent / f"{path.name}.sha256.json"
    try:
        known = json.loads(remembered.read_text())
        if isinstance(known, dict) and isinstance(known.get("sha256"), str) and \
                all(known.get(k) == v for k, v in stamp.items()):
            return known["sha256"]
    except (OSError, ValueError):
        pass
    digest = _sha256_cached(str(path), *stamp.values())
    write_whole(remembered, json.dumps({**stamp, "sha256": digest}).encode())  # a read-only folder hashes every time
    return digest


@functools.lru_cache(maxsize=None)
def stored_kernel_pays(dtype: torch.dtype) -> bool:
    """True when the stored weights' product beats a dense matmul for one row in `dtype` on this CPU,
    timed on a matrix larger than the last-level cache (both read from memory, as a decode step
    does): torch's packed int4 kernel for bfloat16/float16, the compiled product (stored_f32) for
    float32, the route PackedLinear takes in that dtype. Float32 through stored_avx2's kernels and
    bfloat16 through stored_bf16's pay wherever they build, untimed."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if dtype == torch.float32 and stored_avx2.available():
        # not timed: it reads a fifth of dense float32's bytes and ran 5.6x its speed (bench.f32_routes),
        # where a timing on a machine busy with other jobs came out either way
        return True
    if dtype == torch.bfloat16 and stored_bf16.available():
        # not timed either: bf16 rows take stored_bf16's block kernels (AMX tiles where the CPU has them),
        # not the int4 kernel timed below, and read about a third of dense bf16's bytes. Timed, a core
        # busy with another job flipped the answer (1 run in 3), and with it the weights' arithmetic:
        # the same greedy command wrote another text and ran at half the speed
        return True
    if not _int4_kernels_available() or (dtype == torch.float32 and not stored_f32.available()):
        return False
    rows, cols = 32768, 1024  # 128 MB of float32, 64 MB of bf16, 16 MB of int4 codes
    dense = torch.full((rows, cols), 0.01, dtype=dtype)
    x = torch.ones(1, cols, dtype=dtype)
    if dtype == torch.float32:
        codes = torch.full((rows, cols // 2), 0x35, dtype=torch.uint8)  # values do not change the speed
        scales = torch.full((rows, cols // 32), 0.01)

        def stored():
            return stored_f32.rows_product(x, codes, scales, scales)
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.full((rows, cols), 5, dtype=torch.int32), 1)
        scales_and_zeros = torch.full((cols // 32, rows, 2), 0.01, dtype=dtype)

        def stored():
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales_and_zeros)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    kernel = best(stored)
    plain = best(lambda: torch.nn.functional.linear(x, dense))
    return kernel < 0.7 * plain


def resolve_weights(weights: str, folder: str | Path, device, dtype: torch.dtype, world_size: int = 1) -> str:
    """"stored" or "dequantized" for a load: `auto` is stored on CPU, one rank, a GGUF origin known
    and the packed kernel measured faster in `dtype`; "stored" where that cannot hold is an error."""
    if weights not in WEIGHTS:
        raise UserError(f"unknown weights '{weights}': choose one of {', '.join(WEIGHTS)}")
    if weights == "dequantized":
        return weights
    is_gguf = Path(folder).is_file()
    # cheapest first: a folder without a marker answers at once, a GGUF's hash takes ~3 ms per MB
    possible = torch.device(device).type == "cpu" and world_size == 1 and (is_gguf or gguf_origin(folder) is not None)
    if weights == "stored":
        if not possible:
            raise UserError(f"weights=stored needs the CPU, one rank and a GGUF ({folder} has no recorded "
                            f"GGUF origin, or the device/ranks differ); use weights=dequantized")
        return weights
    pays = possible and stored_kernel_pays(dtype)
    return "stored" if pays and stored_share(folder) >= MIN_STORED_SHARE else "dequantized"


MIN_STORED_SHARE = 0.5  # below this most matrices would be dense anyway: the folder loads faster


def stored_share(folder: str | Path) -> float:
    """The share of the model's matrix weights the packed kernel can take, from the folder's marker
    (prepare records it, with the types it counted) or, for older folders, markers counted with other
    types (before Q4_K, Qwen's were recorded as 0) and GGUF paths, from the GGUF's tensor table."""
    folder = Path(folder)
    if folder.is_dir():
        try:
            meta = json.loads((folder / MARKER).read_text())
            if meta.get("gguf_stored_types") == list(STORED_TYPES):
                return float(meta["gguf_stored_share"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
        folder = gguf_origin(folder)
    return open_checkpoint(str(folder)).stored_share()


def open_checkpoint(path: str) -> GgufCheckpoint:
    """A parsed GGUF (its metadata takes seconds to read for a large vocabulary), kept for the load
    that usually follows the question of whether to load it; a file rewritten since is parsed again."""
    st = Path(path).stat()
    return _open_checkpoint(path, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open_checkpoint(path: str, size: int, mtime_ns: int) -> GgufCheckpoint:
    return GgufCheckpoint(path)



def _reverse_permute_rows(rows: int, heads: int) -> torch.Tensor:
    """llama.cpp's converter interleaves each head's rotary halves in q/k rows; this is the row order
    that undoes it (as transformers' GGUF loader does for llama)."""
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


class _Table:
    """A GGUF's tensor table (names, types, shapes) and config without the GGUF: what a cached packed
    model needs to rebuild its modules (stored_cache)."""

    def __init__(self, table: dict, cfg: ModelConfig):
        self.tensors = {name: SimpleNamespace(tensor_type=SimpleNamespace(name=kind), shape=shape)
                        for name, (kind, shape) in table.items()}
        self.cfg = cfg

    def has(self, name: str) -> bool:
        return name in self.tensors

    def kind(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def config(self) -> ModelConfig:
        return self.cfg


def _table_of(ckpt: GgufCheckpoint) -> dict:
    return {name: (t.tensor_type.name, [int(n) for n in t.shape]) for name, t in ckpt.tensors.items()}


class _Source:
    """Matrices of one GGUF by our names, each packed or dense as asked. With a _Table in place of
    the GGUF every tensor is on the meta device: the modules' shapes, for a cached state to fill."""

    def __init__(self, ckpt: GgufCheckpoint | _Table, cfg: ModelConfig, dtype: torch.dtype, stored: bool):
        self.ckpt, self.cfg, self.dtype, self.stored = ckpt, cfg, dtype, stored
        self.skeleton = isinstance(ckpt, _Table)

    def _meta_blocks(self, name: str) -> Blocks:
        kind, (cols, rows) = self.ckpt.kind(name), self.ckpt.tensors[name].shape
        code_dtype = torch.uint8 if FORMS[kind] == "affine" else torch.int8
        scale = torch.empty(rows, cols // BLOCK, device="meta")
        return Blocks(kind, torch.empty(rows, cols, dtype=code_dtype, device="meta"), scale,
                      scale if FORMS[kind] == "affine" else None)

    def blocks(self, name: str):
        blocks = self._meta_blocks(name) if self.skeleton else self.ckpt.blocks(name)
        if self.cfg.model_type == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = self.cfg.num_heads if ".attn_q." in name else self.cfg.num_kv_heads
            blocks = blocks.rows(_reverse_permute_rows(blocks.shape[0], heads))
        return blocks

    def dense(self, name: str) -> torch.Tensor:
        if self.skeleton:
            return torch.empty(list(reversed(self.ckpt.tensors[name].shape)), device="meta")
        if self.ckpt.kind(name) in STORED_TYPES:
            return self.blocks(name).dequantize(torch.float32)
        w = self.ckpt.dense(name)
        if self.cfg.model_type == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = self.cfg.num_heads if ".attn_q." in name else self.cfg.num_kv_heads
            w = w[_reverse_permute_rows(w.shape[0], heads)]
        return w

    def linear(self, names: list[str], bias: torch.Tensor | None) -> nn.Module:
        """One (fused) projection: packed where its parts are of a stored type, neighbours of one
        packed form (FORMS) stacked into one packed matrix, dense parts likewise; a projection of
        several such runs computes each and stands their outputs side by side."""
        runs = self._runs(names)
        if len(runs) == 1:
            return self._run_linear(names, bias)
        parts, row = [], 0
        for run in runs:
            rows = sum(self.rows(n) for n in run)
            parts.append(self._run_linear(run, None if bias is None else bias[row:row + rows]))
            row += rows
        return StackedOutputs(parts)

    def rows(self, name: str) -> int:
        return int(self.ckpt.tensors[name].shape[1])  # GGUF lists the fastest dimension first

    def _form(self, name: str) -> str:
        """The packed form this matrix takes, or "dense"."""
        kind = self.ckpt.kind(name)
        return FORMS[kind] if self.stored and kind in STORED_TYPES else "dense"

    def _runs(self, names: list[str]) -> list[list[str]]:
        """`names` cut where the form changes (q, k | v for a Q4_K q, k with a Q6_K v)."""
        runs = []
        for name in names:
            if runs and self._form(runs[-1][-1]) == self._form(name):
                runs[-1].append(name)
            else:
                runs.append([name])
        return runs

    def _run_linear(self, names: list[str], bias: torch.Tensor | None) -> nn.Module:
        """Matrices of one form as one projection: packed, or dense."""
        if self._form(names[0]) != "dense":
            return packed_from_blocks(concat_blocks([self.blocks(n) for n in names]), self.dtype, bias)
        weight = torch.cat([self.dense(n) for n in names]).to(self.dtype)
        layer = Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        layer.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            layer.bias = nn.Parameter(bias.to(self.dtype), requires_grad=False)
        return layer

    def vector(self, name: str) -> torch.Tensor:
        if self.skeleton:
            return self.dense(name).to(self.dtype)
        return self.ckpt.dense(name).to(self.dtype)


def load_gguf_model(path: str | Path, dtype: torch.dtype = torch.float32, stored: bool = True,
                    cfg: ModelConfig | None = None, max_len: int | None = None, progress=None) -> Transformer:
    """The model of a GGUF file on the CPU; `cfg` (e.g. the prepared folder's, or a RoPE scaling)
    overrides the GGUF's metadata. Stored loads keep their packed state beside the GGUF
    (stored_cache) and map it the next time."""
    path = Path(path)
    cache = stored_cache.cache_path(path, dtype) if stored and stored_cache.enabled() else None
    key = stored_cache.cache_key(_sha256(path), dtype) if cache is not None else None
    cached = stored_cache.read(cache, key) if cache is not None else None
    if cached is not None:
        state, table, cached_cfg = cached
        model = _build(_Source(_Table(table, cached_cfg), cfg or cached_cfg, dtype, stored), max_len, progress)
        try:
            model.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as e:  # the modules changed shape or buffers since (a code change): rebuild
            stored_cache.note(f"rebuilding {cache.name}: its tensors do not fit ({str(e).splitlines()[0][:80]})")
        else:
            model.weights_origin = str(path)
            return model.eval().requires_grad_(False)
    ckpt = open_checkpoint(str(path))
    model = _build(_Source(ckpt, cfg or ckpt.config(), dtype, stored), max_len, progress)
    if cache is not None:
        stored_cache.write(cache, key, model.state_dict(), _table_of(ckpt), ckpt.config())
    model.weights_origin = str(path)
    return model.eval().requires_grad_(False)


def _build(src: _Source, max_len: int | None, progress) -> Transformer:
    cfg = src.cfg
    with torch.device("meta"):
        model = Transformer(cfg, max_len=max_len)
    model.embed.weight = nn.Parameter(src.dense("token_embd.weight").to(src.dtype), requires_grad=False)
    model.norm.weight = nn.Parameter(src.vector("output_norm.weight"), requires_grad=False)
    for i, block in enumerate(model.layers):
        _load_block(src, block, f"blk.{i}.")
        if progress is not None:
            progress(i + 1, cfg.num_layers)
    # tied: the head reads the embedding's blocks (packed), while lookups read the dense rows
    model.lm_head = src.linear(["output.weight" if src.ckpt.has("output.weight") else "token_embd.weight"], None)
    model.rotary = Rotary(cfg, max_len)
    return model


def _load_block(src: _Source, block: nn.Module, hf: str) -> None:
    cfg = src.cfg
    block.attention_norm.weight = nn.Parameter(src.vector(hf + "attn_norm.weight"), requires_grad=False)
    block.mlp_norm.weight = nn.Parameter(src.vector(hf + "ffn_norm.weight"), requires_grad=False)
    qkv_bias = torch.cat([src.vector(hf + f"attn_{p}.bias") for p in "qkv"]) if cfg.qkv_bias else None
    block.attention.wqkv = src.linear([hf + f"attn_{p}.weight" for p in "qkv"], qkv_bias)
    o_bias = src.vector(hf + "attn_output.bias") if cfg.o_bias else None
    block.attention.wo = src.linear([hf + "attn_output.weight"], o_bias)
    block.mlp.w13 = src.linear([hf + "ffn_gate.weight", hf + "ffn_up.weight"], None)
    block.mlp.w2 = src.linear([hf + "ffn_down.weight"], None)


def weights_summary(model: nn.Module) -> dict:
    """What the statistics show about the weights: their format ("gguf Q4_1+Q8_0 packed blocks" or the
    dense dtype) and the bytes of weights one decode pass reads (matrices, one embedding row, norms)."""
    packed, kinds, dense_bytes, dense_dtypes, codes = 0, set(), 0, set(), set()
    for module in model.modules():
        if isinstance(module, PackedLinear):
            packed += module.bytes_per_row_pass()
            kinds.update(module.kind.split("+"))  # a stack of kinds (Q5_0+Q8_0) counts each
            codes.add("int8" if isinstance(module, ByteCodesLinear)
                      else "blocks" if module.block_kernel is not None else "int4")  # stored_bf16's records
        elif isinstance(module, nn.Linear):
            dense_bytes += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
            dense_dtypes.add(str(module.weight.dtype).removeprefix("torch."))
    embed = model.embed.weight
    head_tied_dense = model.lm_head is None
    small = embed.shape[1] * embed.element_size() * (1 if not head_tied_dense else 0)
    small += sum(p.numel() * p.element_size() for name, p in model.named_parameters() if "norm" in name)
    if head_tied_dense:
        dense_bytes += embed.numel() * embed.element_size()
        dense_dtypes.add(str(embed.dtype).removeprefix("torch."))
    parts = []
    if kinds:
        parts.append(f"gguf {'+'.join(sorted(kinds))} packed {'+'.join(sorted(codes))}")
    if dense_dtypes:
        parts.append("+".join(sorted(dense_dtypes)))
    return {"format": ", ".join(parts) + (" dense" if dense_dtypes and kinds else ""),
            "bytes_per_pass": packed + dense_bytes + small,
            "origin": getattr(model, "weights_origin", None)}
