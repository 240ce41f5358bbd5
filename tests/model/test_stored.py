"""Weights as stored: GGUF Q4_1/Q8_0/Q5_0/Q4_K blocks computed through torch's packed int4 kernel.

Every checkpoint here is built in memory from random blocks (gguf's writer, no downloads). The packed
layers must be the GGUF's own weights (float64 dequantization of the blocks) to float accumulation
order, the loader must undo llama.cpp's q/k row interleave, and greedy decoding of every mode on the
stored model must equal its autoregressive decoding."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from triforce.model import stored_bf16
from triforce.model.errors import UserError
from triforce.model.gguf_blocks import (Blocks, GgufCheckpoint, decode_q4_1, decode_q4_k, decode_q5_0, decode_q8_0,
                                        encode_blocks, encode_q4_k)
from triforce.model.gguf_loader import gguf_origin, load_gguf_model, resolve_weights, weights_summary
from triforce.model.loader import load_model
from triforce.model.transformer import Linear
from triforce.model.stored import PACKED_KERNEL_MAX_ROWS, PackedLinear, concat_blocks, packed_from_blocks
from triforce.speculative import GenerationConfig, Models, generate_ids
from triforce.speculative.caches import FullCache


def random_q4_k(rows: int, cols: int, seed: int) -> tuple[dict, torch.Tensor]:
    """Q4_K super-blocks as their parts (f16 d ~ 1e-4..1e-3 and dmin, 6-bit scales and mins over
    their whole range, 4-bit codes) and the weights they mean, d * sc * q - dmin * m in float64."""
    g = torch.Generator().manual_seed(seed)
    supers = cols // 256
    parts = dict(d=(torch.rand(rows, supers, generator=g) * 1e-3 + 1e-4).half().float(),
                 dmin=(torch.rand(rows, supers, generator=g) * 1e-3 + 1e-4).half().float(),
                 scales=torch.randint(0, 64, (rows, supers, 8), generator=g),
                 mins=torch.randint(0, 64, (rows, supers, 8), generator=g),
                 q=torch.randint(0, 16, (rows, cols), generator=g))
    d, dmin = parts["d"].double()[..., None], parts["dmin"].double()[..., None]
    sub_scale = (d * parts["scales"]).view(rows, -1, 1)  # (rows, sub-blocks, 1)
    sub_min = (dmin * parts["mins"]).view(rows, -1, 1)
    weights = (sub_scale * parts["q"].double().view(rows, -1, 32) - sub_min).view(rows, cols)
    return parts, weights


def random_blocks(kind: str, rows: int, cols: int, seed: int) -> Blocks:
    """Codes over their whole range and f16 scales of a realistic size (d ~ 1e-3..1e-2, m ~ -8d)."""
    if kind == "Q4_K":
        parts, _ = random_q4_k(rows, cols, seed)
        return decode_q4_k(encode_q4_k(**parts), rows, cols)
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(rows, cols // 32, generator=g) * 0.01 + 0.001).half().float()
    if kind == "Q4_1":
        q = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8)
        m = (-8 * d * (0.5 + torch.rand(d.shape, generator=g))).half().float()
        return Blocks(kind, q, d, m)
    low, high = (-16, 16) if kind == "Q5_0" else (-128, 128)
    return Blocks(kind, torch.randint(low, high, (rows, cols), generator=g).to(torch.int8), d, None)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q5_0"])
def test_blocks_round_trip_through_gguf_bytes(kind):
    blocks = random_blocks(kind, 48, 96, seed=1)
    decode = {"Q4_1": decode_q4_1, "Q8_0": decode_q8_0, "Q5_0": decode_q5_0}[kind]
    back = decode(encode_blocks(blocks), 48, 96)
    assert torch.equal(back.q.to(torch.int16), blocks.q.to(torch.int16)) and torch.equal(back.d, blocks.d)
    assert back.m is None if kind != "Q4_1" else torch.equal(back.m, blocks.m)
    assert back.stored_bytes == 48 * 3 * {"Q4_1": 20, "Q8_0": 34, "Q5_0": 22}[kind]


def test_q5_0_decoder_equals_gguf_dequantizer_bit_for_bit():
    """Arbitrary bytes (every high-bit word, every nibble) decode to gguf's own float32 values."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(11)
    raw = rng.integers(0, 256, (6, 3, 22), dtype=np.uint8)
    raw[..., 0:2] = rng.uniform(-0.02, 0.02, (6, 3, 1)).astype(np.float16).view(np.uint8)  # finite d
    raw = raw.reshape(6, 66)
    ours = decode_q5_0(raw, 6, 96)
    theirs = dequantize(raw, GGMLQuantizationType.Q5_0).reshape(6, 96)
    assert np.array_equal(ours.dequantize(torch.float32).numpy().view(np.uint32), theirs.view(np.uint32))
    assert ours.q.min() >= -16 and ours.q.max() <= 15


