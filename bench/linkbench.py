"""Measure the link on a GPU: pinned host->device bandwidth, and how much of a full-cache pass's
copy time the double buffer hides behind compute, on a model with random weights.

    python -m bench.linkbench                      # Llama2-7B shape, 160K tokens of KV (bf16)
    python -m bench.linkbench --context 65536 --tokens 1 7 --onchip 4

Prints one JSON line per setting. No checkpoint needed: KV is random and written straight into
the host store, so a pass costs what it would at that context.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from triforce.model.config import ModelConfig
from triforce.speculative.engine import synchronize
from triforce.model.transformer import Transformer

from triforce.cli.common import run_cli
from triforce.model.errors import UserError
from triforce.offload.store import OffloadedCache

LLAMA2_7B = ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                        num_kv_heads=32, head_dim=128, max_position_embeddings=131072)


def raw_h2d(nbytes: int, device: torch.device, repeats: int = 5) -> float:
    """GB/s of one large pinned->device copy: what the hardware gives torch."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    return nbytes * repeats / (time.perf_counter() - start) / 1e9


def random_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> Transformer:
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype: Llama-2-7B built in float32 first takes 27 GB
    try:
        with torch.device(device):
            model = Transformer(cfg).to(dtype)
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    return model.eval().requires_grad_(False)


def fill_random(buffer: torch.Tensor, context: int, tile_tokens: int = 4096) -> None:
    """Stand-in KV for `context` tokens (only [:length] is ever read). A random tile copied along the
    sequence: the values do not change a pass's cost, and normal_ over tens of GiB of pinned memory
    takes minutes."""
    tile = torch.randn(buffer.shape[0], min(tile_tokens, context), *buffer.shape[2:]).to(buffer)
    for start in range(0, context, tile.shape[1]):
        n = min(tile.shape[1], context - start)
        buffer[:, start:start + n].copy_(tile[:, :n])


def pass_figures(model, context: int, T: int, onchip: int, chunk_tokens: int, repeats: int = 3) -> dict:
    shape = model.kv_shape()
    cache = OffloadedCache(shape, context + T, onchip_layers=onchip, chunk_tokens=chunk_tokens)
    for buffer in (cache.store.k, cache.store.v, cache.resident_k, cache.resident_v):
        fill_random(buffer, context)
    cache.length = context
    ids = torch.zeros(T, dtype=torch.long, device=shape.device)
    model(ids, cache)  # warm-up
    cache.rollback(context)
    before = cache.timings()
    synchronize(shape.device)
    start = time.perf_counter()
    for _ in range(repeats):
        model(ids, cache)
        cache.rollback(context)
    synchronize(shape.device)
    seconds = (time.perf_counter() - start) / repeats
    after = cache.timings()
    h2d, d2h, copy, wait = (after[k] - before[k] for k in ("h2d_bytes", "d2h_bytes", "copy_seconds", "wait_seconds"))
    return {"context": context, "tokens": T, "onchip_layers": onchip, "pass_ms": seconds * 1e3,
            "h2d_GB_per_pass": h2d / repeats / 1e9, "stream_GBps": (h2d + d2h) / copy / 1e9 if copy else None,
            "copy_ms": copy / repeats * 1e3, "wait_ms": wait / repeats * 1e3,
            "hidden_fraction": 1 - wait / copy if copy else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=160 * 1024)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 7, 16])
    p.add_argument("--onchip", type=int, nargs="+", default=[0])
    p.add_argument("--chunk-tokens", type=int, default=16384)
    p.add_argument("--layers", type=int, default=LLAMA2_7B.num_layers)
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run of the same code")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        # it measures a host-to-GPU link: without a GPU there is nothing to measure
        raise UserError("bench.linkbench needs a CUDA GPU and none is visible here; "
                        "--device cpu runs the same code as a smoke test (its figures mean nothing)")
    if device.type == "cuda":
        print(json.dumps({"raw_h2d_GBps": raw_h2d(2**30, device), "device": torch.cuda.get_device_name(device)}))
    cfg = ModelConfig(**{**LLAMA2_7B.__dict__, "num_layers": args.layers})
    model = random_model(cfg, device, getattr(torch, args.dtype))
    for onchip in args.onchip:
        for T in args.tokens:
            print(json.dumps(pass_figures(model, args.context, T, onchip, args.chunk_tokens)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
