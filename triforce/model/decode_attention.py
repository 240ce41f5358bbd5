"""Attention at a few to a few dozen queries, on CPU in bfloat16, as kernels that read each cached
key and value once per call, for each KV head, where rows are the query rows that share the head
(GQA's group times the new tokens: 3 in a SmolLM2 decode step, 21 in its verification pass of gamma 6,
42 for Qwen2.5-1.5B's 6 heads per KV head). `attend` is the whole attention in one call, what
attention.py calls; `scores` (rows . keys^T) and `mix` (probs . values) are its two products alone.

torch's bf16 `bmm` at 3 rows against SmolLM2's cache (one thread, 30 layers, 4K keys) took 3.8 ms for
the scores and 3.3 for the values against 1.06 ms to read either once at memory speed (docs/results/
2026-11-23-cpu-bytes.md, session 11); inductor's own loops for the same products took 5.3-6.2 ms, and
torch's CPU flash kernel 8x the floor. At one row the products wait on memory; each further row adds
multiply-adds, and past 6-12 rows (64-wide heads, 16K keys) they bound the time. Both products use
avx512_bf16's pair dot products (32 multiply-adds per instruction):

- scores: a vector holds one pair of dims of 16 keys; tiles of 6 rows broadcast their own pairs
  against it (no sums across lanes, each key vector loaded once per tile). Each score is one chain in
  dim order at any number of rows, so a row's bits do not depend on the rows beside it. A full cache
  stores its keys in that layout (key_tiles.py, `tiled`); other keys are transposed a block of 64 at
  a time, per call, which cost 1.4 of 4.4 ms (SmolLM2 at 4K keys, 3 rows, one thread).
- values: keys s, s+1 interleaved in each 32-bit lane against the broadcast weights (p[r,s], p[r,s+1]).
  Up to one tile of rows (6 at head_dim 64, 3 at 128) every sum stays in registers through all keys;
  more rows: a block of keys is interleaved once into a buffer and every tile of rows runs over it,
  the sums waiting in a float32 buffer between blocks. A full cache stores its values interleaved
  (key_tiles.py: pairs; `tiled` says so), read where they lie: a decode step of SmolLM2 at 16K keys
  24.5 ms against 26.9 when each call interleaved them (two threads, AMX), 36.7 against 40.4 at 7
  tokens; the same sums, so the same bits.
- attend: a task per (head, span of 2,048 keys) scores its rows into float32, turns them into bf16
  weights against the span's own maximum (2^t by a degree-4 polynomial, 32 weights a step) and mixes
  the span's values; each head
  then merges its spans by their maxima, in span order (cpu_kernels.attend_spans). Against scores,
  torch's softmax and mix as three calls (SmolLM2 at 16K keys, 30 layers, two threads): 3 rows 8.7 ->
  6.6 ms, 21 rows 26.1 -> 17.4.

- AMX (Intel Sapphire Rapids and later, unless TRIFORCE_AMX=0): both products through tiles, every row
  count alike (`use_tiles`, decided once per process by `available()`): a tile of up to 16 rows sums
  against 16 keys (or 16 dims) over 32 more in one instruction, so more rows cost little more than one.
  SmolLM2's cache_attend over 30 layers at 4K keys, one thread: 21 rows 24.6 -> 15.2 ms, 3 rows
  9.2 -> 9.3; Qwen2.5-1.5B's heads (128 wide, 6 a KV head) 42 rows 91.9 -> 34.6. The sums take the
  tiles' order, so the bits differ from the avx512 kernels' (not their bounds): a near-tie may resolve
  otherwise on an AMX CPU, as with the weights' products (stored_amx.py).

SmolLM2 (30 layers x 3 KV heads, head_dim 64) at 16K keys, both products, one thread, medians
(bench/attention_rows.py): 1 row 9.0-9.5 ms as before (about the memory floor), 6 rows 8.5 (the
earlier kernels 13.8), 21 rows 20.3 (the multiply-add floor 15.1; bmm 42.0, the earlier 16-row
kernels in two calls 41.0), 42 rows 36.7 (floor 30.2; bmm 61.7).

`scores` and `mix` are what `bmm` computes but for the order of its float32 sums: the products of
bfloat16 values are exact in float32, and each output is rounded once to bfloat16, to nearest even,
as bmm rounds its own. `attend` keeps the scores in float32 (bmm's path rounds them to bf16 before the
softmax), rounds the weights and the output once each. One difference: the pair dot product reads
denormal inputs as 0 and flushes denormal float32 results to 0, so a bf16 weight, value, query or key
below 2^-126 (about 1.2e-38) counts as 0 (bmm keeps it), and so does a score whose float32 sum falls
below it.

The C++ is built at first use with torch's extension builder (a C++ compiler, as --compile needs
anyway; cached on disk) and registered as torch ops, which torch.compile calls as opaque kernels.
Where it cannot build, or the CPU lacks avx512_bf16, attention keeps torch's bmm. The tiles' code
builds where the compiler knows AMX (GCC 11, clang 12 on); a CPU without AMX never runs it.
"""
from __future__ import annotations

import torch

from . import cpu_kernels, stored_amx

HEAD_DIMS = (64, 128)  # the kernels are unrolled for these

SOURCE = cpu_kernels.csrc("amx_frame.h", "decode_attention.cpp")

KERNEL = cpu_kernels.Kernel("triforce_decode_attention", SOURCE, pool_ops="triforce_decode")


@cpu_kernels.constant_result  # torch.compile asks at trace time, and builds nothing inside a graph
def available() -> bool:
    """Whether the kernels build here and compute bmm's products on a small case (any failure,
    a missing compiler or headers, means attention keeps bmm). Asked once per process."""
    return cpu_kernels.built(KERNEL, _register_shapes, _self_check)