def test_q4_k_decoder_equals_gguf_dequantizer_bit_for_bit():
    """Arbitrary bytes (every scale/min bit pattern, every nibble) decode to gguf's own float32
    dequantization exactly, and blocks built from known parts decode to those parts' float64 weights."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, (6, 3, 144), dtype=np.uint8)
    raw[..., 0:4] = rng.uniform(-0.02, 0.02, (6, 3, 2)).astype(np.float16).view(np.uint8)  # finite d, dmin
    raw = raw.reshape(6, 3 * 144)
    ours = decode_q4_k(raw, 6, 768)
    theirs = dequantize(raw, GGMLQuantizationType.Q4_K).reshape(6, 768)
    assert np.array_equal(ours.dequantize(torch.float32).numpy().view(np.uint32), theirs.view(np.uint32))
    assert ours.stored_bytes == 6 * 3 * 144
    parts, weights = random_q4_k(8, 512, seed=8)
    assert torch.equal(decode_q4_k(encode_q4_k(**parts), 8, 512).dequantize(), weights)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q5_0+Q8_0"])
@pytest.mark.parametrize("rows", [1, 5, PACKED_KERNEL_MAX_ROWS + 3])
def test_packed_layer_is_the_gguf_matrix(kind, rows):
    """float32 through the kernel (few rows) or a dequantized GEMM (many) equals x . W^T in float64
    with W dequantized from the blocks: the only difference is the order of float32 additions."""
    cols = 512 if kind == "Q4_K" else 96  # Q4_K: super-blocks of 256
    if "+" in kind:  # a fused projection of two kinds of one form (Qwen2.5-0.5B's q, k Q5_0 and v Q8_0)
        blocks = concat_blocks([random_blocks(part, 32, cols, seed=2 + i) for i, part in enumerate(kind.split("+"))])
        assert blocks.stored_bytes == 32 * 3 * (22 + 34)
    else:
        blocks = random_blocks(kind, 64, cols, seed=2)
    bias = torch.randn(64, generator=torch.Generator().manual_seed(3))
    layer = packed_from_blocks(blocks, torch.float32, bias)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(4))
    expected = F.linear(x.double(), blocks.dequantize(), bias.double())
    got = layer(x).double()
    scale = expected.abs().max()
    assert (got - expected).abs().max() <= 2e-6 * scale
    # and the dequantized form is the GGUF's weights exactly (f16 scales widen to float32 exactly)
    assert torch.equal(layer.dequantized(torch.float64), blocks.dequantize())
    assert torch.equal(layer.dequantized(torch.float32).double(), blocks.dequantize())


def test_q8_0_splits_into_int4_halves_exactly(monkeypatch):
    """-128 and 127, the extremes, and every code between survive the hi/lo split (the int4 kernel's
    float32 path: where neither stored_avx2's kernels nor the compiled product build)."""
    from triforce.model import stored_avx2, stored_f32

    monkeypatch.setattr(stored_f32, "available", lambda: False)
    monkeypatch.setattr(stored_avx2, "available", lambda: False)
    q = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8).view(8, 32)
    blocks = Blocks("Q8_0", q, torch.full((8, 1), 0.5), None)
    layer = packed_from_blocks(blocks, torch.float32)
    assert isinstance(layer, PackedLinear) and layer.repeat == 2
    assert torch.equal(layer.dequantized(torch.float64), q.double() * 0.5)
    # one-hot rows read single weights back through the kernel itself
    eye = torch.eye(32)
    assert torch.equal(layer(eye[:4]).t(), (q.float() * 0.5)[:, :4])


