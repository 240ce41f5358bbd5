"""Record a real prefill's timeline: each piece's seconds and, within it, each layer's seconds and
the part spent in attention. The timings the prefill clock (triforce/cli/progress.py) predicts from.

    python -m bench.prefill_timeline --book /work/shared/data/books/persuasion.txt --tokens 16384 \
        --out tests/cli/data/prefill_timeline_smollm2.json

Feeds the book's first --tokens tokens through `Generator.prefill` (the path generate and chat take)
with the layers watched as the progress bar watches them. One line per piece on stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from triforce.cli.common import DEFAULT_MODEL, read_text, run_cli


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--book", required=True, help="a text of at least --tokens tokens")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--piece", type=int, default=None, help="tokens per prefill forward (default: the CPU default)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--out", required=True, help="the JSON timeline is written here")
    args = p.parse_args(argv)
    if args.tokens < 1 or (args.piece is not None and args.piece < 1):
        p.error("--tokens and --piece must be >= 1")
    return args


class Recorder:
    """An `advance` for Generator.prefill and watch_layers that keeps the timings instead of drawing."""

    def __init__(self, total: int):
        self.total, self.pieces, self.layers = total, [], []
        self.done, self.since = 0, time.perf_counter()

    def layer(self, tokens, layer, layers, seconds, attention_seconds):
        self.layers.append([round(seconds, 5), round(attention_seconds, 5)])

    def __call__(self, n: int) -> None:
        now = time.perf_counter()
        self.pieces.append({"start": self.done, "end": self.done + n, "seconds": round(now - self.since, 4),
                            "layers": self.layers})
        print(f"prefill_timeline: {self.done + n:,}/{self.total:,} tokens, piece {now - self.since:.1f} s",
              file=sys.stderr, flush=True)
        self.done, self.since, self.layers = self.done + n, now, []


def main(argv=None) -> int:
    import torch

    from triforce.cli.progress import watch_layers
    from triforce.model.config import ModelConfig
    from triforce.model.loader import load_model, load_tokenizer
    from triforce.speculative import GenerationConfig, UserError
    from triforce.speculative.engine import Generator, Models

    args = parse(argv)
    ids = load_tokenizer(args.model)(read_text(args.book, "book"))["input_ids"][:args.tokens]
    if len(ids) < args.tokens:
        raise UserError(f"{args.book} has {len(ids):,} tokens, fewer than --tokens {args.tokens:,}")
    cfg = ModelConfig.from_folder(args.model)
    model = load_model(args.model, getattr(torch, args.dtype), "cpu", max_len=len(ids) + 1)
    piece = args.piece or GenerationConfig().prefill_piece("cpu")
    gen = Generator(Models(model, None), GenerationConfig(max_new_tokens=1, prefill_chunk=piece),
                    "autoregressive", max_len=len(ids) + 1)
    recorder = Recorder(len(ids))
    load_start = os.getloadavg()[0]  # other jobs on the machine change every timing: say how busy it was
    with watch_layers(model, recorder):
        gen.prefill(ids, progress=recorder)
    meta = {"model": Path(args.model).name, "dtype": args.dtype, "threads": torch.get_num_threads(),
            "layers": cfg.num_layers, "piece": piece, "tokens": len(ids), "torch": torch.__version__,
            "seconds": round(sum(p["seconds"] for p in recorder.pieces), 3), "book": Path(args.book).name,
            "load_average": [round(load_start, 2), round(os.getloadavg()[0], 2)]}
    Path(args.out).write_text(json.dumps({"meta": meta, "pieces": recorder.pieces}, separators=(",", ":")) + "\n")
    print(json.dumps(meta))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
