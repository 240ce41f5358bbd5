"""Attention of a few new query tokens against a cache laid out as (kv_heads, tokens, head_dim).

Decode and verification (a handful of queries) use grouped matmuls: the query heads that share a
KV head and all new tokens form the rows of one matrix, so each cached key and value is read once
per pass however many tokens are verified. Long prefill chunks use torch SDPA, which never
materialises the (queries x keys) score matrix, or in bf16 on avx512_bf16 without AMX decode_attention.prefill. On CUDA with fp16/bf16, flash-attn's
`flash_attn_with_kvcache` serves every call when it imports; the backend is chosen once, at import.
"""
from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

from . import decode_attention, decode_attention_f32, folded_heads, key_tiles, kv_dtype, layer_ops, split_keys

SDPA_MIN_QUERIES = 32  # below this, grouped matmuls beat SDPA on CPU (docs/results/2026-11-23-cpu-epyc-2core.md)
# Which attention a bf16 prefill piece on CPU takes: True, decode_attention.prefill; False, torch's SDPA;
# None, the faster one for this CPU (prefill_kernel_serves). bench/prefill_rate.py --sdpa-too times both.
PREFILL_KERNEL: bool | None = None


@functools.lru_cache(maxsize=None)
def _sdpa_has_amx() -> bool:
    """Whether torch's CPU flash kernel multiplies in AMX tiles here (its bf16 GEMMs go through
    oneDNN's brgemm, which uses them where the CPU has amx_bf16 and the OS lets a process use them)."""
    has = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    return "amx_bf16" in kv_dtype.cpu_flags() and bool(has())


def prefill_kernel_serves() -> bool:
    """Whether bf16 prefill pieces take our kernel rather than SDPA. Without AMX our kernel computes in
    bf16 pair dot products where torch's flash kernel widens to float32: 1.6-1.95x a layer (EPYC,
    session 22). With AMX, torch's flash kernel runs its products in tiles and ours do not: SDPA took
    0.18-0.28x our kernel's time a layer at 4K pieces (Xeon, session 31)."""
    return PREFILL_KERNEL if PREFILL_KERNEL is not None else not _sdpa_has_amx()


def _load_flash():
    if not torch.cuda.is_available():
        return None
    try:
        from flash_attn import flash_attn_with_kvcache
    except Exception:  # not installed, or built for another torch/CUDA: SDPA serves instead
        return None
    return flash_attn_with_kvcache


_FLASH = _load_flash()
BACKEND = "flash-attn" if _FLASH is not None else "sdpa"  # what CUDA half-precision calls use


def backend(q: torch.Tensor) -> str:
    """The kernel family `attend` uses for queries like q."""
    if _FLASH is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        return "flash-attn"
    return "sdpa" if q.shape[0] >= SDPA_MIN_QUERIES else "grouped-matmul"


