"""Keys stored in tiles and values in pairs, the layouts the CPU bf16 attention kernels read
(model/decode_attention.py).

A tile is 16 consecutive keys of one head with their dims regrouped: word p (dims 2p and 2p + 1) of
all 16 keys side by side, one 64-byte vector, then word p + 1. The scores kernel broadcasts a query's
word p against that vector: 16 scores advance by one pair dot product, each score one chain in dim
order. Stored plainly, every call transposed each block of keys into this layout first, 64 shuffles
per 16 keys and 32 dims, all on one port: the scores of 3 rows took 4.4 ms, 3.0 read in tiles (1 row:
4.0 and 2.05; SmolLM2, 30 layers x 3 KV heads at 4K keys, one thread). A decode step of SmolLM2 at two
threads: 1.06x as fast at 4K, 1.12x at 16K. The sums are the same, so are the bits.

A pair is two consecutive values of one head, dim by dim: (v[2p, d], v[2p + 1, d]) for d in order, the
operand a pair dot product (and an AMX tile's row) takes for the weights of keys 2p and 2p + 1. Stored
plainly, every call interleaved each block of values first: 3.5 of the 20 ms a decode step's values
product took at 16K keys (SmolLM2, one thread, AMX tiles), 9 of 27 for a 7-token pass's 21 rows. The
products run in the same order over the same numbers, so the bits are those of plain values.

A buffer keeps the shape (..., slots, head_dim) of a plain one, its slots a whole number of blocks of
64 (the kernels read a part block's tiles whole). Only the full cache of a bf16 model on a CPU whose
bf16 kernels build stores its keys and values so (`serves`, the cache's `tiled`); everything that
reads or writes them by slot goes through the functions here, which address a tiled key buffer as
(..., tile, key in tile, word, half) and a paired value buffer as (..., pair, half, dim).
"""
from __future__ import annotations

import torch

TILE = 16  # keys per tile: one word of each in a 64-byte vector
BLOCK = 64  # keys per block the kernels read whole: a tiled buffer's slots are a multiple of it


def serves(dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether a model computing in `dtype` keeps its full cache's keys in tiles: bf16 compute and cache
    on a CPU where the bf16 kernels build (the kernels read the tiles; everything else converts)."""
    from . import decode_attention

    return (torch.device(device).type == "cpu" and dtype == kv_dtype == torch.bfloat16
            and head_dim in decode_attention.HEAD_DIMS and decode_attention.available())


def slots_for(tokens: int) -> int:
    """Slots of a tiled buffer that holds `tokens`: whole blocks."""
    return -(-tokens // BLOCK) * BLOCK


def grid(buffer: torch.Tensor) -> torch.Tensor:
    """A tiled buffer (..., S, D), or its first S slots, as a view (..., tiles, 16, D / 2, 2): [tile,
    key, word, half], so that [s // 16, s % 16] is key s (as (D / 2, 2)). A last part tile reaches
    past S into the buffer's own slots."""
    *lead, S, D = buffer.shape
    return buffer.as_strided((*lead, -(-S // TILE), TILE, D // 2, 2),
                             (*buffer.stride()[:-2], TILE * D, 2, 2 * TILE, 1))


def read(buffer: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Keys [start, end) of a tiled buffer (..., S, D), plainly laid out (..., end - start, D): a copy."""
    first, last = start // TILE, -(-end // TILE)
    tiles = grid(buffer)[..., first:last, :, :, :]
    plain = tiles.reshape(*tiles.shape[:-4], (last - first) * TILE, buffer.shape[-1])
    return plain[..., start - first * TILE:end - first * TILE, :]


def write(buffer: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor) -> None:
    """Keys (..., n, D), plainly laid out, into a tiled buffer (..., S, D) at `slots` (n,)."""
    grid(buffer)[..., slots // TILE, slots % TILE, :, :] = keys.unflatten(-1, (-1, 2)).to(buffer.dtype)


def gather(buffer: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Keys of a tiled layer (H, S, D) at token positions `index` (H, n), chosen per head -> (H, n, D)."""
    heads = torch.arange(index.shape[0], device=index.device)[:, None]
    return grid(buffer)[heads, index // TILE, index % TILE].flatten(-2)


def pairs(buffer: torch.Tensor) -> torch.Tensor:
    """A paired value buffer (..., S, D), or its first S slots, as a view (..., pairs, 2, D): [pair, half]
    is value 2 pair + half. A last odd slot's partner is the buffer's own next slot."""
    *lead, S, D = buffer.shape
    return buffer.as_strided((*lead, -(-S // 2), 2, D), (*buffer.stride()[:-2], 2 * D, 1, 2))


def read_values(buffer: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Values [start, end) of a paired buffer (..., S, D), plainly laid out (..., end - start, D): a copy."""
    first, last = start // 2, -(-end // 2)
    plain = pairs(buffer)[..., first:last, :, :].reshape(*buffer.shape[:-2], 2 * (last - first), buffer.shape[-1])
    return plain[..., start - 2 * first:end - 2 * first, :]


def write_values(buffer: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """Values (..., n, D), plainly laid out, into a paired buffer (..., S, D) at `slots` (n,)."""
    pairs(buffer)[..., slots // 2, slots % 2, :] = values.to(buffer.dtype)


def gather_values(buffer: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Values of a paired layer (H, S, D) at token positions `index` (H, n), chosen per head -> (H, n, D)."""
    heads = torch.arange(index.shape[0], device=index.device)[:, None]
    return pairs(buffer)[heads, index // 2, index % 2]
