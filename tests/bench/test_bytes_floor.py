"""bench.bytes_floor's pieces that need no real model: the bytes model per setup and the table."""
from __future__ import annotations

import torch

from bench import bytes_floor
from triforce.model.gguf_loader import weights_summary
from triforce.model.kv_dtype import use_kv_dtype
from triforce.model.loader import load_model
from triforce.speculative import GenerationConfig


def test_traffic_counts_this_setups_weights_and_kv(tiny_folder):
    model = load_model(tiny_folder, torch.float32)
    summary = weights_summary(model)
    cfg = GenerationConfig(budget=256, chunk_size=32, draft_window=64, sink_tokens=4)
    wide = bytes_floor.traffic_for(model, summary, 1000, 32, cfg)
    narrow = bytes_floor.traffic_for(use_kv_dtype(model, torch.float16), summary, 1000, 32, cfg)
    kv_token = 2 * model.cfg.num_layers * model.cfg.num_kv_heads * model.cfg.head_dim
    assert wide.full == summary["bytes_per_pass"] + 4 * kv_token * 1016
    assert narrow.full == summary["bytes_per_pass"] + 2 * kv_token * 1016
    assert wide.middle == summary["bytes_per_pass"] + 4 * kv_token * 256
    assert wide.draft == summary["bytes_per_pass"] + 4 * kv_token * 68


def test_table_fits_80_columns():
    row = {"context": 16384, "setup": "bf16-stored", "mode": "autoregressive", "bytes_per_token": 1.296e9,
           "floor_ms_per_token": 123.4, "ms_per_token": 1234.5, "x_floor": 10.01, "tokens_per_second": 0.8,
           "same_as_autoregressive": True}
    text = bytes_floor.table([row, dict(row, same_as_autoregressive=False)], 16.6e9)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "16.6 GB/s" in text and text.splitlines()[-1].endswith("NO")


def test_bandwidth_is_measured():
    assert 1e8 < bytes_floor.memory_read_bandwidth(nbytes=16 * 2**20, repeats=2) < 1e13