def store_and_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor,
                     cache_v: torch.Tensor, layer: int, start: int, tiled: bool = False) -> torch.Tensor:
    """The new tokens' k, v (T, Hkv, D) into the buffers (layers, Hkv, slots, D) at slots
    [start, start + T) of `layer`, then `attend` of their queries over the slots up to them.
    Eager on CPU, where a kernel module serves (bf16 rows on avx512_bf16, float32 on avx2), both are one
    call (`cache_attend`): the write, the views and the grouping were ~20 of a layer's ~50 torch ops.
    The same bits either way: the same rounding into the cache, the same kernels. `tiled`: cache_k
    holds its keys in tiles and cache_v its values in pairs (model/key_tiles.py)."""
    T = k.shape[0]
    if T < SDPA_MIN_QUERIES and not q.is_cuda and layer_ops.enabled and not torch.compiler.is_compiling():
        scale = q.shape[-1] ** -0.5
        if decode_attention.serves(q, cache_k):  # bf16 on avx512_bf16
            return decode_attention.cache_attend(q, k, v, cache_k, cache_v, layer, start, scale, tiled)
        if not tiled and decode_attention_f32.serves(q, cache_k):  # float32 on avx2
            return decode_attention_f32.cache_attend(q, k, v, cache_k, cache_v, layer, start, scale)
    if tiled:
        slots = torch.arange(start, start + T, device=k.device)
        key_tiles.write(cache_k[layer], slots, k.transpose(0, 1))
        key_tiles.write_values(cache_v[layer], slots, v.transpose(0, 1))
    else:
        cache_k[layer, :, start:start + T] = k.transpose(0, 1)
        cache_v[layer, :, start:start + T] = v.transpose(0, 1)
    return attend(q, cache_k[layer, :, :start + T], cache_v[layer, :, :start + T], tiled)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tiled: bool = False) -> torch.Tensor:
    """Causal attention of the last T positions.

    q: (T, Hq, D) rotated queries of the T newest tokens; keys/values: (Hkv, S, D) with the T newest
    tokens last (`tiled`: keys in tiles, values in pairs, model/key_tiles.py). Returns (T, Hq * D). Every earlier
    key is visible to every query.
    """
    if _FLASH is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and keys.dtype == q.dtype:
        return _attend_flash(q, keys, values)
    kernels_serve = decode_attention.serves(q, keys) and _tokens_contiguous(values) and (tiled or _tokens_contiguous(keys))
    if q.shape[0] >= SDPA_MIN_QUERIES:
        if kernels_serve and prefill_kernel_serves() and not torch.compiler.is_compiling():
            # a prefill piece in bf16 on avx512_bf16 without AMX: 1.9x torch's CPU flash kernel
            return decode_attention.prefill(q, keys, values, keys.shape[1] - q.shape[0], q.shape[-1] ** -0.5, tiled)
        kernels_serve = False  # SDPA's turn
    if tiled and not kernels_serve:  # plain copies for SDPA or the GEMMs
        keys, values, tiled = key_tiles.read(keys, 0, keys.shape[1]), key_tiles.read_values(values, 0, values.shape[1]), False
    if q.shape[0] >= SDPA_MIN_QUERIES:  # a prefill chunk: one widening copy of the layer is cheap
        return _attend_sdpa(q, keys.to(q.dtype), values.to(q.dtype))
    return _attend_grouped(q, keys, values, tiled)


def _attend_grouped(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tiled: bool = False) -> torch.Tensor:
    T, Hq, D = q.shape
    Hkv, S, _ = keys.shape
    rep = Hq // Hkv
    # rows ordered (kv head, query head in group, token): one matmul per KV head reads its keys once
    grouped = q.view(T, Hkv, rep, D).permute(1, 2, 0, 3).reshape(Hkv, rep * T, D)
    future = _future_mask(T, rep, q.device) if T > 1 else None
    if q.is_cuda:  # cuBLAS takes the cache's strided batch of heads as it is
        out = _attend_rows(grouped, keys.to(q.dtype), values.to(q.dtype), future)
    elif _tokens_contiguous(keys) and _tokens_contiguous(values) and (kernels := _kernels_for(grouped, keys)):
        # bf16 on avx512_bf16, float32 rows on avx2 (over a 16-bit cache): one kernel per product, every head
        out = _attend_kernels(kernels, grouped, keys, values, future, tiled)
    else:  # CPU bf16 bmm copies a strided batch (a layer's whole live KV, every pass); 2-D GEMMs do not
        # a 16-bit cache under float32 compute (model/kv_dtype.py) without the avx2 kernels widens one
        # head at a time: the float32 copy stays in cache while the GEMM reads it
        out = torch.stack([_attend_rows(grouped[h], keys[h].to(q.dtype), values[h].to(q.dtype), future)
                           for h in range(Hkv)])
    return out.view(Hkv, rep, T, D).permute(2, 0, 1, 3).reshape(T, Hq * D)


def _kernels_for(rows: torch.Tensor, cache: torch.Tensor):
    """The CPU kernel module whose two products take these rows against this cache, or None: bf16 rows
    (decode_attention, avx512_bf16) or float32 rows (decode_attention_f32, avx2)."""
    if decode_attention.serves(rows, cache):
        return decode_attention
    if decode_attention_f32.serves(rows, cache):
        return decode_attention_f32
    return None