def _self_check() -> bool:
    """The products through AMX tiles where this CPU has them (and TRIFORCE_AMX is not 0), checked;
    else, or if their check fails, the avx512 kernels, checked."""
    if cpu_kernels.cpu_has(stored_amx.AMX) and not stored_amx.OFF and _use_tiles(True) and _products_check():
        return True
    _use_tiles(False)
    return _products_check()


_TILES = {"on": False}


def _use_tiles(on: bool) -> bool:
    _TILES["on"] = bool(torch.ops.triforce_decode.use_tiles(on))
    return _TILES["on"]


def tiles() -> bool:
    """Whether both products run through AMX tiles in this process (decided once, by `available()`)."""
    return available() and _TILES["on"]


def switch_tiles(on: bool) -> bool:
    """The products through AMX tiles (on) or the avx512 kernels from here on; whether tiles now serve.
    For timing one path against the other in one process, and for testing both: the bits of a row
    change with the path, so no decoding may run across a switch (a verification pass would not give
    a token its decode step's bits)."""
    return available() and _use_tiles(on and cpu_kernels.cpu_has(stored_amx.AMX))


def _products_check() -> bool:
    """3 rows (one tile of the values) and 9 (the tiled loops), 77 keys ending in a part block and an
    odd key: the products against bmm, and the attention whole against float32's softmax."""
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 77, 64, generator=g).bfloat16()
    for n in (3, 9):
        rows = torch.randn(2, n, 64, generator=g).bfloat16()
        probs = torch.rand(2, n, 77, generator=g).bfloat16()
        weights = torch.softmax(torch.bmm(rows.float(), cache.float().transpose(1, 2)) * 0.125, dim=-1)
        if not (torch.allclose(scores(rows, cache).float(), torch.bmm(rows, cache.transpose(1, 2)).float(),
                               rtol=1e-2, atol=1e-2)
                and torch.allclose(mix(probs, cache).float(), torch.bmm(probs, cache).float(), rtol=1e-2, atol=1e-2)
                and torch.allclose(attend(rows, cache, cache, torch.tensor([77]), 0.125).float(),
                                   torch.bmm(weights, cache.float()), rtol=2e-2, atol=2e-2)):
            return False
    return True


def _register_shapes() -> None:
    """What the ops return, for torch.compile's tracing (which runs no kernel)."""
    @torch.library.register_fake("triforce_decode::scores")
    def _(rows, keys):
        return rows.new_empty(rows.shape[0], rows.shape[1], keys.shape[1])

    @torch.library.register_fake("triforce_decode::mix")
    def _(probs, values):
        return probs.new_empty(probs.shape[0], probs.shape[1], values.shape[2])

    @torch.library.register_fake("triforce_decode::attend")
    def _(rows, keys, values, limits, scale, tiled=False):
        return rows.new_empty(rows.shape)

    @torch.library.register_fake("triforce_decode::cache_attend")
    def _(q, k, v, cache_k, cache_v, layer, start, scale, tiled=False):
        return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def serves(rows: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether these kernels take rows (H, R, D) against a cache layer (H, S, D): any number of rows
    (at 64-512 rows, 64-wide heads, 16K keys, they took 0.55-0.95x the time of bmm)."""
    return (rows.device.type == "cpu" and rows.dtype == cache.dtype == torch.bfloat16
            and rows.shape[-1] in HEAD_DIMS and available())


def scores(rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """bmm(rows, keys^T): (H, R, D) bf16 rows, (H, S, D) bf16 keys, each head's tokens contiguous."""
    return torch.ops.triforce_decode.scores(rows, keys)


def mix(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """bmm(probs, values): (H, R, S) bf16 weights, (H, S, D) bf16 values."""
    return torch.ops.triforce_decode.mix(probs, values)


def attend(rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, limits: torch.Tensor,
           scale: float, tiled: bool = False) -> torch.Tensor:
    """softmax(scale * rows . keys^T) . values, scores, softmax and mix in one call: (H, R, D) bf16
    rows, row r being token r % T of its head's query group, token t seeing the first limits[t] keys
    ((T,) int64); (H, S, D) bf16 keys and values. Scores and weights' sums in float32, the weights
    rounded to bf16 for the values' product, the output rounded once to bf16. `tiled`: the keys are
    stored in tiles (key_tiles.py), in a buffer of whole blocks; the same bits as the plain layout."""
    return torch.ops.triforce_decode.attend(rows, keys, values, limits, scale, tiled)


def cache_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                 layer: int, start: int, scale: float, tiled: bool = False) -> torch.Tensor:
    """The T new tokens' bf16 keys and values (T, Hkv, D) into a cache's buffers (L, Hkv, S, D) at
    [layer, :, start:start + T], then `attend` for their queries (T, Hq, D) over the first start + T
    slots, token t seeing start + t + 1 -> (T, Hq * D): one call where the write, the grouping and
    the views were ~20 torch ops a layer. `tiled`: cache_k holds its keys in tiles (key_tiles.py)."""
    return torch.ops.triforce_decode.cache_attend(q, k, v, cache_k, cache_v, layer, start, scale, tiled)


def prefill(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scale: float,
            tiled: bool = False) -> torch.Tensor:
    """Causal attention of a piece's T bf16 queries (T, Hq, D) over keys and values (Hkv, start + T, D)
    (each head's tokens contiguous; `tiled`: keys in tiles), token t seeing the first start + t + 1:
    (T, Hq * D). Scores and sums in float32, weights rounded to bf16 for the values' product."""
    return torch.ops.triforce_decode.prefill(q, keys, values, start, scale, tiled)
