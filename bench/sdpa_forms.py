"""The attention forms on a GPU, side by side: what SDPA chooses and what each call costs.

Grouped heads (more query heads than KV heads) with a mask can send torch's SDPA to its math
backend, which writes the keys out per query head and the scores in float32. The static views
(decode and verification passes in CUDA graphs) and later prefill pieces therefore call it with each
KV head's query heads reading it through a zero-stride view (model/attention.attend_shared_heads).
This prints, per shape, which fused kernels could take each form and the microseconds per call of:

- decode/verify (T queries against S slots under the views' additive mask):
  `grouped flag` (enable_gqa=True with the mask, the form before) and `shared heads` (ours);
- a later prefill piece (T queries, the last T of S keys, causal):
  `grouped flag` (a boolean (T, S) mask, the form before) and `shared heads` (torch's lower-right
  causal bias, no mask).

    python -m bench.sdpa_forms [--heads 9,3 --head-dim 64 --out results/sdpa-forms.json]
    python -m bench.sdpa_forms --device cpu      # the same code at small sizes (figures mean nothing)

Each timing is the mean of --repeats calls between CUDA events, after a warm-up, one shape at a time.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from torch.nn.attention.bias import causal_lower_right

from triforce.cli.common import run_cli
from triforce.model.attention import shared_heads_sdpa, aligned_mask, attend_grouped_flag
from triforce.model.errors import UserError

DECODE = [(1, 4096), (7, 4096), (1, 32768), (7, 32768)]
PREFILL = [(2048, 32768)]
SMALL_DECODE, SMALL_PREFILL = [(1, 256), (7, 256)], [(64, 256)]


def kernels_that_take(q, keys, values, mask, grouped: bool) -> dict[str, bool]:
    """Which fused SDPA kernels accept the call as the form makes it (on CPU: none of these CUDA kernels)."""
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


def seconds_per_call(fn, repeats: int, device: torch.device) -> float:
    for _ in range(3):
        fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    begin.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize(device)
    return begin.elapsed_time(end) / 1e3 / repeats


def measure(kind: str, T: int, S: int, heads: tuple[int, int], D: int, dtype, device, repeats: int) -> dict:
    Hq, Hkv = heads
    g = torch.Generator().manual_seed(T + S)
    q = torch.randn(T, Hq, D, generator=g).to(device, dtype)
    # the offloaded store's token-major layer, seen as (Hkv, S, D), as the views pass it
    keys, values = (torch.randn(S, Hkv, D, generator=g).to(device, dtype).transpose(0, 1) for _ in "kv")
    visible = torch.ones(T, S, dtype=torch.bool, device=device).tril(S - T)
    if kind == "decode":
        mask = aligned_mask(T, S, dtype, device).masked_fill_(~visible, float("-inf"))
        before, ours = mask, mask
    else:
        before, ours = visible, causal_lower_right(T, S)
    row = {"kind": kind, "T": T, "S": S, "heads": list(heads), "head_dim": D, "dtype": str(dtype).split(".")[-1]}
    row["kernels_grouped_flag"] = kernels_that_take(q, keys, values, before, grouped=True)  # none on CPU
    row["kernels_shared_heads"] = kernels_that_take(q, keys, values, ours, grouped=False)
    row["us_grouped_flag"] = 1e6 * seconds_per_call(lambda: attend_grouped_flag(q, keys, values, before), repeats, device)
    try:  # the form itself, not attention.attend_shared_heads, which would fall back if refused
        a, b = attend_grouped_flag(q, keys, values, before), shared_heads_sdpa(q, keys, values, ours)
    except RuntimeError as e:
        row["shared_heads_refused"] = str(e).splitlines()[0]
        return row
    row["max_difference"] = (a.float() - b.float()).abs().max().item()
    row["us_shared_heads"] = 1e6 * seconds_per_call(lambda: shared_heads_sdpa(q, keys, values, ours), repeats, device)
    row["speedup"] = row["us_grouped_flag"] / row["us_shared_heads"]
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", default="9,3", help="query heads,KV heads (SmolLM2: 9,3; Llama-3-8B: 32,8)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run at small sizes")
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("bench.sdpa_forms measures CUDA kernels and no GPU is visible here; "
                        "--device cpu runs the same code at small sizes (its figures mean nothing)")
    heads = tuple(int(h) for h in args.heads.split(","))
    if len(heads) != 2 or heads[0] % heads[1]:
        raise UserError(f"--heads wants query heads,KV heads with the first a multiple of the second (got {args.heads})")
    small = device.type != "cuda"
    shapes = [("decode", *s) for s in (SMALL_DECODE if small else DECODE)] + \
             [("prefill", *s) for s in (SMALL_PREFILL if small else PREFILL)]
    rows = []
    print(f"{'form':8} {'T':>5} {'S':>6}  {'grouped flag us':>15}  {'shared heads us':>15}  {'speedup':>7}  fused kernels (flag / shared)")
    for kind, T, S in shapes:
        row = measure(kind, T, S, heads, args.head_dim, getattr(torch, args.dtype), device,
                      max(3, args.repeats // 10) if small else args.repeats)
        rows.append(row)
        takes = lambda d: ",".join(k for k, v in (d or {}).items() if v) or "math"  # noqa: E731
        fused = f"{takes(row.get('kernels_grouped_flag'))} / {takes(row.get('kernels_shared_heads'))}" if not small else "-"
        if "shared_heads_refused" in row:
            print(f"{kind:8} {T:>5} {S:>6}  {row['us_grouped_flag']:>15.1f}  refused: {row['shared_heads_refused']}",
                  flush=True)
            continue
        print(f"{kind:8} {T:>5} {S:>6}  {row['us_grouped_flag']:>15.1f}  {row['us_shared_heads']:>15.1f}  "
              f"{row['speedup']:>6.2f}x  {fused}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                       "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