def _attend_kernels(kernels, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, future,
                    tiled: bool = False) -> torch.Tensor:
    """`_attend_rows` for all KV heads at once as one call of a kernel module's `attend` (scores,
    softmax and values' product), which reads the cache once at about memory speed where bf16 bmm and
    per-head addmm read it at a third of that (SmolLM2 at 4K, eager: docs/results/2026-11-23-cpu-bytes.md,
    session 12), and per-head widening of a 16-bit cache wrote and re-read a float32 copy
    (decode_attention_f32.py); torch's softmax between two product kernels cost 20-25% of the three on
    avx2 and more than either product at 21 bf16 rows (decode_attention.py)."""
    S, D = keys.shape[-2:]
    T = 1 if future is None else future.shape[1]
    return _kernel_attend(kernels, rows, keys, values, torch.arange(S - T + 1, S + 1), D ** -0.5, tiled)


def _kernel_attend(kernels, rows, keys, values, limits, scale: float, tiled: bool) -> torch.Tensor:
    """A kernel module's `attend`; tiled keys go to the bf16 kernels, the only ones that read tiles
    (and the only ones that serve where a cache tiles its keys: bf16 compute)."""
    if tiled:
        return decode_attention.attend(rows, keys, values, limits, scale, True)
    return kernels.attend(rows, keys, values, limits, scale)


def _tokens_contiguous(cache: torch.Tensor) -> bool:
    """Each head's tokens one after another (the kernels' layout); the offloaded store's token-major
    layer is not."""
    return cache.stride(2) == 1 and cache.stride(1) == cache.shape[2]


def attend_masked(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                  limits: torch.Tensor, tiled: bool = False) -> torch.Tensor:
    """Attention of T queries (T, Hq, D) against every slot of a cache layer (Hkv, S, D) under an
    additive mask (T, S) of 0 and -inf: the static-shape form (speculative/graphs.py's views), on CPU.
    The mask is a prefix per query: query t sees the first limits[t] slots ((T,) int64), which the
    CPU kernels take instead (they never read the slots past them).
    The query heads sharing a KV head are rows of one product, as in `_attend_grouped`: torch's CPU
    SDPA with a mask took 3.3 ms for one bf16 query against 4,200 keys (9 heads), this 0.17 ms.
    `tiled`: keys in tiles, values in pairs (model/key_tiles.py)."""
    T, Hq, D = q.shape
    Hkv = keys.shape[0]
    rep = Hq // Hkv
    grouped = q.view(T, Hkv, rep, D).permute(1, 2, 0, 3).reshape(Hkv, rep * T, D)
    # bf16 on avx512_bf16, float32 on avx2: kernels at about memory speed (decode_attention.py,
    # decode_attention_f32.py), else bmm
    kernels = _kernels_for(grouped, keys)
    if kernels:  # the whole attention in one call, reading no slot past a query's limit
        out = _kernel_attend(kernels, grouped, keys, values, limits, D ** -0.5, tiled)
        return out.view(Hkv, rep, T, D).permute(2, 0, 1, 3).reshape(T, Hq * D)
    if tiled:
        keys, values = key_tiles.read(keys, 0, keys.shape[1]), key_tiles.read_values(values, 0, values.shape[1])
    scores = torch.bmm(grouped, keys.to(q.dtype).transpose(1, 2)).view(Hkv, rep, T, -1)
    # the mask broadcasts over the heads: nothing per layer builds or copies it (compiled, the add
    # rides in the softmax kernel)
    probs = torch.softmax(scores * D ** -0.5 + mask, dim=-1).view(Hkv, rep * T, -1)
    out = torch.bmm(probs, values.to(q.dtype))
    return out.view(Hkv, rep, T, D).permute(2, 0, 1, 3).reshape(T, Hq * D)


