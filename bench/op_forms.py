"""A layer's ops in the form the engine uses on a GPU beside the form before, side by side.

A captured pass on a GPU costs about its kernel count (SmolLM2's middle pass: 850 kernels, 1.9 ms on
an H200), so the engine picks, per op, the form with the fewest kernels that keeps every level's
numbers alike. Per shape this prints microseconds per call of each form, replayed from a CUDA graph
of --repeats calls (what a captured pass pays), the largest difference between them, and for
attention which fused kernels take each form:

- attention, decode/verify (T queries against S slots under the static views' additive mask):
  `grouped flag` (SDPA's enable_gqa with the mask, the form before) against `shared heads` (each KV
  head's query heads reading it through a zero-stride view, model/attention.attend_shared_heads):
  grouped heads with a mask can send SDPA to its math backend, which writes the keys out per
  query head and the scores in float32; beside them `split us`, the keys in pieces of 512 merged by
  their log-sum-exps (model/split_keys.py, what the engine runs for a verification pass over 4,096
  keys or more on CUDA since session 35; since session 36 a layer after a pass's first, which reuses
  the first's bias: the first layer pays two kernels more); and `folded us`, each (head, query) a
  one-query head of its own for cuDNN's one-query kernel (model/folded_heads.py, session 40; the
  engine times it against the split keys per shape and keeps the faster);
- attention, a later prefill piece (T queries, the last T of S keys, causal): a boolean (T, S) mask
  with the flag against shared heads under torch's lower-right causal bias, no mask;
- RMSNorm (T rows, 16-bit): float32 statistics then the model dtype then the weight (4 kernels,
  transformers' two roundings, the form before) against one F.rms_norm call (one fused kernel on
  CUDA, one rounding; model/transformer.ONE_CALL_NORM_ON_CUDA).

    python -m bench.op_forms [--heads 9,3 --head-dim 64 --hidden 576 --out results/op-forms.json]
    python -m bench.op_forms --device cpu      # the same code at small sizes (figures mean nothing)
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from triforce.cli.common import run_cli
from triforce.model.attention import aligned_mask, attend_grouped_flag, fused_kernels_taking, shared_heads_sdpa
from triforce.model.errors import UserError
from triforce.model.folded_heads import cudnn_takes, folded_heads_attention
from triforce.model.split_keys import split_keys_attention

# (2, 8192): the middle level's check of one draft against the retrieval cache at 32K (triforce's gamma1 1)
DECODE = [(1, 4096), (7, 4096), (2, 8192), (1, 32768), (7, 32768)]
PREFILL = [(2048, 32768)]
NORM_ROWS = [1, 7]
SMALL_DECODE, SMALL_PREFILL = [(1, 256), (2, 256), (7, 256)], [(64, 256)]


def seconds_per_call(fn, repeats: int, device: torch.device) -> float:
    """On CUDA: one graph of `repeats` calls, replayed between events after a warm-up; on CPU the calls."""
    for _ in range(3):
        fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize(device)
    return begin.elapsed_time(end) / 1e3 / (5 * repeats)


def side_by_side(row: dict, before, ours, repeats: int, device) -> dict:
    """Both forms' outputs compared, then each timed; a form a kernel refuses is recorded, not fatal."""
    try:
        a, b = before(), ours()
    except RuntimeError as e:
        row["ours_refused"] = str(e).splitlines()[0]
        return row
    row["max_difference"] = (a.float() - b.float()).abs().max().item()
    row["us_before"] = 1e6 * seconds_per_call(before, repeats, device)
    row["us_ours"] = 1e6 * seconds_per_call(ours, repeats, device)
    row["speedup"] = row["us_before"] / row["us_ours"]
    return row


