"""Keys in tiles and values in pairs (model/key_tiles.py): the layout functions against plain indexing,
the bf16 kernels over a tiled cache against the same kernels over a plain one (the same bits, through
AMX tiles and the avx512 kernels), and a bf16 model whose full cache is tiled against one whose cache
is not: the same logits, bit for bit, on every path (the kernels' decode and verification passes,
prefill pieces through SDPA, the static view, and torch's GEMMs where no kernel serves), and the same
keys and values for everything that reads them by slot."""
import dataclasses

import pytest
import torch

from triforce.model import decode_attention, key_tiles
from triforce.speculative.caches import FullCache

needs_kernels = pytest.mark.skipif(not decode_attention.available(),
                                   reason="no avx512_bf16 or no C++ compiler: no cache tiles its keys")


def tiled_copy(plain: torch.Tensor) -> torch.Tensor:
    """A tiled buffer holding plain keys (..., S, D), S whole tiles."""
    buffer = torch.zeros_like(plain)
    key_tiles.write(buffer, torch.arange(plain.shape[-2]), plain)
    return buffer


def paired_copy(plain: torch.Tensor) -> torch.Tensor:
    """A paired buffer holding plain values (..., S, D)."""
    buffer = torch.zeros_like(plain)
    key_tiles.write_values(buffer, torch.arange(plain.shape[-2]), plain)
    return buffer