def test_q4_k_packed_layer_reads_the_gguf_weights_back():
    """One-hot rows through the kernel read single Q4_K weights back (d * sc * q - dmin * m, from the
    parts, not from our decoder): a wrong code, scale or zero offset shows here."""
    parts, weights = random_q4_k(16, 256, seed=9)
    layer = packed_from_blocks(decode_q4_k(encode_q4_k(**parts), 16, 256), torch.float32)
    assert layer.kind == "Q4_K" and layer.stored_bytes == 16 * 144
    read = layer(torch.eye(256)[:PACKED_KERNEL_MAX_ROWS]).t()  # (16 rows, first 16 columns)
    assert torch.equal(read.double(), weights[:, :PACKED_KERNEL_MAX_ROWS].float().double())


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K"])
def test_bf16_kernel_stays_within_bf16_rounding(kind):
    cols = 512 if kind == "Q4_K" else 96
    blocks = random_blocks(kind, 64, cols, seed=5)
    layer = packed_from_blocks(blocks, torch.bfloat16)
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(6))
    expected = F.linear(x.bfloat16().double(), blocks.dequantize())
    assert (layer(x.bfloat16()).double() - expected).abs().max() <= 2 ** -6 * expected.abs().max()


# --- a whole model from a GGUF file built here ------------------------------------------------------

CFG = dict(hidden=64, heads=4, kv_heads=2, inter=96, layers=2, vocab=48)


def bf16_codes() -> str:
    """How bfloat16 computes with the blocks here: our kernels over them where they build
    (stored_bf16), else torch's int4 kernel."""
    return "blocks" if stored_bf16.available() else "int4"