def attend_shared_heads(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask) -> torch.Tensor:
    """Attention of T queries (T, Hq, D) against a layer (Hkv, S, D) under `mask`, an additive (T, S)
    tensor in q's dtype or a CausalBias, through SDPA's fused kernels: the form for CUDA.

    SDPA asked for grouped heads (enable_gqa) with a mask goes to its math backend wherever the
    memory-efficient kernel takes no grouped heads (torch 2.9's did not; flash takes no mask): the
    keys and values written out per query head and the (Hq, T, S) scores in float32, about ten
    kernels a layer and, for a prefill piece of 4,096 queries at 32K keys, 4.8 GB a layer. Here
    each KV head is a batch entry whose query heads read it through a zero-stride view: the head
    counts match, nothing is copied, and the memory-efficient kernel takes the mask (bench/
    op_forms.py times both forms on a GPU). Should a CUDA kernel refuse the view, the grouped-heads
    call serves from then on, said once; a pass's first calls are eager, so this is settled before
    any graph is captured or compiled.

    Two exceptions, from the H200's op forms (session 35): a verification pass of 2 or more queries
    over 4,096 keys or more splits the keys into pieces (model/split_keys.py); and a one-query step
    takes the grouped-heads call where cuDNN's kernel accepts it, which split the keys itself: 12.6
    us a layer at 32K keys against 26.0 for the zero-stride view (6.5 against 8.1 at 4K). A one-query
    step that cuDNN takes in neither form (float32) splits the keys too (session 37: the memory-
    efficient kernel made float32 plain decoding in host memory 120 ms a pass at 32K).

    A pass of 2-32 queries may also run as that one-query call, each (head, query) a head of its own
    (model/folded_heads.py), where the device measured it faster for the shape (session 40: the
    middle level's 2-position check cost twice its 1-position pass through the split keys)."""
    # a plain (T, S) tensor: CausalBias (a later prefill piece's) is a Tensor subclass, and importing
    # its module to test for it imports torch._dynamo, a second of every run's start
    dense = type(mask) is torch.Tensor
    if q.shape[0] == 1 and dense:
        if grouped_takes_cudnn(q, keys, values, mask):
            return attend_grouped_flag(q, keys, values, mask)
        if takes_cudnn(q, keys, values, mask, grouped=False):  # cuDNN splits the keys in this form too
            return shared_heads_sdpa(q, keys, values, mask)
    if dense and q.is_cuda and folded_heads.serves(q, keys, values, mask,
                                                   lambda: _many_queries(q, keys, values, mask, dense)):
        return folded_heads.folded_heads_attention(q, keys, values, mask)
    return _many_queries(q, keys, values, mask, dense)


def _many_queries(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask, dense: bool) -> torch.Tensor:
    """attend_shared_heads' forms for what no one-query call serves: the split keys, else SDPA."""
    refused = (q.dtype, torch.is_tensor(mask))
    if dense and split_keys.serves(q.shape[0], keys.shape[1], q) and q.dtype not in _SPLIT_REFUSED:
        # a verification pass over a long cache: the keys in pieces, or 9 thread blocks walk 32K keys
        try:
            return split_keys.split_keys_attention(q, keys, values, mask)
        except RuntimeError as e:
            if torch.cuda.is_current_stream_capturing():
                raise
            _SPLIT_REFUSED.add(q.dtype)
            warnings.warn(f"attention: the split-keys form failed ({str(e).splitlines()[0]}); SDPA serves instead")
    if refused in _REFUSED:
        return attend_grouped_flag(q, keys, values, mask)
    if not q.is_cuda or torch.compiler.is_compiling():
        return shared_heads_sdpa(q, keys, values, mask)
    try:
        return shared_heads_sdpa(q, keys, values, mask)
    except RuntimeError as e:
        if torch.cuda.is_current_stream_capturing():
            raise
        _REFUSED.add(refused)
        warnings.warn(f"attention: torch's kernels refused the shared-heads form ({str(e).splitlines()[0]}); "
                      "the grouped-heads call serves instead")
        return attend_grouped_flag(q, keys, values, mask)


_REFUSED: set[tuple] = set()  # (dtype, a tensor mask?) whose shared-heads call a CUDA kernel refused
_SPLIT_REFUSED: set[torch.dtype] = set()  # dtypes whose split-keys call failed on this CUDA build


def fused_kernels_taking(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask,
                         grouped: bool) -> dict[str, bool]:
    """Which of SDPA's fused CUDA kernels accept the call in the grouped-heads form or the shared-heads
    view (on CPU: none of them)."""
    from torch.backends import cuda as backends
    T, Hq, D = q.shape
    Hkv, S, _ = keys.shape
    if grouped:
        args = (q.transpose(0, 1)[None], keys[None], values[None], mask, 0.0, False, True)
    else:
        g = Hq // Hkv
        args = (q.unflatten(1, (Hkv, g)).permute(1, 2, 0, 3), keys[:, None].expand(Hkv, g, S, D),
                values[:, None].expand(Hkv, g, S, D), mask if torch.is_tensor(mask) else None, 0.0, False, False)
    params = backends.SDPAParams(*args)
    return {name: bool(check(params)) for name, check in (
        ("flash", backends.can_use_flash_attention), ("efficient", backends.can_use_efficient_attention),
        ("cudnn", backends.can_use_cudnn_attention))}


