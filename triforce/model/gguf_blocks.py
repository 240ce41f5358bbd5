"""A GGUF checkpoint's tensors as stored: quantized blocks decoded into integers and scales, never
into dense weights unless asked.

The container (header, metadata, tensor table) is parsed by the `gguf` package; the block layouts
are decoded here, from the format's definition (ggml's block_q4_1 and block_q8_0):

    Q4_1, 20 bytes per 32 weights: d (f16), m (f16), 16 bytes of nibbles; weight j of the block is
          d * q_j + m, with q_j = byte[j] & 15 for j < 16 and byte[j - 16] >> 4 for j >= 16.
    Q8_0, 34 bytes per 32 weights: d (f16), 32 int8 q_j; weight j is d * q_j.

Other types (Qwen's Q4_K/Q6_K, ...) are handed out dense through gguf's own dequantizer.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .config import ModelConfig
from .errors import UserError

BLOCK = 32  # weights per block in Q4_1 and Q8_0
STORED_TYPES = ("Q4_1", "Q8_0")


@dataclass
class Blocks:
    """One quantized matrix (rows, cols): integer codes and per-32-block f16 scales as float32.

    Q4_1: q uint8 in [0, 15], weight = d * q + m.   Q8_0: q int8, weight = d * q (m is None).
    d and m are (rows, cols // 32); float32 holds every f16 exactly.
    """

    kind: str
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def stored_bytes(self) -> int:
        """Bytes of the GGUF's own blocks for this matrix."""
        per_block = {"Q4_1": 20, "Q8_0": 34}[self.kind]
        return self.q.numel() // BLOCK * per_block

    def dequantize(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The dense weights, computed in float64 (exact for f16 scales and small integer codes)."""
        q = self.q.to(torch.float64).view(self.q.shape[0], -1, BLOCK)
        w = q * self.d.to(torch.float64)[..., None]
        if self.m is not None:
            w = w + self.m.to(torch.float64)[..., None]
        return w.reshape(self.q.shape).to(dtype)

    def rows(self, index: torch.Tensor) -> "Blocks":
        """The same matrix with its rows reordered (a row's blocks move with it)."""
        return Blocks(self.kind, self.q[index], self.d[index], None if self.m is None else self.m[index])


def decode_q4_1(raw: np.ndarray, rows: int, cols: int) -> Blocks:
    b = torch.from_numpy(np.array(raw)).view(rows, cols // BLOCK, 20)  # a copy: the file is mapped read-only
    scales = b[..., :4].contiguous().view(torch.float16).float()  # (rows, blocks, 2): d, m
    nibbles = b[..., 4:]
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).reshape(rows, cols)
    return Blocks("Q4_1", q.contiguous(), scales[..., 0].contiguous(), scales[..., 1].contiguous())


def decode_q8_0(raw: np.ndarray, rows: int, cols: int) -> Blocks:
    b = torch.from_numpy(np.array(raw)).view(rows, cols // BLOCK, 34)
    d = b[..., :2].contiguous().view(torch.float16).float()[..., 0]
    q = b[..., 2:].contiguous().view(torch.int8).reshape(rows, cols)
    return Blocks("Q8_0", q, d.contiguous(), None)


def encode_blocks(blocks: Blocks) -> np.ndarray:
    """The GGUF bytes of `blocks` (rows, blocks * bytes per block): the inverse of decode_*, for
    tests that build quantized checkpoints in memory."""
    rows, cols = blocks.shape
    d = blocks.d.to(torch.float16).view(torch.uint8).view(rows, cols // BLOCK, 2)
    if blocks.kind == "Q4_1":
        m = blocks.m.to(torch.float16).view(torch.uint8).view(rows, cols // BLOCK, 2)
        q = blocks.q.to(torch.uint8).view(rows, cols // BLOCK, BLOCK)
        nibbles = q[..., :16] | (q[..., 16:] << 4)
        out = torch.cat([d, m, nibbles], dim=-1)
    else:
        out = torch.cat([d, blocks.q.to(torch.int8).view(torch.uint8).view(rows, cols // BLOCK, BLOCK)], dim=-1)
    return out.reshape(rows, -1).numpy()


class GgufCheckpoint:
    """Tensors of a GGUF file by their GGUF names (blk.0.attn_q.weight, token_embd.weight, ...)."""

    def __init__(self, path: str | Path):
        try:
            from gguf import GGUFReader
        except ImportError:
            raise UserError("reading a GGUF needs the `gguf` package: pip install gguf") from None
        self.path = Path(path)
        try:
            self.reader = GGUFReader(str(self.path))
        except (OSError, ValueError) as e:
            raise UserError(f"{self.path} is not a readable GGUF file ({e})") from None
        self.tensors = {t.name: t for t in self.reader.tensors}

    def has(self, name: str) -> bool:
        return name in self.tensors

    def kind(self, name: str) -> str:
        return self._tensor(name).tensor_type.name

    def field(self, key: str, default=None):
        f = self.reader.fields.get(key)
        if f is None:
            return default
        value = f.contents()
        return value

    def blocks(self, name: str) -> Blocks:
        """A Q4_1 or Q8_0 matrix as stored."""
        t = self._tensor(name)
        cols, rows = (int(n) for n in t.shape)  # GGUF lists the fastest dimension first
        decode = {"Q4_1": decode_q4_1, "Q8_0": decode_q8_0}.get(t.tensor_type.name)
        if decode is None:
            raise UserError(f"{name} is {t.tensor_type.name}, not one of {STORED_TYPES}")
        return decode(t.data, rows, cols)

    def dense(self, name: str) -> torch.Tensor:
        """Any tensor as float32 values (gguf's dequantizer for the types kept dense)."""
        from gguf.quants import dequantize

        t = self._tensor(name)
        values = dequantize(t.data, t.tensor_type)
        shape = tuple(int(n) for n in reversed(t.shape))
        return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)  # writable copy

    def stored_share(self) -> float:
        """The fraction of matrix weights in a type computed as stored (Q4_1, Q8_0): SmolLM2's GGUF
        is all of them, Qwen's Q4_K_M none (those stay on the dense path)."""
        sizes = {t.name: int(t.n_elements) for t in self.tensors.values() if len(t.shape) == 2}
        stored = sum(n for name, n in sizes.items() if self.kind(name) in STORED_TYPES)
        return stored / max(1, sum(sizes.values()))

    def config(self) -> ModelConfig:
        """The model's shape from the GGUF metadata (llama.*, qwen2.* keys)."""
        arch = self.field("general.architecture")
        if arch not in ("llama", "qwen2"):
            raise UserError(f"{self.path} holds a '{arch}' model; this runtime serves llama and qwen2")

        def key(name, default=None):
            value = self.field(f"{arch}.{name}", default)
            if value is None:
                raise UserError(f"{self.path} lacks the metadata {arch}.{name}")
            return value

        heads = int(key("attention.head_count"))
        hidden = int(key("embedding_length"))
        vocab = int(self._tensor("token_embd.weight").shape[1])
        return ModelConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=int(key("feed_forward_length")),
            num_layers=int(key("block_count")), num_heads=heads,
            num_kv_heads=int(key("attention.head_count_kv", heads)), head_dim=hidden // heads,
            max_position_embeddings=int(key("context_length")),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope_theta=float(key("rope.freq_base", 10000.0)), qkv_bias=arch == "qwen2",
            tie_word_embeddings=not self.has("output.weight"), model_type=arch)

    def _tensor(self, name: str):
        if name not in self.tensors:
            raise UserError(f"{self.path} lacks tensor '{name}'; not a Llama-family GGUF")
        return self.tensors[name]
