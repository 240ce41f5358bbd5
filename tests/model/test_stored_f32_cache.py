"""Float32 on stored weights through the compiled one-row product (stored_f32: where stored_avx2's
kernels do not build, so these tests turn those off), and the packed model kept beside the GGUF
(stored_cache). Tiny random GGUFs built in memory, as in test_stored.py (whose float32 greedy tests
of every mode run on the float32 route that builds here)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from triforce.model import gguf_loader, stored_avx2, stored_cache, stored_f32
from triforce.model.gguf_loader import load_gguf_model
from triforce.model.stored import PACKED_KERNEL_MAX_ROWS, PackedLinear, concat_blocks, packed_from_blocks
from triforce.speculative.caches import FullCache

from .test_stored import Q4K_CFG, Q6K_STAND_INS, random_blocks, write_tiny_gguf

needs_compiled = pytest.mark.skipif(not stored_f32.available(), reason="torch.compile builds no kernel here")


@pytest.fixture
def compiled_route(monkeypatch):
    """float32 layers as on a CPU where stored_avx2's kernels do not build: the compiled product."""
    monkeypatch.setattr(stored_avx2, "available", lambda: False)


@needs_compiled
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q5_0+Q8_0"])
def test_compiled_float32_product_is_the_gguf_matrix_and_each_row_its_own(kind, compiled_route):
    """x . W^T against float64 with W from the blocks: float32 accumulation order only; a row of a
    batch is bit for bit that row alone (a verification pass computes what one-token passes do)."""
    cols = 512 if kind == "Q4_K" else 96
    if "+" in kind:
        blocks = concat_blocks([random_blocks(part, 32, cols, seed=2 + i) for i, part in enumerate(kind.split("+"))])
    else:
        blocks = random_blocks(kind, 64, cols, seed=2)
    bias = torch.randn(64, generator=torch.Generator().manual_seed(3))
    layer = packed_from_blocks(blocks, torch.float32, bias)
    assert layer.compiled_f32 and layer.kernel_dtype is None and not hasattr(layer, "packed")
    assert torch.equal(layer.dequantized(torch.float64), blocks.dequantize())
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(4))
    expected = F.linear(x.double(), blocks.dequantize(), bias.double())
    got = layer(x)
    assert (got.double() - expected).abs().max() <= 2e-6 * expected.abs().max()
    assert torch.equal(got[2:3], layer(x[2:3]))


@needs_compiled
def test_q8_0_as_bytes_reads_every_code_back_exactly(monkeypatch, compiled_route):
    from triforce.model.gguf_blocks import Blocks
    from triforce.model.stored import ByteCodesLinear

    monkeypatch.setattr(stored_f32, "bytes_pay", lambda: True)  # whatever this CPU's vector width

    q = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8).view(8, 32)
    layer = packed_from_blocks(Blocks("Q8_0", q, torch.full((8, 1), 0.5), None), torch.float32)
    assert isinstance(layer, ByteCodesLinear) and layer.bytes_per_row_pass() == 8 * 32 + 8 * 4
    assert torch.equal(layer(torch.eye(32)[:PACKED_KERNEL_MAX_ROWS]).t(), (q.float() * 0.5)[:, :PACKED_KERNEL_MAX_ROWS])
    assert torch.equal(layer.dequantized(torch.float32), q.float() * 0.5)
    assert torch.equal(layer.dequantized(torch.float64), q.double() * 0.5)


@needs_compiled
@pytest.mark.parametrize("fixture", ["q4_1", "q4_k"])
def test_one_token_float32_passes_equal_the_float64_dequantized_model(tmp_path, fixture, compiled_route):
    """Token by token (every matrix through the compiled product) against float64 dense weights."""
    path = tmp_path / "m.gguf"
    if fixture == "q4_1":
        write_tiny_gguf(path)
    else:
        write_tiny_gguf(path, seed=3, head_kind="Q4_K", kind="Q4_K", cfg=Q4K_CFG, kept_dense=Q6K_STAND_INS, arch="qwen2")
    stored = load_gguf_model(path, torch.float32, stored=True)
    dense = load_gguf_model(path, torch.float64, stored=False)
    assert isinstance(stored.lm_head, PackedLinear) and stored.lm_head.compiled_f32
    ids = torch.arange(12) % 48
    a_cache, b_cache = FullCache(stored.kv_shape(), 64), FullCache(dense.kv_shape(), 64)
    for i in range(len(ids)):
        a = stored(ids[i:i + 1], a_cache).double()
        b = dense(ids[i:i + 1], b_cache)
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_float32_auto_stays_dense_without_the_compiled_product(monkeypatch, compiled_route):
    monkeypatch.setattr(stored_f32, "available", lambda: False)
    gguf_loader.stored_kernel_pays.cache_clear()
    try:
        assert gguf_loader.stored_kernel_pays(torch.float32) is False
    finally:
        gguf_loader.stored_kernel_pays.cache_clear()