# (form, dtype, heads, D, layout, length's bits): whether cuDNN takes a one-query call in that form
_CUDNN_TAKES: dict[tuple, bool] = {}


def grouped_takes_cudnn(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask) -> bool:
    """Whether cuDNN's kernel takes this one-query call in the grouped-heads form."""
    return takes_cudnn(q, keys, values, mask, grouped=True)


def takes_cudnn(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask, grouped: bool) -> bool:
    """Whether cuDNN's kernel takes this one-query call in the grouped-heads form or the shared-heads
    view; asked once per shape, eagerly (a pass's first calls are), and never under a trace. Where
    neither form gets cuDNN (float32; a GPU or head size it does not serve), the split keys serve:
    the memory-efficient kernel walks the keys in a few blocks."""
    if not q.is_cuda:
        return False
    # the layout (the full cache's head-major buffer, an offloaded slot's token-major one) and the
    # length's power of two go in the key: a kernel's checks read strides and sizes
    key = (grouped, q.dtype, q.shape[1], keys.shape[0], q.shape[2], keys.stride(1) == keys.shape[2],
           keys.shape[1].bit_length())
    if key not in _CUDNN_TAKES:
        if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
            return False
        try:
            _CUDNN_TAKES[key] = fused_kernels_taking(q, keys, values, mask, grouped=grouped)["cudnn"]
        except (RuntimeError, TypeError, AttributeError):  # a torch without these checks (SDPAParams' fields moved)
            _CUDNN_TAKES[key] = False
    return _CUDNN_TAKES[key]


def shared_heads_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask) -> torch.Tensor:
    T, Hq, D = q.shape
    Hkv, S, _ = keys.shape
    group = Hq // Hkv
    heads = q.unflatten(1, (Hkv, group)).permute(1, 2, 0, 3)  # (Hkv, group, T, D), a view
    out = F.scaled_dot_product_attention(heads, keys[:, None].expand(Hkv, group, S, D),
                                         values[:, None].expand(Hkv, group, S, D), attn_mask=mask)
    return out.permute(2, 0, 1, 3).reshape(T, Hq * D)


