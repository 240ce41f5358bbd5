"""Ways to compute a float32 one-row product over stored 4-bit weights, timed against dense float32.

    python -m bench.f32_routes [--rounds 5] [--out results/f32_routes.json]
    ATEN_CPU_CAPABILITY=avx2 python -m bench.f32_routes ...   # torch's kernels as on an avx2-only CPU
    python -m bench.f32_routes --model models/smollm2-135m --tokens 32   # and the logits of `split3`

One thread, one row (a decode step), random Q4_1-like blocks (f16 scales). Routes:

    dense_f32      F.linear on the dequantized float32 weights (what `auto` loads on avx2 CPUs)
    int4_f32       torch's _weight_int4pack_mm_for_cpu with float32 activations (a scalar reference)
    int4_bf16      the same kernel with bfloat16 activations (its fast path; lossy, for scale)
    split3         x = hi + mid + lo in bfloat16, stacked as 3 rows into one bf16 int4 call (weights
                   read once), summed in float32
    int8_f32/bf16  _weight_int8pack_mm (one scale per row: cannot hold per-block scales; speed only)
    compiled       triforce.model.stored_f32: inductor's fused dequantize-and-dot over the codes
    compiled_q8    the same over Q8_0 blocks (bytes q + 128 and d per 32) of the same shape
    avx2           triforce.model.stored_avx2: our avx2 kernel over the block records (the route
                   float32 takes where it builds)
    avx2_q8        the same over Q8_0 blocks of the same shape

Error: max |y - y64| / max |y64| against the float64 product with the same weights. ATEN_CPU_CAPABILITY
changes the ISA torch's own kernels and inductor's generated code use; oneDNN (the dense bf16 matmul)
still finds the hardware's avx512_bf16.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from triforce.model import stored_avx2, stored_f32

SHAPES = [(32768, 1024), (49152, 576), (3072, 576), (960, 576), (576, 1536)]  # SmolLM2: head, w13, wqkv, w2
SLOW = ("int4_f32", "int8_f32")  # tens of ms: fewer repeats


def split3(x: torch.Tensor) -> torch.Tensor:
    """(1, K) float32 -> (3, K) bfloat16 parts whose float32 sum is x (24 significant bits)."""
    hi = x.bfloat16()
    rest = x - hi.float()
    mid = rest.bfloat16()
    return torch.cat([hi, mid, (rest - mid.float()).bfloat16()])


def routes_for(n: int, k: int, g: torch.Generator) -> tuple[dict, torch.Tensor, dict]:
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scales = (torch.rand(n, k // 32, generator=g) * 0.01 + 0.001).half().float()
    zeros = (-8 * scales * (0.5 + torch.rand(n, k // 32, generator=g))).half().float()
    w = ((codes.float() - 8).view(n, -1, 32) * scales[..., None] + zeros[..., None]).view(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    sz32 = torch.stack([scales.t(), zeros.t()], -1).contiguous()
    szbf = sz32.bfloat16()
    pairs = codes.to(torch.uint8).view(n, -1, 2)
    nibbles = (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()
    q8, s8 = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8), scales[:, 0].contiguous()
    x = torch.randn(1, k, generator=g)
    xb = x.bfloat16()
    int4 = torch.ops.aten._weight_int4pack_mm_for_cpu
    routes = {
        "dense_f32": lambda: F.linear(x, w),
        "int4_f32": lambda: int4(x, packed, 32, sz32),
        "int4_bf16": lambda: int4(xb, packed, 32, szbf),
        "split3": lambda: int4(split3(x), packed, 32, szbf).float().sum(0, keepdim=True),
        "int8_f32": lambda: torch.ops.aten._weight_int8pack_mm(x, q8, s8),
        "int8_bf16": lambda: torch.ops.aten._weight_int8pack_mm(xb, q8, s8.bfloat16()),
    }
    if stored_f32.available():
        routes["compiled"] = lambda: stored_f32.rows_product(x, nibbles, scales, zeros)
        offset = (q8.to(torch.int16) + 128).to(torch.uint8)  # Q8_0 blocks of this shape, as ByteCodesLinear
        routes["compiled_q8"] = lambda: stored_f32.byte_rows_product(x, offset, scales)
    if stored_avx2.available():
        # w = d * q + (zero - 8 d): float32 scales in the records, as Q4_K's (not f16 values here)
        records = stored_avx2.q4_records(codes, scales, zeros - 8 * scales, torch.float32)
        records8 = stored_avx2.q8_records(q8, scales)
        routes["avx2"] = lambda: stored_avx2.q4_product(x, records, n)
        routes["avx2_q8"] = lambda: stored_avx2.q8_product(x, records8, n)
    y64 = x.double() @ w.double().t()
    # split3's error without the scales' rounding: the same product with bf16-exact scales and zeros
    wb = ((codes.double() - 8).view(n, -1, 32) * szbf[..., 0].t().double()[..., None]
          + szbf[..., 1].t().double()[..., None]).view(n, k)
    extra = {"split3_output_rounding_only": (int4(split3(x), packed, 32, szbf).double().sum(0, keepdim=True)
                                            - x.double() @ wb.t()).abs().max().item() / y64.abs().max().item(),
             "bf16_scales_alone": (x.double() @ wb.t() - y64).abs().max().item() / y64.abs().max().item()}
    return routes, y64, extra


def timed(fn, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def measure(rounds: int) -> list[dict]:
    rows = []
    for n, k in SHAPES:
        routes, y64, extra = routes_for(n, k, torch.Generator().manual_seed(n + k))
        for fn in routes.values():  # warm-up (and inductor's compile)
            fn()
        best = {name: float("inf") for name in routes}
        for _ in range(rounds):  # routes alternate within each round: load falls on all alike
            for name, fn in routes.items():
                best[name] = min(best[name], timed(fn, 1 if name in SLOW else 5))
        errors = {name: (routes[name]().double() - y64).abs().max().item() / y64.abs().max().item()
                  for name in ("dense_f32", "split3", "compiled", "avx2") if name in routes}
        rows.append({"shape": [n, k], "ms": {name: round(v, 4) for name, v in best.items()},
                     "vs_dense_f32": {name: round(best["dense_f32"] / v, 2) for name, v in best.items()},
                     "rel_error": {name: float(f"{v:.2e}") for name, v in {**errors, **extra}.items()}})
        print(f"{n}x{k}: " + "  ".join(f"{name} {v:.3f}" for name, v in best.items()) + " ms")
        print("    error/max|y|: " + "  ".join(f"{name} {v:.1e}" for name, v in rows[-1]["rel_error"].items()))
    return rows


def model_logits(model_dir: str, tokens: int) -> dict:
    """Logits of one-token passes (every matrix through the route) against the float64 GGUF model:
    float32 through the compiled product, and float32 through split3 (bf16 scales, bf16 outputs)."""
    import triforce.model.stored as stored
    from triforce.model.gguf_loader import gguf_origin
    from triforce.model.loader import load_model, load_tokenizer
    from triforce.speculative.caches import FullCache

    text = (Path(__file__).resolve().parents[1] / "triforce" / "data" / "persuasion.txt").read_text()[:4000]
    ids = torch.tensor(load_tokenizer(model_dir).encode(text)[:tokens])
    ref_model = load_model(gguf_origin(model_dir), torch.float64, weights="dequantized")
    ref = ref_model(ids, FullCache(ref_model.kv_shape(), tokens + 8))

    def stepwise(model):
        cache = FullCache(model.kv_shape(), tokens + 8)
        return torch.cat([model(ids[i:i + 1], cache).double() for i in range(len(ids))])

    out = {}
    out["compiled"] = stepwise(load_model(model_dir, torch.float32, weights="stored"))
    real_available = stored_f32.available
    stored_f32.available = lambda: False  # build the int4 kernel's buffers in float32, then run split3
    try:
        model = load_model(model_dir, torch.float32, weights="stored")
    finally:
        stored_f32.available = real_available
    for layer in model.modules():
        if isinstance(layer, stored.PackedLinear):
            layer.scales_and_zeros = layer.scales_and_zeros.bfloat16()
            layer.forward = _split3_forward(layer)
    out["split3"] = stepwise(model)
    result = {}
    for name, got in out.items():
        diff = (got - ref).abs()
        result[name] = {"max_abs_diff": float(f"{diff.max().item():.3e}"), "mean_abs_diff": float(f"{diff.mean().item():.3e}"),
                        "argmax_agrees": round((got.argmax(-1) == ref.argmax(-1)).float().mean().item(), 3)}
        print(f"{name:9s} one-token passes against float64: max|diff| {result[name]['max_abs_diff']:.2e}  "
              f"mean|diff| {result[name]['mean_abs_diff']:.2e}  argmax agrees {result[name]['argmax_agrees']:.3f}")
    result["max_abs_logit"] = round(ref.abs().max().item(), 2)
    return result


def _split3_forward(layer):
    def forward(x):
        rows = torch.cat([x.reshape(-1, x.shape[-1])] * layer.repeat, dim=-1)
        outs = [torch.ops.aten._weight_int4pack_mm_for_cpu(split3(r[None]), layer.packed, 32, layer.scales_and_zeros)
                .float().sum(0) for r in rows]
        out = torch.stack(outs)[:, :layer.out_features]
        out = out if layer.bias is None else out + layer.bias
        return out.reshape(*x.shape[:-1], layer.out_features)
    return forward


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--model", default=None, help="also the logits of split3 and compiled on this model")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, 1 thread")
    result = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
              "shapes": measure(args.rounds)}
    if args.model:
        result["logits"] = model_logits(args.model, args.tokens)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