def attention_row(kind: str, T: int, S: int, heads: tuple[int, int], D: int, dtype, device, repeats: int) -> dict:
    Hq, Hkv = heads
    g = torch.Generator().manual_seed(T + S)
    q = torch.randn(T, Hq, D, generator=g).to(device, dtype)
    # the offloaded store's token-major layer, seen as (Hkv, S, D), as the views pass it
    keys, values = (torch.randn(S, Hkv, D, generator=g).to(device, dtype).transpose(0, 1) for _ in "kv")
    visible = torch.ones(T, S, dtype=torch.bool, device=device).tril(S - T)
    if kind == "decode":
        mask = aligned_mask(T, S, dtype, device).masked_fill_(~visible, float("-inf"))
        mask_before, mask_ours = mask, mask
    else:
        mask_before, mask_ours = visible, causal_lower_right(T, S)
    row = {"op": f"attention {kind}", "T": T, "S": S, "heads": list(heads), "head_dim": D,
           "kernels_before": fused_kernels_taking(q, keys, values, mask_before, grouped=True),  # none on CPU
           "kernels_ours": fused_kernels_taking(q, keys, values, mask_ours, grouped=False)}
    # the form itself, not attention.attend_shared_heads, which would fall back were it refused
    row = side_by_side(row, lambda: attend_grouped_flag(q, keys, values, mask_before),
                       lambda: shared_heads_sdpa(q, keys, values, mask_ours), repeats, device)
    if kind == "decode" and "ours_refused" not in row:  # the keys in pieces (model/split_keys.py) beside both
        before = lambda: attend_grouped_flag(q, keys, values, mask)  # noqa: E731
        row.update(form_row("split", before, lambda: split_keys_attention(q, keys, values, mask), repeats, device))
        if T > 1:  # the few queries as one-query heads (model/folded_heads.py), where cuDNN takes them
            row["folded_cudnn"] = cudnn_takes(q, keys, values, mask)
            row.update(form_row("folded", before, lambda: folded_heads_attention(q, keys, values, mask),
                                repeats, device))
    return row


def form_row(name: str, before, form, repeats: int, device) -> dict:
    """A form's time and its largest difference from the form before (or why it failed)."""
    try:
        difference = (before().float() - form().float()).abs().max().item()
    except RuntimeError as e:
        return {f"{name}_refused": str(e).splitlines()[0]}
    return {f"us_{name}": 1e6 * seconds_per_call(form, repeats, device), f"max_difference_{name}": difference}


def norm_row(T: int, hidden: int, dtype, device, repeats: int) -> dict:
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, hidden, generator=g).to(device, dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(device, dtype)
    shape = weight.shape
    return side_by_side({"op": "rmsnorm", "T": T, "hidden": hidden},
                        lambda: weight * F.rms_norm(x.float(), shape, eps=1e-5).to(dtype),
                        lambda: F.rms_norm(x, shape, weight, 1e-5), repeats, device)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", default="9,3", help="query heads,KV heads (SmolLM2: 9,3; Llama-3-8B: 32,8)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--hidden", type=int, default=576, help="the norm's width (SmolLM2: 576; Llama-3-8B: 4096)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--repeats", type=int, default=50, help="calls per timing (in one CUDA graph on a GPU)")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run at small sizes")
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("bench.op_forms measures CUDA kernels and no GPU is visible here; "
                        "--device cpu runs the same code at small sizes (its figures mean nothing)")
    heads = tuple(int(h) for h in args.heads.split(","))
    if len(heads) != 2 or heads[0] % heads[1]:
        raise UserError(f"--heads wants query heads,KV heads with the first a multiple of the second (got {args.heads})")
    small, dtype = device.type != "cuda", getattr(torch, args.dtype)
    repeats = max(3, args.repeats // 10) if small else args.repeats
    rows = [attention_row(kind, T, S, heads, args.head_dim, dtype, device, repeats)
            for kind, shapes in (("decode", SMALL_DECODE if small else DECODE), ("prefill", SMALL_PREFILL if small else PREFILL))
            for T, S in shapes]
    rows += [norm_row(T, args.hidden, dtype, device, repeats) for T in NORM_ROWS]
    print(f"{'op':18} {'T':>5} {'S':>6}  {'before us':>10}  {'ours us':>8}  {'speedup':>7}  {'split us':>8}  "
          f"{'folded us':>9}  fused kernels (before / ours)")
    for row in rows:
        where = f"{row['op']:18} {row['T']:>5} {row.get('S', '-'):>6}"
        if "ours_refused" in row:
            print(f"{where}  refused: {row['ours_refused']}")
            continue
        takes = lambda d: ",".join(k for k, v in d.items() if v) or "math"  # noqa: E731
        fused = f"{takes(row['kernels_before'])} / {takes(row['kernels_ours'])}" if "kernels_ours" in row and not small else "-"
        split, folded = (f"{row[f'us_{n}']:>{w}.1f}" if f"us_{n}" in row else
                         f"{'-' if f'{n}_refused' not in row else 'failed':>{w}}" for n, w in (("split", 8), ("folded", 9)))
        print(f"{where}  {row['us_before']:>10.1f}  {row['us_ours']:>8.1f}  {row['speedup']:>6.2f}x  {split}  {folded}  {fused}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                       "torch": torch.__version__, "dtype": args.dtype, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