def write_tiny_gguf(path, seed=0, head_kind="Q8_0", dense=False, kind="Q4_1", cfg=CFG, kept_dense=(), kinds=None,
                    arch="llama"):
    """A tiny llama GGUF: `kind` matrices, a `head_kind` token embedding tied to the head (SmolLM2's
    layout: Q4_1 and Q8_0), float32 norms; the matrices named in `kept_dense` are written as float16,
    as a type the kernel does not take (Qwen's Q6_K); `kinds` names other types for some matrices;
    arch "qwen2" adds q, k, v biases. Returns {GGUF name: Blocks or tensor} as written."""
    import gguf

    h, inter = cfg["hidden"], cfg["inter"]
    head_dim = h // cfg["heads"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["layers"])
    w.add_context_length(512)
    w.add_embedding_length(h)
    w.add_feed_forward_length(inter)
    w.add_head_count(cfg["heads"])
    w.add_head_count_kv(cfg["kv_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    written = {}
    g = torch.Generator().manual_seed(seed)

    def matrix(name, kind, rows, cols):
        kind = (kinds or {}).get(name, kind)
        raw = None
        if kind == "Q4_K":  # written from its parts: decoded Q4_K blocks have no encoder
            parts, _ = random_q4_k(rows, cols, seed=len(written) + 100 * seed)
            raw = encode_q4_k(**parts)
            blocks = decode_q4_k(raw, rows, cols)
        else:
            blocks = random_blocks(kind, rows, cols, seed=len(written) + 100 * seed)
        if dense or name in kept_dense:  # a type the packed kernel does not take (as Qwen's Q6_K): written as float16
            w.add_tensor(name, blocks.dequantize(torch.float16).numpy())
            written[name] = blocks.dequantize(torch.float16).double()
            return
        w.add_tensor(name, encode_blocks(blocks) if raw is None else raw, raw_dtype=gguf.GGMLQuantizationType[kind])
        written[name] = blocks

    def vector(name, n):
        value = 1 + 0.1 * torch.randn(n, generator=g)
        w.add_tensor(name, value.numpy())
        written[name] = value

    matrix("token_embd.weight", head_kind, cfg["vocab"], h)
    vector("output_norm.weight", h)
    for i in range(cfg["layers"]):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", h)
        vector(p + "ffn_norm.weight", h)
        if arch == "qwen2":
            for part, rows in (("q", cfg["heads"] * head_dim), ("k", cfg["kv_heads"] * head_dim),
                               ("v", cfg["kv_heads"] * head_dim)):
                vector(p + f"attn_{part}.bias", rows)
        matrix(p + "attn_q.weight", kind, cfg["heads"] * head_dim, h)
        matrix(p + "attn_k.weight", kind, cfg["kv_heads"] * head_dim, h)
        matrix(p + "attn_v.weight", kind, cfg["kv_heads"] * head_dim, h)
        matrix(p + "attn_output.weight", kind, h, h)
        matrix(p + "ffn_gate.weight", kind, inter, h)
        matrix(p + "ffn_up.weight", kind, inter, h)
        matrix(p + "ffn_down.weight", kind, h, inter)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, write_tiny_gguf(path)


def test_config_and_q_k_rows_follow_the_hf_layout(tiny_gguf):
    """llama.cpp interleaves the rotary halves of each q/k head; the loader puts rows back in HF
    order: row (head, half, i) of ours is the GGUF's row (head, i, half)."""
    path, written = tiny_gguf
    cfg = GgufCheckpoint(path).config()
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.num_layers, cfg.vocab_size) == (64, 4, 2, 2, 48)
    assert cfg.tie_word_embeddings
    model = load_gguf_model(path, torch.float64, stored=True)
    wqkv = model.layers[1].attention.wqkv.dequantized(torch.float64)
    q = written["blk.1.attn_q.weight"].dequantize()
    k = written["blk.1.attn_k.weight"].dequantize()
    head_dim = 16
    ours_q = wqkv[:64].view(4, 2, head_dim // 2, 64)
    assert torch.equal(ours_q, q.view(4, head_dim // 2, 2, 64).transpose(1, 2))
    assert torch.equal(wqkv[64:96].view(2, 2, 8, 64), k.view(2, 8, 2, 64).transpose(1, 2))
    assert torch.equal(wqkv[96:], written["blk.1.attn_v.weight"].dequantize())


def test_stored_model_logits_equal_the_dense_gguf_model(tiny_gguf):
    """float32 packed (kernel for a few rows, dequantized GEMM for more) against float64 dense."""
    path, _ = tiny_gguf
    stored = load_gguf_model(path, torch.float32, stored=True)
    dense = load_gguf_model(path, torch.float64, stored=False)
    assert isinstance(stored.lm_head, PackedLinear) and stored.lm_head.kind == "Q8_0"
    assert isinstance(dense.layers[0].mlp.w13, torch.nn.Linear)
    for n in (3, PACKED_KERNEL_MAX_ROWS + 8):
        ids = torch.arange(n) % 48
        a = stored(ids, FullCache(stored.kv_shape(), 64)).double()
        b = dense(ids, FullCache(dense.kv_shape(), 64))
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_weights_summary_counts_the_stored_bytes(tiny_gguf):
    path, written = tiny_gguf
    stored = weights_summary(load_gguf_model(path, torch.bfloat16, stored=True))
    dense = weights_summary(load_gguf_model(path, torch.bfloat16, stored=False))
    assert stored["format"] == f"gguf Q4_1+Q8_0 packed {bf16_codes()}" and dense["format"] == "bfloat16"
    weights = sum(b.q.numel() for b in written.values() if isinstance(b, Blocks))
    assert dense["bytes_per_pass"] >= 2 * weights
    # codes: 4 bits per weight (8 for Q8_0's two halves); bf16 scale and zero per 32
    assert weights * 0.5 < stored["bytes_per_pass"] < weights * 0.75


@pytest.mark.parametrize("mode,use_drafter", [("speculative", True), ("retrieval", False), ("triforce", True),
                                              ("triforce", False)])
def test_greedy_on_stored_weights_is_autoregressive(tiny_gguf, mode, use_drafter):
    from triforce.model import stored_avx2, stored_f32

    path, _ = tiny_gguf
    target = load_gguf_model(path, torch.float32, stored=True)
    drafter = load_gguf_model(path, torch.float32, stored=False)
    w13 = target.layers[0].mlp.w13  # float32's route where it builds: the avx2 kernels, else compiled
    assert (w13.block_kernel == "q4") == stored_avx2.available()
    assert w13.compiled_f32 == (not stored_avx2.available() and stored_f32.available())
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(5)))
    ids = torch.randint(0, 48, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    cfg = GenerationConfig(max_new_tokens=40, budget=32, chunk_size=8, gamma1=3, gamma2=5, draft_window=16,
                           sink_tokens=4)
    reference = generate_ids(Models(target, None), ids, "autoregressive", cfg)
    result = generate_ids(Models(target, drafter if use_drafter else None), ids, mode, cfg)
    assert result.tokens == reference.tokens
    assert result.stats.full_passes < 39


# --- Qwen2.5-Coder's Q4_K_M layout: Q4_K matrices, some kept dense (its Q6_K) -------------------------

Q4K_CFG = dict(hidden=256, heads=4, kv_heads=2, inter=512, layers=2, vocab=48)  # Q4_K: columns of 256
Q6K_STAND_INS = ("blk.0.attn_v.weight", "blk.1.ffn_down.weight")  # where Q4_K_M puts Q6_K


@pytest.fixture(scope="module")
def tiny_q4_k_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-q4k.gguf"
    return path, write_tiny_gguf(path, seed=3, head_kind="Q4_K", kind="Q4_K", cfg=Q4K_CFG,
                                 kept_dense=Q6K_STAND_INS, arch="qwen2")


def test_q4_k_model_is_packed_where_it_can_be_and_equals_the_dense_gguf_model(tiny_q4_k_gguf):
    """Q4_K projections are packed; a fused projection with a part of a dense type (layer 0's q, k, v
    with v dense) packs q, k and keeps v dense, outputs side by side (the bias cut to match); logits
    equal the float64 dense model's to float accumulation order."""
    from triforce.model.stored import StackedOutputs

    path, written = tiny_q4_k_gguf
    stored = load_gguf_model(path, torch.float32, stored=True)
    dense = load_gguf_model(path, torch.float64, stored=False)
    assert isinstance(stored.lm_head, PackedLinear) and stored.lm_head.kind == "Q4_K"
    assert isinstance(stored.layers[1].attention.wqkv, PackedLinear)
    split = stored.layers[0].attention.wqkv
    assert isinstance(split, StackedOutputs)
    assert [type(p) for p in split.parts] == [PackedLinear, Linear]  # dense: transformer.Linear (its rows exact)
    assert split.parts[0].out_features == 256 + 128 and split.parts[1].weight.shape == (128, 256)
    assert torch.equal(split.parts[1].bias, written["blk.0.attn_v.bias"].float())  # v's bias, cut from q, k, v's
    assert isinstance(stored.layers[1].mlp.w2, torch.nn.Linear) and isinstance(stored.layers[0].mlp.w2, PackedLinear)
    for n in (3, PACKED_KERNEL_MAX_ROWS + 8):
        ids = torch.arange(n) % 48
        a = stored(ids, FullCache(stored.kv_shape(), 64)).double()
        b = dense(ids, FullCache(dense.kv_shape(), 64))
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    summary = weights_summary(load_gguf_model(path, torch.bfloat16, stored=True))
    assert summary["format"] == f"gguf Q4_K packed {bf16_codes()}, bfloat16 dense"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode,use_drafter", [("speculative", True), ("retrieval", False), ("triforce", True),
                                              ("triforce", False)])
@pytest.mark.parametrize("model", ["tiny_q4_k_gguf", "tiny_q5_0_gguf"])
def test_greedy_on_stored_q4_k_m_weights_is_autoregressive(request, model, dtype, mode, use_drafter):
    """bfloat16 runs the kernel's fast path (bf16 scales and zeros), float32 its exact one."""
    path, _ = request.getfixturevalue(model)
    target = load_gguf_model(path, dtype, stored=True)
    drafter = load_gguf_model(path, dtype, stored=False)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(5)).to(dtype))
    ids = torch.randint(0, 48, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    cfg = GenerationConfig(max_new_tokens=40, budget=32, chunk_size=8, gamma1=3, gamma2=5, draft_window=16,
                           sink_tokens=4)
    reference = generate_ids(Models(target, None), ids, "autoregressive", cfg)
    result = generate_ids(Models(target, drafter if use_drafter else None), ids, mode, cfg)
    assert result.tokens == reference.tokens
    assert result.stats.full_passes < 39


# Qwen2.5-Coder-0.5B's Q4_K_M: its 896 columns are no multiple of 256, so most matrices are Q5_0,
# v and the head Q8_0, some ffn_down Q4_K (columns 4864), others Q6_K
Q5_0_KINDS = {"blk.0.attn_v.weight": "Q8_0", "blk.1.attn_v.weight": "Q8_0", "blk.1.ffn_down.weight": "Q4_K"}


@pytest.fixture(scope="module")
def tiny_q5_0_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-q5_0.gguf"
    return path, write_tiny_gguf(path, seed=4, head_kind="Q5_0", kind="Q5_0", cfg=Q4K_CFG,
                                 kept_dense=("blk.0.ffn_down.weight",), kinds=Q5_0_KINDS, arch="qwen2")


def test_q5_0_model_stacks_q5_0_with_q8_0_and_equals_the_dense_gguf_model(tiny_q5_0_gguf):
    path, _ = tiny_q5_0_gguf
    stored = load_gguf_model(path, torch.float32, stored=True)
    dense = load_gguf_model(path, torch.float64, stored=False)
    wqkv = stored.layers[0].attention.wqkv
    assert isinstance(wqkv, PackedLinear) and wqkv.kind == "Q5_0+Q8_0"
    assert stored.layers[1].mlp.w2.kind == "Q4_K" and isinstance(stored.layers[0].mlp.w2, torch.nn.Linear)
    for n in (3, PACKED_KERNEL_MAX_ROWS + 8):
        ids = torch.arange(n) % 48
        a = stored(ids, FullCache(stored.kv_shape(), 64)).double()
        b = dense(ids, FullCache(dense.kv_shape(), 64))
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    summary = weights_summary(load_gguf_model(path, torch.bfloat16, stored=True))
    assert summary["format"] == f"gguf Q4_K+Q5_0+Q8_0 packed {bf16_codes()}, bfloat16 dense"


def test_auto_counts_a_mostly_q4_k_gguf_as_stored(tiny_q4_k_gguf, monkeypatch):
    """Q4_K counts toward the stored share (the float16 stand-ins for Q6_K do not); with the kernel
    paying (machine-dependent, so forced here) `auto` picks stored, below half it stays dense."""
    from triforce.model import gguf_loader

    path, written = tiny_q4_k_gguf
    total = sum(v.q.numel() if isinstance(v, Blocks) else v.numel() for v in written.values()
                if isinstance(v, Blocks) or v.dim() == 2)  # matrices: norms and biases do not count
    kept = sum(written[name].numel() for name in Q6K_STAND_INS)
    assert GgufCheckpoint(path).stored_share() == pytest.approx(1 - kept / total)
    monkeypatch.setattr(gguf_loader, "stored_kernel_pays", lambda dtype: True)
    assert resolve_weights("auto", path, "cpu", torch.bfloat16) == "stored"
    monkeypatch.setattr(gguf_loader, "MIN_STORED_SHARE", 1 - kept / total + 0.01)
    assert resolve_weights("auto", path, "cpu", torch.bfloat16) == "dequantized"


def test_a_share_recorded_with_other_stored_types_is_recounted(tiny_q4_k_gguf, tmp_path):
    """Folders prepared before Q4_K was a stored type recorded Qwen's share as 0: the loader counts
    again from the GGUF unless the marker names the types of today."""
    import hashlib

    from triforce.model.gguf_blocks import STORED_TYPES
    from triforce.model.gguf_loader import stored_share

    path, _ = tiny_q4_k_gguf
    folder = tmp_path / "prepared"
    folder.mkdir()
    marker = {"source_sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "source_gguf": str(path),
              "gguf_stored_share": 0.0}
    (folder / ".prepared.json").write_text(json.dumps(marker))
    assert stored_share(folder) == GgufCheckpoint(path).stored_share() > 0.5
    (folder / ".prepared.json").write_text(json.dumps({**marker, "gguf_stored_types": list(STORED_TYPES)}))
    assert stored_share(folder) == 0.0


def test_prepared_folder_finds_its_gguf_and_loads_either_way(tiny_gguf, tmp_path):
    """A folder whose marker records the GGUF (and its SHA-256) loads stored; a wrong hash or no
    marker falls back to the folder's own weights, and weights=stored then says why not."""
    import hashlib
    import shutil

    path, _ = tiny_gguf
    folder = tmp_path / "prepared"
    folder.mkdir()
    cfg = GgufCheckpoint(path).config()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 48, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": True}))
    shutil.copy(path, tmp_path / "model.gguf")
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    (folder / ".prepared.json").write_text(json.dumps({"source_sha256": sha, "source_gguf": "../model.gguf"}))
    assert gguf_origin(folder) == folder / "../model.gguf"
    model = load_model(folder, torch.float32, weights="stored")
    assert isinstance(model.layers[0].attention.wo, PackedLinear)
    assert resolve_weights("dequantized", folder, "cpu", torch.bfloat16) == "dequantized"
    (folder / ".prepared.json").write_text(json.dumps({"source_sha256": "0" * 64, "source_gguf": "../model.gguf"}))
    assert gguf_origin(folder) is None
    assert resolve_weights("auto", folder, "cpu", torch.bfloat16) == "dequantized"
    with pytest.raises(UserError, match="weights=stored needs"):
        resolve_weights("stored", folder, "cpu", torch.float32)


def test_gguf_path_loads_directly(tiny_gguf):
    path, _ = tiny_gguf
    model = load_model(path, torch.float32, weights="dequantized")
    assert isinstance(model.layers[0].mlp.w2, torch.nn.Linear)
    assert isinstance(load_model(path, torch.float32, weights="stored").layers[0].mlp.w2, PackedLinear)


# --- a 16-bit KV cache under float32 compute ---------------------------------------------------------

@pytest.mark.parametrize("kv", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode,use_drafter", [("speculative", True), ("retrieval", False), ("triforce", True)])
def test_sixteen_bit_kv_keeps_every_mode_autoregressive(tiny_gguf, kv, mode, use_drafter):
    """The cache stores 16 bits, attention widens them to float32; every mode still equals
    autoregressive decoding over the same cache dtype, and the logits stay near float32 KV's."""
    from triforce.model.kv_dtype import use_kv_dtype

    path, _ = tiny_gguf
    target = use_kv_dtype(load_gguf_model(path, torch.float32, stored=True), kv)
    drafter = use_kv_dtype(load_gguf_model(path, torch.float32, stored=False), kv)
    assert target.kv_shape().dtype == kv
    ids = torch.randint(0, 48, (90,), generator=torch.Generator().manual_seed(2)).tolist()
    cfg = GenerationConfig(max_new_tokens=30, budget=32, chunk_size=8, gamma1=3, gamma2=5, draft_window=16,
                           sink_tokens=4)
    reference = generate_ids(Models(target, None), ids, "autoregressive", cfg)
    result = generate_ids(Models(target, drafter if use_drafter else None), ids, mode, cfg)
    assert result.tokens == reference.tokens
    wide = load_gguf_model(path, torch.float32, stored=True)
    x = torch.tensor(ids[:40])
    narrow_logits = target(x, FullCache(target.kv_shape(), 64))
    wide_logits = wide(x, FullCache(wide.kv_shape(), 64))
    assert not torch.equal(narrow_logits, wide_logits)  # the cache really stored fewer bits
    assert (narrow_logits - wide_logits).abs().max() <= 2e-2 * wide_logits.abs().max()


def test_kv_dtype_rule():
    from triforce.model.kv_dtype import kv_dtype_for, resolve_kv_dtype

    assert kv_dtype_for("cpu", torch.bfloat16) == torch.bfloat16
    assert kv_dtype_for("cpu", torch.float64) == torch.float64
    assert kv_dtype_for("cuda", torch.float32) == torch.float32
    assert kv_dtype_for("cpu", torch.float32) in (torch.float32, torch.float16, torch.bfloat16)
    assert resolve_kv_dtype("same", "cpu", torch.float32) == torch.float32
    assert resolve_kv_dtype("bfloat16", "cpu", torch.float32) == torch.bfloat16
    with pytest.raises(UserError, match="unknown KV dtype"):
        resolve_kv_dtype("int4", "cpu", torch.float32)


def test_a_16_bit_cache_is_timed_only_where_our_kernels_do_not_read_it(monkeypatch):
    """Where the float32 attention kernels read a 16-bit cache, it is chosen untimed; elsewhere (torch's
    per-head widening) the timing decides, at the 1/0.85 bar."""
    from triforce.model import decode_attention_f32, kv_dtype

    kind = kv_dtype.sixteen_bit_kind()
    timed = []

    def speedup(value):
        return lambda *args: timed.append(args) or value

    monkeypatch.setattr(kv_dtype, "sixteen_bit_kv_speedup", speedup(0.5))
    assert kv_dtype.kv_dtype_for("cpu", torch.float32) == (kind if decode_attention_f32.available() else torch.float32)
    assert bool(timed) != decode_attention_f32.available()
    monkeypatch.setattr(decode_attention_f32, "available", lambda: False)
    for value, chosen in ((1.1, torch.float32), (1.5, kind)):
        monkeypatch.setattr(kv_dtype, "sixteen_bit_kv_speedup", speedup(value))
        assert kv_dtype.kv_dtype_for("cpu", torch.float32) == chosen


def test_a_gguf_without_stored_types_loads_dense(tmp_path):
    """Matrices of a type the kernel does not take are dequantized (gguf's own dequantizer), and
    `auto` does not choose the stored path for a GGUF that is mostly such types."""
    path = tmp_path / "dense.gguf"
    written = write_tiny_gguf(path, dense=True)
    assert GgufCheckpoint(path).stored_share() == 0.0
    assert resolve_weights("auto", path, "cpu", torch.bfloat16) == "dequantized"
    model = load_gguf_model(path, torch.float64, stored=True)
    assert isinstance(model.layers[0].mlp.w2, torch.nn.Linear)
    assert torch.equal(model.layers[0].mlp.w2.weight, written["blk.0.ffn_down.weight"])
    mixed = tmp_path / "stored.gguf"
    write_tiny_gguf(mixed)
    assert GgufCheckpoint(mixed).stored_share() == 1.0


def test_kinds_of_different_forms_do_not_stack():
    """Q4_1's affine codes and Q8_0's signed ones need different packings: no fused stack of both."""
    with pytest.raises(ValueError, match="forms differ"):
        concat_blocks([random_blocks("Q4_1", 16, 96, seed=1), random_blocks("Q8_0", 16, 96, seed=2)])


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q5_0", "Q4_K"])
def test_float32_dequantization_rounds_once(kind):
    """Computed in float32 (the loader's dense copies), the weights are float64's rounded once."""
    blocks = random_blocks(kind, 32, 512, seed=12)
    assert torch.equal(blocks.dequantize(torch.float32), blocks.dequantize(torch.float64).float())


def test_a_stored_drafter_stays_the_drafter_under_int8_proposers(tiny_gguf):
    """int8 twins are for dense weights; a stored drafter gets none and must stay the drafter (not
    fall back to the target drafting for itself)."""
    from triforce.model.quant import with_lower_weights
    from triforce.speculative import Models

    path, _ = tiny_gguf
    target = load_model(path, torch.float32, weights="dequantized")
    drafter = load_model(path, torch.float32, weights="stored")
    models = with_lower_weights(Models(target, drafter), "int8")
    assert models.drafter is drafter
    assert models.proposing_target is not None and models.proposing_target is not target  # the dense one's twin


@pytest.mark.skipif(not stored_bf16.available(), reason="no avx512_bf16 or no C++ compiler: bf16 takes the int4 kernel")
def test_bfloat16_auto_takes_the_block_kernels_without_timing(monkeypatch):
    """`--weights auto` in bfloat16 is stored wherever stored_bf16's kernels build: no timing of the
    int4 kernel (not the route bf16 rows take), which a core busy with another job flipped 1 run in 3,
    and with it the weights' arithmetic and a greedy run's text."""
    from triforce.model import gguf_loader

    monkeypatch.setattr(gguf_loader, "_int4_kernels_available", lambda: pytest.fail("timed the int4 route"))
    gguf_loader.stored_kernel_pays.cache_clear()
    try:
        assert gguf_loader.stored_kernel_pays(torch.bfloat16) is True
    finally:
        gguf_loader.stored_kernel_pays.cache_clear()


def test_a_gguf_is_hashed_once_per_version_of_the_file(tiny_gguf, tmp_path, monkeypatch):
    """The SHA-256 a prepared folder checks its GGUF against is remembered beside the GGUF with the
    file's size, times and inode: the next start reads it, and any write to the file (even one that
    keeps its size and puts its modification time back) hashes it again."""
    import hashlib
    import os
    import shutil

    from triforce.model import gguf_loader

    path = tmp_path / "model.gguf"
    shutil.copy(tiny_gguf[0], path)
    hashed = []
    original = gguf_loader._sha256_cached.__wrapped__
    monkeypatch.setattr(gguf_loader, "_sha256_cached", lambda *a: hashed.append(a) or original(*a))
    want = hashlib.sha256(path.read_bytes()).hexdigest()
    assert gguf_loader._sha256(path) == want and len(hashed) == 1
    assert json.loads((tmp_path / "model.gguf.sha256.json").read_text())["sha256"] == want
    assert gguf_loader._sha256(path) == want and len(hashed) == 1  # remembered: not hashed again
    data, st = bytearray(path.read_bytes()), path.stat()
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same modification time
    assert gguf_loader._sha256(path) == hashlib.sha256(bytes(data)).hexdigest() != want and len(hashed) == 2
    (tmp_path / "model.gguf.sha256.json").write_text("{not json")  # a damaged record is hashed past
    assert gguf_loader._sha256(path) == hashlib.sha256(bytes(data)).hexdigest() and len(hashed) == 3
    assert not list(tmp_path.glob("*.part"))