# --- the packed model kept beside the GGUF ---------------------------------------------------------

def _logits(model):
    ids = torch.arange(5) % 48
    return model(ids, FullCache(model.kv_shape(), 16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_second_stored_load_maps_the_cache_and_equals_the_first(tmp_path, monkeypatch, dtype):
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, seed=6, head_kind="Q4_K", kind="Q4_K", cfg=Q4K_CFG, kept_dense=Q6K_STAND_INS, arch="qwen2")
    first = load_gguf_model(path, dtype, stored=True)
    cache = stored_cache.cache_path(path, dtype)
    assert cache.is_file()

    def no_gguf(_):
        raise AssertionError("the second load parsed the GGUF")

    monkeypatch.setattr(gguf_loader, "open_checkpoint", no_gguf)
    second = load_gguf_model(path, dtype, stored=True)
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert repr(first) == repr(second)
    assert torch.equal(_logits(first), _logits(second))
    assert gguf_loader.weights_summary(first)["bytes_per_pass"] == gguf_loader.weights_summary(second)["bytes_per_pass"]


@pytest.mark.parametrize("kind,arch", [("Q4_1", "llama"), ("Q8_0", "llama"), ("Q5_0", "qwen2")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_skeleton_of_every_form_fits_its_cache(tmp_path, monkeypatch, kind, arch, dtype):
    """A cached load builds its modules on meta without computing the packing (stored.shape_only):
    for affine and signed codes (two halves, or bytes on the compiled float32 route), with llama's
    q and k rows reordered, the shapes fit the cache, which serves the second load whole."""
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, seed=7, kind=kind, arch=arch)
    first = load_gguf_model(path, dtype, stored=True)
    monkeypatch.setattr(gguf_loader, "open_checkpoint", lambda _: pytest.fail("the second load parsed the GGUF"))
    second = load_gguf_model(path, dtype, stored=True)
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) and repr(first) == repr(second)
    assert torch.equal(_logits(first), _logits(second))


def test_a_cached_load_imports_no_compiler(tmp_path):
    """Loading from the cache runs no torch op on meta and marks no function for torch.compile:
    either imports torch._dynamo, a second of every start (the main job: 11.4 s in all)."""
    import subprocess
    import sys

    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, seed=8)
    load_gguf_model(path, torch.bfloat16, stored=True)
    code = ("import sys, torch; from triforce.model.gguf_loader import load_gguf_model; "
            f"m = load_gguf_model({str(path)!r}, torch.bfloat16, stored=True); "
            "print('dynamo' if 'torch._dynamo' in sys.modules else 'no dynamo', type(m.layers[0].mlp.w2).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["no", "dynamo", "PackedLinear"] and "rebuilding" not in out.stderr


@pytest.mark.parametrize("damage", ["stale", "truncated", "garbage"])
def test_a_stale_or_corrupt_cache_is_rebuilt_with_a_note(tmp_path, monkeypatch, capsys, damage):
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, seed=7)
    first = load_gguf_model(path, torch.bfloat16, stored=True)
    cache = stored_cache.cache_path(path, torch.bfloat16)
    if damage == "stale":
        monkeypatch.setattr(stored_cache, "FORMAT", "older")
    elif damage == "truncated":
        cache.write_bytes(cache.read_bytes()[:1000])
    else:
        cache.write_bytes(b"\x00not a safetensors file" * 10)
    capsys.readouterr()
    again = load_gguf_model(path, torch.bfloat16, stored=True)
    notes = capsys.readouterr().err.strip().splitlines()
    assert len(notes) == 1 and notes[0].startswith(f"note: rebuilding {cache.name}")
    assert torch.equal(_logits(first), _logits(again))
    assert stored_cache.read(cache, stored_cache.cache_key(gguf_loader._sha256(path), torch.bfloat16)) is not None


def test_a_changed_gguf_is_not_served_from_its_old_cache(tmp_path, capsys):
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, seed=8)
    load_gguf_model(path, torch.bfloat16, stored=True)
    write_tiny_gguf(path, seed=9)  # same name, other weights
    capsys.readouterr()
    again = load_gguf_model(path, torch.bfloat16, stored=True)
    assert "made with another gguf_sha256" in capsys.readouterr().err
    fresh = load_gguf_model(path, torch.bfloat16, stored=True)
    assert torch.equal(_logits(again), _logits(fresh))


def test_the_cache_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("TRIFORCE_STORED_CACHE", "0")
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, seed=10)
    load_gguf_model(path, torch.bfloat16, stored=True)
    assert not stored_cache.cache_path(path, torch.bfloat16).exists()
