"""How far each way of loading a GGUF-made model is from the GGUF's own weights, in logits.

    python -m bench.stored_accuracy [--model models/smollm2-135m] [--tokens 96]

The reference is float64 with the blocks dequantized exactly (load_model(gguf, float64,
weights="dequantized")). Every row of the stored runs goes through the packed kernel.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

import triforce.model.stored as stored
from triforce.model.gguf_loader import gguf_origin
from triforce.model.loader import load_model, load_tokenizer
from triforce.speculative.caches import FullCache

SETUPS = [("folder float32 (its bf16 weights)", torch.float32, "dequantized"),
          ("stored float32", torch.float32, "stored"),
          ("folder bfloat16", torch.bfloat16, "dequantized"),
          ("stored bfloat16", torch.bfloat16, "stored")]


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, FullCache(model.kv_shape(), len(ids) + 8)).double()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/smollm2-135m")
    p.add_argument("--tokens", type=int, default=96)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    origin = gguf_origin(args.model)
    if origin is None:
        p.error(f"{args.model} records no GGUF origin")
    text = (Path(__file__).resolve().parents[1] / "triforce" / "data" / "persuasion.txt").read_text()[:8000]
    ids = torch.tensor(load_tokenizer(args.model).encode(text)[:args.tokens])
    ref = logits(load_model(origin, torch.float64, weights="dequantized"), ids)
    print(f"reference: float64 from the GGUF blocks ({origin.name}), {len(ids)} tokens, max |logit| "
          f"{ref.abs().max().item():.2f}")
    stored.PACKED_KERNEL_MAX_ROWS = 1 << 20  # every row through the kernel, not the dense fallback
    for name, dtype, weights in SETUPS:
        got = logits(load_model(args.model, dtype, weights=weights), ids)
        agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"{name:34s} max|diff| {(got - ref).abs().max().item():.2e}  "
              f"mean|diff| {(got - ref).abs().mean().item():.2e}  argmax agrees {agree:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
