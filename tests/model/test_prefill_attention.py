"""decode_attention.prefill: a prefill piece's bf16 attention (T >= 32 new tokens over the cache)
against float64, over a plain and a tiled cache (keys in tiles, values in pairs), on one and two threads, and the path attention.py takes
for it. (A whole bf16 model over tiled and plain caches, prompt pieces included, bit for bit:
tests/model/test_key_tiles.py.)"""
import pytest
import torch
import torch.nn.functional as F

from triforce.model import attention, cpu_pool, key_tiles
from triforce.model import decode_attention as bf16
from tests.model.test_decode_attention_bf16 import BOUND
from tests.model.test_decode_attention_f32 import attend_reference

needs_kernels = pytest.mark.skipif(not bf16.available(), reason="no avx512_bf16 or no C++ compiler: SDPA serves")


def piece(T, start, Hkv, rep, D, seed):
    """q (T, Hkv * rep, D) of the piece's tokens, keys and values (Hkv, S, D) of the past and the piece,
    and the same in buffers of whole blocks as a tiled full cache holds them: (keys in tiles, values in
    pairs)."""
    g = torch.Generator().manual_seed(seed)
    S = start + T
    q = torch.randn(T, Hkv * rep, D, generator=g).bfloat16()
    keys = torch.randn(Hkv, S, D, generator=g).bfloat16()
    values = torch.zeros(Hkv, key_tiles.slots_for(S), D, dtype=torch.bfloat16)
    values[:, :S] = torch.randn(Hkv, S, D, generator=g).bfloat16()
    tiled, paired = torch.zeros_like(values), torch.zeros_like(values)
    key_tiles.write(tiled, torch.arange(S), keys)
    key_tiles.write_values(paired, torch.arange(S), values[:, :S])
    return q, keys, values[:, :S], (tiled[:, :S], paired[:, :S])


def reference(q, keys, values, start):
    """attend_reference's float64 attention, rows grouped as attention.py groups them."""
    T, Hq, D = q.shape
    Hkv = keys.shape[0]
    rep = Hq // Hkv
    rows = q.view(T, Hkv, rep, D).permute(1, 2, 0, 3).reshape(Hkv, rep * T, D)
    want, scale = attend_reference(rows, keys, values, torch.arange(start + 1, start + T + 1), D ** -0.5)
    ungroup = lambda x: x.view(Hkv, rep, T, D).permute(2, 0, 1, 3).reshape(T, Hq * D)  # noqa: E731
    return ungroup(want), ungroup(scale)


# (tokens, keys before them, KV heads, query heads per KV head, head_dim): pieces whose blocks of rows
# end mid-block (the rows a task takes: 96 / rep tokens), steps of 256 keys ending mid-step and mid-tile,
# rows whose last step is one they see none of, Llama-2's heads (128 wide, no grouping) and Qwen2's 7
@pytest.mark.parametrize("T,start,Hkv,rep,D", [
    (32, 0, 3, 3, 64), (33, 0, 1, 3, 64), (100, 0, 3, 3, 64), (97, 160, 2, 3, 64), (40, 300, 2, 7, 64),
    (257, 2100, 1, 3, 64), (64, 0, 2, 1, 128), (130, 1000, 1, 1, 128), (45, 17, 1, 2, 128)])
@needs_kernels
def test_prefill_equals_float64(T, start, Hkv, rep, D):
    """The first token of a prompt sees one key: a limit off by one moves it by a whole value."""
    q, keys, values, tiled = piece(T, start, Hkv, rep, D, seed=T + start + D)
    want, scale = reference(q, keys, values, start)
    for layout, (k, v) in (("plain", (keys, values)), ("tiled", tiled)):
        got = bf16.prefill(q, k, v, start, D ** -0.5, layout == "tiled")
        assert got.dtype == torch.bfloat16 and got.shape == want.shape, layout
        assert ((got.double() - want).abs() / scale).max().item() <= BOUND, layout


