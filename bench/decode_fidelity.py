"""bfloat16 decoding on a model's stored blocks against float32, at a context of real text: how far
each decode step's logits are from float32's (bf16 attention through `decode_attention.attend`, and
through torch's bmm with its scores rounded to bf16 before the softmax), and whether a verification
pass of T tokens gives each token its decode step's logits bit for bit (what makes greedy speculation
give plain decoding's tokens with no tie allowance). Then attention alone: each layer's attention
output in the last decode step, both ways, against float64 on the same bf16 queries, keys and values.

    python -m bench.decode_fidelity [--model models/smollm2-135m --context 4000 --steps 10 --threads 2]

Each setup prefills the same --context tokens of the default book, then decodes --steps tokens of the
book one pass each (teacher-forced), then the same tokens again as one pass.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from contextlib import contextmanager

import torch

from triforce.model import attention, decode_attention
from triforce.model.loader import load_model, load_tokenizer
from triforce.runtime.defaults import DEFAULT_PROMPT_FILE
from triforce.speculative.caches import FullCache

SETUPS = [("float32 (reference)", torch.float32, True),
          ("bfloat16, attend", torch.bfloat16, True),
          ("bfloat16, bmm attention", torch.bfloat16, False)]


@contextmanager
def bf16_kernels(on: bool):
    """decode_attention serving bf16 attention, or not (torch's bmm path then)."""
    serves = decode_attention.serves
    if not on:
        decode_attention.serves = lambda rows, cache: False
    try:
        yield
    finally:
        decode_attention.serves = serves


def decode(folder: str, dtype: torch.dtype, ids: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits of each step alone, logits of the steps as one pass), float64."""
    model = load_model(folder, dtype, "cpu", max_len=len(ids) + 8, weights="stored")
    cache = FullCache(model.kv_shape(), len(ids) + 8)
    with torch.inference_mode():
        model(ids[:context], cache)
        alone = torch.cat([model(ids[t:t + 1], cache) for t in range(context, len(ids))])
        cache.rollback(context)
        together = model(ids[context:], cache)
    return alone.double(), together.double()


def attention_errors(folder: str, ids: torch.Tensor, context: int) -> list[tuple[float, float]]:
    """Per layer of the decode step after `context` tokens: the mean error of `attend` and of the bmm
    path against float64 attention of the same inputs, relative to softmax . |values|."""
    model = load_model(folder, torch.bfloat16, "cpu", max_len=context + 8, weights="stored")
    # plain keys (not the tiles a bf16 model's cache takes), so that the cache's rows are the keys
    cache = FullCache(dataclasses.replace(model.kv_shape(), tiled_keys=False), context + 8)
    seen, kernel = [], decode_attention.cache_attend
    def record(q, k, v, cache_k, cache_v, layer, start, scale, *layout):
        out = kernel(q, k, v, cache_k, cache_v, layer, start, scale, *layout)
        seen.append((q.clone(), cache_k[layer, :, :start + 1].clone(), cache_v[layer, :, :start + 1].clone(), out))
        return out
    with torch.inference_mode():
        model(ids[:context], cache)
        decode_attention.cache_attend = record
        try:
            model(ids[context:context + 1], cache)
        finally:
            decode_attention.cache_attend = kernel
    errors = []
    for q, keys, values, out in seen:
        rep, D = q.shape[1] // keys.shape[0], q.shape[2]
        probs = torch.softmax(q[0].double().view(keys.shape[0], rep, D) @ keys.double().transpose(1, 2) * D ** -0.5, -1)
        want, scale = (probs @ values.double()).flatten(), (probs @ values.double().abs()).flatten()
        with bf16_kernels(False):
            bmm = attention.attend(q, keys, values)[0]
        errors.append(tuple(((x.double() - want).abs() / scale).mean().item() for x in (out[0], bmm)))
    return errors


def book_ids(folder: str, n: int) -> torch.Tensor:
    ids = load_tokenizer(folder).encode(DEFAULT_PROMPT_FILE.read_text())[:n]
    if len(ids) < n:
        raise SystemExit(f"error: the default book has {len(ids):,} tokens; ask for fewer (--context, --steps)")
    return torch.tensor(ids)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.decode_fidelity", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/smollm2-135m")
    p.add_argument("--context", type=int, default=4000)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", help="JSON of the rows")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not decode_attention.available():
        print("error: no avx512_bf16 kernels here (bfloat16 is not this CPU's default): nothing to compare",
              file=sys.stderr)
        return 2
    ids = book_ids(args.model, args.context + args.steps)
    rows, reference = [], None
    for name, dtype, kernels in SETUPS:
        print(f"{name} ...", file=sys.stderr, flush=True)
        with bf16_kernels(kernels):
            alone, together = decode(args.model, dtype, ids, args.context)
        reference = alone if reference is None else reference
        diff = (alone - reference).abs()
        rows.append({"setup": name, "max_abs_diff": diff.max().item(), "mean_abs_diff": diff.mean().item(),
                     "argmax_agrees": (alone.argmax(-1) == reference.argmax(-1)).float().mean().item(),
                     "verify_rows_equal_steps": int((together == alone).all(-1).sum()), "steps": args.steps})
    print(f"{args.model}, {args.context:,} tokens of {DEFAULT_PROMPT_FILE.name}, {args.steps} decode steps, "
          f"{args.threads} thread(s); logits against float32's")
    print(f"{'setup':26} {'max|diff|':>9} {'mean|diff|':>10} {'argmax':>7} {'pass == steps':>14}")
    for r in rows:
        print(f"{r['setup']:26} {r['max_abs_diff']:9.3f} {r['mean_abs_diff']:10.4f} {r['argmax_agrees']:7.2f} "
              f"{r['verify_rows_equal_steps']:>7} of {r['steps']:<3}")
    print("attention alone ...", file=sys.stderr, flush=True)
    errors = attention_errors(args.model, ids, args.context)
    mean = [sum(e[i] for e in errors) / len(errors) for i in (0, 1)]
    print(f"attention of the decode step against float64, mean error relative to softmax . |values| over "
          f"{len(errors)} layers: attend {mean[0]:.2e}, bmm {mean[1]:.2e}; attend closer in "
          f"{sum(a < b for a, b in errors)} of {len(errors)} layers")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "context": args.context, "threads": args.threads, "rows": rows,
                       "attention_error_per_layer": {"attend": [e[0] for e in errors], "bmm": [e[1] for e in errors]}},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
