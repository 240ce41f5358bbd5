"""A GGUF checkpoint's tensors as stored: quantized blocks decoded into integers and scales, never
into dense weights unless asked.

The container (header, metadata, tensor table) is parsed by the `gguf` package; the block layouts
are decoded here, from the format's definition (ggml's block_q4_1, block_q8_0, block_q5_0 and
block_q4_K):

    Q4_1, 20 bytes per 32 weights: d (f16), m (f16), 16 bytes of nibbles; weight j of the block is
          d * q_j + m, with q_j = byte[j] & 15 for j < 16 and byte[j - 16] >> 4 for j >= 16.
    Q8_0, 34 bytes per 32 weights: d (f16), 32 int8 q_j; weight j is d * q_j.
    Q5_0, 22 bytes per 32 weights: d (f16), 4 bytes of high bits (a little-endian uint32, bit j for
          weight j), 16 bytes of nibbles laid out as Q4_1's; weight j is d * (q_j - 16), q_j the
          5-bit code. Decoded as Q8_0 is: int8 codes q_j - 16 in [-16, 15] and d.
    Q4_K, 144 bytes per 256 weights (8 sub-blocks of 32): d (f16), dmin (f16), 12 bytes of 6-bit
          scales sc_s and mins m_s, 128 bytes of nibbles; weight j of sub-block s is
          d * sc_s * q_j - dmin * m_s. The nibbles come in 4 runs of 32 bytes: run r holds
          sub-block 2r in its low nibbles and 2r + 1 in its high ones. The 12 scale bytes:
              bytes 0-3   low 6 bits: sc_0..3,  top 2 bits: bits 4-5 of sc_4..7
              bytes 4-7   low 6 bits: m_0..3,   top 2 bits: bits 4-5 of m_4..7
              bytes 8-11  low nibble: bits 0-3 of sc_4..7, high nibble: bits 0-3 of m_4..7
          Per sub-block that is Q4_1's form, d_s * q + m_s with d_s = d * sc_s and m_s = -dmin * m_s:
          both products of an f16 and a 6-bit integer (17 significant bits), exact in float32.

Other types (Qwen's Q6_K, ...) are handed out dense through gguf's own dequantizer.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .config import ModelConfig
from .errors import UserError

BLOCK = 32  # weights per block in Q4_1 and Q8_0, per sub-block in Q4_K
SUPER_BLOCK = 256  # weights per Q4_K super-block
Q4_K_BYTES = 144  # per super-block: d, dmin (2 + 2), packed scales and mins (12), nibbles (128)
STORED_TYPES = ("Q4_1", "Q8_0", "Q5_0", "Q4_K")
BYTES_PER_BLOCK = {"Q4_1": 20, "Q8_0": 34, "Q5_0": 22, "Q4_K": Q4_K_BYTES // (SUPER_BLOCK // BLOCK)}  # of 32
# decoded kinds that share one form (affine 4-bit codes; signed integer codes times d) and so can be
# stacked into one fused projection (Qwen2.5-0.5B's q, k are Q5_0 where its v is Q8_0)
FORMS = {"Q4_1": "affine", "Q4_K": "affine", "Q8_0": "signed", "Q5_0": "signed"}


@dataclass
class Blocks:
    """One quantized matrix (rows, cols): integer codes and per-32-block scales as float32.

    Q4_1, Q4_K: q uint8 in [0, 15], weight = d * q + m.
    Q8_0, Q5_0: q int8, weight = d * q (m is None).
    A stack of matrices of one form (concat_blocks) has the kind "Q5_0+Q8_0" and `nbytes` its parts'.
    d and m are (rows, cols // 32); float32 holds them exactly (f16 values, or for Q4_K an f16 times
    a 6-bit integer).
    """

    kind: str
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    nbytes: int | None = None  # the GGUF bytes, when not those of one kind (a stack of kinds)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def stored_bytes(self) -> int:
        """Bytes of the GGUF's own blocks for this matrix."""
        if self.nbytes is not None:
            return self.nbytes
        return self.q.numel() // BLOCK * BYTES_PER_BLOCK[self.kind]

    def dequantize(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The dense weights: float64 is exact for every kind. float32 is computed in float32, which
        rounds once, as float64 then float32 would: d * q is exact in float32 (d has at most 17
        significant bits, q at most 8), so only the addition of m rounds (twice as fast a load)."""
        work = torch.float32 if dtype == torch.float32 else torch.float64
        q = self.q.to(work).view(self.q.shape[0], -1, BLOCK)
        w = q * self.d.to(work)[..., None]
        if self.m is not None:
            w = w + self.m.to(work)[..., None]
        return w.reshape(self.q.shape).to(dtype)

    def rows(self, index: torch.Tensor) -> "Blocks":
        """The same matrix with its rows reordered (a row's blocks move with it)."""
        if self.q.is_meta:  # a cached model's skeleton: the same shapes (stored.shape_only)
            return self
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


def decode_q5_0(raw: np.ndarray, rows: int, cols: int) -> Blocks:
    b = torch.from_numpy(np.array(raw)).view(rows, cols // BLOCK, 22)
    d = b[..., :2].contiguous().view(torch.float16).float()[..., 0]
    high_bits = b[..., 2:6].to(torch.int64)  # 4 bytes, little-endian: weight j's bit is bit j % 8 of byte j // 8
    shifts = torch.arange(8)
    high = ((high_bits[..., None] >> shifts) & 1).reshape(rows, cols // BLOCK, BLOCK)
    nibbles = b[..., 6:]
    low = torch.cat([nibbles & 15, nibbles >> 4], dim=-1)
    q = (low.to(torch.int16) | (high.to(torch.int16) << 4)) - 16
    return Blocks("Q5_0", q.to(torch.int8).reshape(rows, cols), d.contiguous(), None)


def unpack_q4_k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and 8 six-bit mins of each super-block from its 12 packed bytes
    (..., 12) -> two (..., 8) uint8 tensors (layout in the module docstring)."""
    first, second, third = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = torch.cat([first & 63, (third & 15) | ((first >> 6) << 4)], dim=-1)
    mins = torch.cat([second & 63, (third >> 4) | ((second >> 6) << 4)], dim=-1)
    return scales, mins


def pack_q4_k_scales(scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The inverse of unpack_q4_k_scales: (..., 8) six-bit scales and mins -> (..., 12) bytes."""
    first = (scales[..., :4] & 63) | ((scales[..., 4:] >> 4) << 6)
    second = (mins[..., :4] & 63) | ((mins[..., 4:] >> 4) << 6)
    third = (scales[..., 4:] & 15) | ((mins[..., 4:] & 15) << 4)
    return torch.cat([first, second, third], dim=-1)


def decode_q4_k(raw: np.ndarray, rows: int, cols: int) -> Blocks:
    """Q4_K as 32-weight blocks of Q4_1's form (d_s, m_s per sub-block; see the module docstring)."""
    if cols % SUPER_BLOCK:
        raise UserError(f"a Q4_K matrix needs columns in multiples of {SUPER_BLOCK}, got {cols}")
    b = torch.from_numpy(np.array(raw)).view(rows, cols // SUPER_BLOCK, Q4_K_BYTES)
    d, dmin = b[..., 0:4].contiguous().view(torch.float16).float().unbind(-1)  # (rows, supers) each
    scales, mins = unpack_q4_k_scales(b[..., 4:16])
    nibbles = b[..., 16:].reshape(rows, cols // SUPER_BLOCK, 4, 1, 32)  # 4 runs of 32 bytes
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=-2)  # run r -> sub-blocks 2r (low), 2r + 1 (high)
    sub_d = (d[..., None] * scales.float()).reshape(rows, -1)  # exact: 11 x 6 significant bits
    sub_m = (-dmin[..., None] * mins.float()).reshape(rows, -1)
    return Blocks("Q4_K", q.reshape(rows, cols).contiguous(), sub_d.contiguous(), sub_m.contiguous())


def encode_q4_k(d: torch.Tensor, dmin: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                q: torch.Tensor) -> np.ndarray:
    """The GGUF bytes of Q4_K super-blocks, for tests: d, dmin (rows, supers) f16-representable,
    scales and mins (rows, supers, 8) in [0, 63], q (rows, cols) in [0, 15]."""
    rows, cols = q.shape
    supers = cols // SUPER_BLOCK
    header = torch.stack([d, dmin], dim=-1).to(torch.float16).view(torch.uint8).view(rows, supers, 4)
    packed = pack_q4_k_scales(scales.to(torch.uint8), mins.to(torch.uint8))
    runs = q.to(torch.uint8).view(rows, supers, 4, 2, 32)
    nibbles = (runs[..., 0, :] | (runs[..., 1, :] << 4)).reshape(rows, supers, 128)
    return torch.cat([header, packed, nibbles], dim=-1).reshape(rows, -1).numpy()


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
    elif blocks.kind == "Q8_0":
        out = torch.cat([d, blocks.q.to(torch.int8).view(torch.uint8).view(rows, cols // BLOCK, BLOCK)], dim=-1)
    elif blocks.kind == "Q5_0":
        q = (blocks.q.to(torch.int16) + 16).to(torch.uint8).view(rows, cols // BLOCK, BLOCK)
        high = ((q >> 4).view(rows, cols // BLOCK, 4, 8).to(torch.int32) << torch.arange(8, dtype=torch.int32)).sum(-1)
        low = q & 15
        out = torch.cat([d, high.to(torch.uint8), low[..., :16] | (low[..., 16:] << 4)], dim=-1)
    else:  # Q4_K's per-32 d and m are products with a super-block's d: not invertible from them alone
        raise ValueError(f"no encoder from decoded {blocks.kind} blocks; encode_q4_k takes its parts")
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
        """A matrix of a type in STORED_TYPES as stored."""
        t = self._tensor(name)
        cols, rows = (int(n) for n in t.shape)  # GGUF lists the fastest dimension first
        decode = {"Q4_1": decode_q4_1, "Q8_0": decode_q8_0, "Q5_0": decode_q5_0, "Q4_K": decode_q4_k}.get(t.tensor_type.name)
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
        """The fraction of matrix weights in a type computed as stored (STORED_TYPES): SmolLM2's GGUF
        is all of them, Qwen2.5-Coder's Q4_K_M 76% (1.5B: Q4_K) and 92% (0.5B: Q5_0, Q8_0, Q4_K);
        their Q6_K stays dense."""
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