def attend_grouped_flag(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask) -> torch.Tensor:
    """The same attention as one SDPA call with grouped heads flagged (the form before; what
    bench/op_forms.py compares against)."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask,
                                         enable_gqa=True)
    return out[0].transpose(0, 1).reshape(q.shape[0], -1)


def aligned_mask(T: int, S: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed (T, S) mask whose rows start 16 elements apart: the memory-efficient kernel wants its
    bias rows aligned and pads an unaligned one, a copy per layer per pass."""
    return torch.zeros(T, -(-S // 16) * 16, dtype=dtype, device=device)[:, :S]


_FUTURE_MASKS: dict[tuple, torch.Tensor] = {}


def _future_mask(T: int, rep: int, device: torch.device) -> torch.Tensor:
    """(rep * T, T), True where a row's token would see a later one. Kept per shape: every layer of
    every verification pass asks for the same few, and building one is three kernels."""
    key = (T, rep, device)
    if key not in _FUTURE_MASKS:
        _FUTURE_MASKS[key] = torch.ones(T, T, dtype=torch.bool, device=device).triu(1).repeat(rep, 1)
    return _FUTURE_MASKS[key]


def _attend_rows(rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, future) -> torch.Tensor:
    """softmax(rows . keys^T / sqrt(D)) . values for (..., R, D) rows against (..., S, D) keys.

    The scale rides in the GEMM (alpha, applied to the fp32 accumulator) and softmax runs on the
    scores in their own dtype (it accumulates in fp32 inside): each extra elementwise pass over
    the (R x S) scores costs about as much as reading the keys once at long context, and it grows
    with the number of verified tokens while the key read does not.
    """
    S, D = keys.shape[-2:]
    # On CUDA a bf16 GEMM with an odd key count and more than one row runs in cuBLAS fallback kernels,
    # 4x slower at 64K keys on an H100 (a pass of T=7 took 30 ms against 9 ms for T=8): the last key
    # of an odd S gets its own tiny GEMMs, and the scores' rows an even stride.
    even = S - S % 2 if rows.is_cuda and rows.shape[-2] > 1 else S
    stride = even + 2 if even < S else S
    scores = rows.new_empty(*rows.shape[:-1], stride)[..., :S]
    for part in (slice(0, even), slice(even, S)) if even < S else (slice(0, S),):
        _gemm(scores[..., part], rows, keys[..., part, :].transpose(-1, -2), beta=0, alpha=D ** -0.5)
    if future is not None:  # only the last T keys can be in a query's future
        scores[..., S - future.shape[1]:].masked_fill_(future, float("-inf"))
    if even == S:
        return torch.matmul(torch.softmax(scores, dim=-1), values)
    probs = scores.copy_(torch.softmax(scores, dim=-1))
    out = torch.matmul(probs[..., :even], values[..., :even, :])
    return _gemm(out, probs[..., even:], values[..., even:, :], beta=1, alpha=1)


def _gemm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float, alpha: float) -> torch.Tensor:
    """out = beta * out + alpha * a @ b, in place, for 2-D or batched 3-D operands."""
    return (out.addmm_ if a.dim() == 2 else out.baddbmm_)(a, b, beta=beta, alpha=alpha)


def _attend_flash(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    # flash-attn wants (batch, tokens, heads, dim) with unit stride in dim only, so a token-major cache
    # (the offloaded store's layout) passes as a view; causal masking is aligned to the last key
    T, Hq, D = q.shape
    out = _FLASH(q[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None], causal=True)
    return out[0].reshape(T, Hq * D)


def _attend_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    T, Hq, D = q.shape
    S = keys.shape[1]
    # A whole prompt in one piece (T == S) is plain causal attention: `is_causal` lets the fused kernel
    # skip the blocks above the diagonal, about half the work, where a mask makes it compute them all
    # and read a (T, S) mask besides. SDPA aligns `is_causal` to the top-left, so it is only right here.
    square = T == S
    if not square and _CPU_FLASH is not None and not q.is_cuda:
        return _attend_past_and_piece(q, keys, values)
    if not square and q.is_cuda:  # the diagonal aligned to the last key: a fused kernel, no mask
        # imported here: the module imports torch's compiler, a second of every CPU start
        from torch.nn.attention.bias import causal_lower_right
        return attend_shared_heads(q, keys, values, causal_lower_right(T, S))
    visible = None if square else torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None],
                                         attn_mask=visible, is_causal=square, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(T, Hq * D)


# torch's CPU flash kernel, which also returns each row's log-sum-exp (public SDPA does not)
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attend_past_and_piece(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A later prefill piece on CPU: attention to the cached past with no mask, and to the piece
    itself with a causal one, merged by their log-sum-exps. The past part folds the query heads that
    share a KV head into its rows, so each past key is read once per KV head, and the masked upper
    triangle of the piece is skipped: 1.3x the masked SDPA call at 4K queries x 24K keys (bf16 and
    fp32, 2 cores), and no (T, S) mask to build per layer."""
    T, Hq, D = q.shape
    Hkv, S, _ = keys.shape
    rep, past = Hq // Hkv, S - T
    folded = q.reshape(T, Hkv, rep, D).permute(1, 2, 0, 3).reshape(1, Hkv, rep * T, D)
    out_past, lse_past = _CPU_FLASH(folded, keys[None, :, :past], values[None, :, :past])
    own_keys = keys[:, past:].repeat_interleave(rep, 0)[None]  # T keys only: a small copy
    own_values = values[:, past:].repeat_interleave(rep, 0)[None]
    out_own, lse_own = _CPU_FLASH(q.transpose(0, 1)[None], own_keys, own_values, is_causal=True)
    exact = torch.promote_types(q.dtype, torch.float32)  # merged in at least fp32
    lse_past, lse_own = lse_past.reshape(Hq, T, 1).to(exact), lse_own.reshape(Hq, T, 1).to(exact)
    total = torch.logaddexp(lse_past, lse_own)
    out = (out_past.reshape(Hq, T, D).to(exact) * torch.exp(lse_past - total)
           + out_own.reshape(Hq, T, D).to(exact) * torch.exp(lse_own - total))
    return out.to(q.dtype).transpose(0, 1).reshape(T, Hq * D)