def random(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def test_a_tile_holds_word_p_of_its_16_keys_side_by_side():
    """The layout the kernel reads: in the tile of keys 16t..16t+15, dim d of key s at
    (t * D / 2 + d // 2) * 32 + (s % 16) * 2 + d % 2."""
    S, D = 64, 8
    plain = torch.arange(S * D, dtype=torch.float32).view(1, S, D)
    flat = tiled_copy(plain).flatten()
    for s in (0, 5, 16, 17, 63):
        for d in range(D):
            assert flat[(s // 16 * D // 2 + d // 2) * 32 + s % 16 * 2 + d % 2] == plain[0, s, d]


def test_a_pair_holds_two_values_dim_by_dim():
    """The layout the values' products read: value s, dim d at (s // 2 * D + d) * 2 + s % 2."""
    S, D = 64, 8
    plain = torch.arange(S * D, dtype=torch.float32).view(1, S, D)
    flat = paired_copy(plain).flatten()
    for s in (0, 1, 5, 16, 63):
        for d in range(D):
            assert flat[(s // 2 * D + d) * 2 + s % 2] == plain[0, s, d]


# each layout: (copy into it, read back, write at slots, gather per head)
LAYOUTS = {"keys": (tiled_copy, key_tiles.read, key_tiles.write, key_tiles.gather),
           "values": (paired_copy, key_tiles.read_values, key_tiles.write_values, key_tiles.gather_values)}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("start,end", [(0, 128), (5, 77), (16, 32), (63, 65), (127, 128), (40, 40), (3, 4)])
def test_read_gives_back_what_write_put(start, end, layout):
    copy, read, _, _ = LAYOUTS[layout]
    plain = random(2, 3, 128, 8)
    buffer = copy(plain)
    assert not torch.equal(buffer, plain)  # another layout
    assert torch.equal(read(buffer, start, end), plain[..., start:end, :])
    # a buffer's first slots (a narrowed view, as attention gets a layer's live slots) read the same
    assert torch.equal(read(buffer[..., :max(end, 1), :], start, end), plain[..., start:end, :])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_write_at_scattered_slots_and_gather_per_head(layout):
    copy, read, write, gather = LAYOUTS[layout]
    plain = random(3, 128, 8, seed=1)
    buffer = copy(plain)
    slots = torch.tensor([3, 70, 71, 127])
    new = random(3, 4, 8, seed=2)
    write(buffer, slots, new)
    plain[:, slots] = new
    assert torch.equal(read(buffer, 0, 128), plain)
    index = torch.randint(0, 128, (3, 10), generator=torch.Generator().manual_seed(3))
    heads = torch.arange(3)[:, None]
    assert torch.equal(gather(buffer, index), plain[heads, index])


def test_slots_come_in_whole_blocks():
    assert [key_tiles.slots_for(n) for n in (1, 64, 65, 200)] == [64, 64, 128, 256]


@needs_kernels
@pytest.mark.parametrize("D", decode_attention.HEAD_DIMS)
@pytest.mark.parametrize("S", [1, 17, 64, 77, 2051])
@pytest.mark.parametrize("R,T", [(1, 1), (3, 1), (7, 1), (21, 7), (42, 7)])
def test_the_kernels_read_tiles_to_the_same_bits(R, T, S, D, products):
    """The scores' chains are the ones the transposed blocks gave, the values' sums the ones the
    interleaved pairs gave: every output bit equal, at part blocks, part tiles, odd keys and two spans.
    The slots past the keys hold values (a later token's, in a cache): a pair's partner slot past the
    last key is weighed 0, and the bits are those of a zero there."""
    if T > S:
        pytest.skip("fewer keys than new tokens")
    slots = key_tiles.slots_for(S)
    keys, values = random(2, slots, D, seed=S + D, dtype=torch.bfloat16), random(2, slots, D, seed=R, dtype=torch.bfloat16)
    rows = random(2, R, D, seed=T, dtype=torch.bfloat16)
    limits = torch.arange(S - T + 1, S + 1)
    want = decode_attention.attend(rows, keys[:, :S], values[:, :S].contiguous(), limits, D ** -0.5)
    got = decode_attention.attend(rows, tiled_copy(keys)[:, :S], paired_copy(values)[:, :S], limits, D ** -0.5, True)
    assert torch.equal(got, want)


@needs_kernels
@pytest.mark.usefixtures("products")
@pytest.mark.parametrize("T,start,rep,D", [(1, 0, 3, 64), (1, 300, 1, 128), (5, 2046, 3, 64), (7, 4100, 1, 128),
                                          (3, 17, 2, 64)])
def test_cache_attend_writes_tiles_and_attends_to_the_same_bits(T, start, rep, D):
    """From strided views of one projection, as a layer hands them over; across spans of keys."""
    L, H, slots = 2, 2, key_tiles.slots_for(4200)
    keys, values = random(L, H, slots, D, dtype=torch.bfloat16), random(L, H, slots, D, seed=1, dtype=torch.bfloat16)
    qkv = random(T, (H * rep + 2 * H) * D, seed=2, dtype=torch.bfloat16)
    q = qkv[:, :H * rep * D].view(T, H * rep, D)
    k = qkv[:, H * rep * D:(H * rep + H) * D].view(T, H, D)
    v = qkv[:, (H * rep + H) * D:].view(T, H, D)
    plain_k, plain_v, tiles_k, pairs_v = keys.clone(), values.clone(), tiled_copy(keys), paired_copy(values)
    want = decode_attention.cache_attend(q, k, v, plain_k, plain_v, 1, start, D ** -0.5)
    got = decode_attention.cache_attend(q, k, v, tiles_k, pairs_v, 1, start, D ** -0.5, True)
    assert torch.equal(got, want)
    assert torch.equal(key_tiles.read(tiles_k, 0, slots), plain_k)
    assert torch.equal(key_tiles.read_values(pairs_v, 0, slots), plain_v)


@needs_kernels
def test_tiled_attention_refuses_a_buffer_of_part_blocks():
    """A part block's tiles are read whole: a buffer that does not hold them is refused, not read past."""
    keys = random(2, 70, 64, dtype=torch.bfloat16)
    rows = random(2, 3, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="whole blocks"):
        decode_attention.attend(rows, keys, keys, torch.tensor([70]), 0.125, True)
    cache = random(1, 2, 70, 64, dtype=torch.bfloat16)
    kv = random(1, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="whole blocks"):
        decode_attention.cache_attend(kv, kv, kv, cache, cache.clone(), 0, 3, 0.125, True)


# --- a bf16 model over a full cache with and without tiles ---

@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    from tests.conftest import save_tiny
    from triforce.model.loader import load_model

    folder = tmp_path_factory.mktemp("tiny")
    save_tiny(folder, seed=3, vocab=64, layers=2, hidden=192, heads=3, kv_heads=1, inter=96)  # SmolLM2's head_dim
    return load_model(folder, torch.bfloat16), load_model(folder, torch.float32)


@needs_kernels
def test_bf16_models_tile_their_full_caches_keys_float32_models_do_not(bf16_model):
    bf16, f32 = bf16_model
    assert bf16.kv_shape().tiled_keys and not f32.kv_shape().tiled_keys
    cache = FullCache(bf16.kv_shape(), 300)
    assert cache.tiled and cache.capacity == 320


def caches_of(model, max_len=300):
    shape = model.kv_shape()
    return FullCache(shape, max_len), FullCache(dataclasses.replace(shape, tiled_keys=False), max_len)


# prompt pieces over SDPA (>= 32 tokens), a decode step, a verification pass, a longer piece
FEEDS = [(0, 100), (100, 101), (101, 108), (108, 140), (140, 141)]


@needs_kernels
@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch-gemms"])
def test_a_bf16_model_gives_the_same_bits_with_its_keys_in_tiles(bf16_model, kernels, monkeypatch):
    model = bf16_model[0]
    if not kernels:  # attention through torch's GEMMs: tiled keys are read as a plain copy
        monkeypatch.setattr(decode_attention, "serves", lambda rows, cache: False)
    ids = torch.tensor([3 + (i * 7) % 60 for i in range(160)])
    tiled, plain = caches_of(model)
    with torch.no_grad():
        for start, end in FEEDS:
            assert torch.equal(model(ids[start:end], tiled), model(ids[start:end], plain)), (start, end)
        for cache in (tiled, plain):
            cache.rollback(120)
        for start, end in [(120, 127), (127, 128)]:
            assert torch.equal(model(ids[start:end], tiled), model(ids[start:end], plain)), (start, end)


@needs_kernels
def test_what_reads_keys_by_slot_reads_the_same(bf16_model):
    """The retrieval level (chunk means, gathers), slices and the KV file (read, write)."""
    model = bf16_model[0]
    ids = torch.tensor([5 + (i * 11) % 50 for i in range(130)])
    tiled, plain = caches_of(model)
    with torch.no_grad():
        for cache in (tiled, plain):
            model(ids, cache)
    index = torch.randint(0, 130, (1, 20), generator=torch.Generator().manual_seed(0))
    for a, b in [(tiled.read(1, 3, 99), plain.read(1, 3, 99)), (tiled.gather(0, index), plain.gather(0, index)),
                 (tiled.slice(17, 130), plain.slice(17, 130))]:
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(tiled.chunk_key_means(1, 16, 8), plain.chunk_key_means(1, 16, 8))
    k, v = random(1, 9, 64, seed=4, dtype=torch.bfloat16), random(1, 9, 64, seed=5, dtype=torch.bfloat16)
    for cache in (tiled, plain):
        cache.write(0, 60, k, v)
    assert torch.equal(tiled.read(0, 0, 130)[0], plain.read(0, 0, 130)[0])


@needs_kernels
def test_the_static_view_writes_and_reads_tiles(bf16_model):
    """Compiled passes and device rounds attend through static views (speculative/graphs.py)."""
    from triforce.speculative.graphs import GraphedModel

    model = bf16_model[0]
    ids = torch.tensor([3 + (i * 5) % 60 for i in range(120)])
    tiled, plain = caches_of(model)
    static = GraphedModel(model, eager_static=True)
    with torch.no_grad():
        for cache in (tiled, plain):
            model(ids[:100], cache)
        for start, end in [(100, 101), (101, 108), (108, 109)]:
            got = static(ids[start:end], tiled)  # ends the pass on the cache itself
            want = model(ids[start:end], plain)
            assert torch.equal(got, want), (start, end)
    assert static.views  # the passes went through static views