@needs_kernels
def test_prefill_bits_follow_neither_layout_nor_threads(products):
    """A tiled and a plain cache give the same sums; so do one and two threads (every task is its own)."""
    q, keys, values, tiled = piece(300, 700, 3, 3, 64, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = bf16.prefill(q, *tiled, 700, 0.125, True)
        torch.set_num_threads(2)
        with cpu_pool.kernels_threaded():
            two = bf16.prefill(q, *tiled, 700, 0.125, True)
        plain = bf16.prefill(q, keys, values, 700, 0.125, False)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two) and torch.equal(one, plain)


@needs_kernels
def test_prefill_refuses_what_does_not_fit():
    q, keys, values, tiled = piece(40, 10, 2, 3, 64, seed=2)
    with pytest.raises(RuntimeError, match="must hold the start and the new tokens"):
        bf16.prefill(q, keys, values, 11, 0.125)
    with pytest.raises(RuntimeError, match="bfloat16"):
        bf16.prefill(q.float(), keys, values, 10, 0.125)
    with pytest.raises(RuntimeError, match="whole blocks"):
        bf16.prefill(q, keys.contiguous(), values, 10, 0.125, True)  # 50 slots: not whole blocks


@needs_kernels
@pytest.mark.parametrize("start,setting", [(0, True), (90, True), (90, False), (90, None)])
def test_attend_takes_the_chosen_path_for_a_bf16_piece(start, setting, monkeypatch):
    """attention.attend sends a bf16 piece of >= SDPA_MIN_QUERIES tokens to the kernel where it is chosen
    (PREFILL_KERNEL, by default this CPU's choice), else to torch's SDPA, and either output stays within
    the bound of float64 attention on the same inputs."""
    monkeypatch.setattr(attention, "PREFILL_KERNEL", setting)
    T = attention.SDPA_MIN_QUERIES + 7
    q, keys, values, tiled = piece(T, start, 3, 3, 64, seed=start)
    calls = []
    kernel = bf16.prefill
    monkeypatch.setattr(bf16, "prefill", lambda *a: calls.append(a[3]) or kernel(*a))
    got = attention.attend(q, *tiled, tiled=True)
    chosen = attention.prefill_kernel_serves() if setting is None else setting
    assert calls == ([start] if chosen else [])
    want, scale = reference(q, keys, values, start)
    sdpa = F.scaled_dot_product_attention(q.transpose(0, 1)[None].double(), keys[None].double(),
                                          values[None].double(), enable_gqa=True,
                                          attn_mask=torch.ones(T, start + T, dtype=torch.bool).tril(start))
    assert torch.allclose(sdpa[0].transpose(0, 1).reshape(T, -1), want, atol=1e-9)
    assert ((got.double() - want).abs() / scale).max().item() <= BOUND
    assert ((attention.attend(q, keys, values).double() - want).abs() / scale).max().item() <= BOUND


@pytest.mark.parametrize("flags,tiles,kernel", [({"avx512_bf16"}, True, True), ({"avx512_bf16", "amx_bf16"}, False, True),
                                                ({"avx512_bf16", "amx_bf16"}, True, False)])
def test_the_default_follows_whether_sdpa_has_amx(flags, tiles, kernel, monkeypatch):
    """By default our kernel serves unless torch's flash kernel multiplies in AMX tiles: the CPU has
    amx_bf16 and torch may use the tiles (the OS allows them)."""
    monkeypatch.setattr(attention, "PREFILL_KERNEL", None)
    monkeypatch.setattr(attention.kv_dtype, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: tiles, raising=False)
    attention._sdpa_has_amx.cache_clear()
    try:
        assert attention.prefill_kernel_serves() is kernel
        monkeypatch.setattr(attention, "PREFILL_KERNEL", not kernel)  # a setting wins over the CPU
        assert attention.prefill_kernel_serves() is (not kernel)
    finally:
        monkeypatch.undo()
        attention._sdpa_has_amx.cache_clear()
