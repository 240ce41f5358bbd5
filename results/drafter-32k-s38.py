"""Session 38's drafter check at 32K (run from the repository root):

    PYTHONPATH=. python results/drafter-32k-s38.py --vary rope   --model models/smollm2-135m --context 32768 --dtype bfloat16
    PYTHONPATH=. python results/drafter-32k-s38.py --vary window --model models/smollm2-135m --context 32768 --dtype bfloat16

One prefill of Moby Dick, then triforce (the GPU's budget 8,192, chunk 32, gamma1 4, gamma2 6) for
64 tokens at temperature 0.8, at 0.6 with top-p 0.9, and greedy, seeds 0 and 1, with the self-drafter
on the checkpoint's RoPE or the run's scaled one (--vary rope), or StreamingLLM windows of 256, 1,024
and 2,048 tokens (--vary window). Writes results/drafter-{rope,window}-32k-s38.json."""
import argparse
import json
import sys
from dataclasses import replace

from bench.measure import run_system
from triforce.cli.common import add_engine_args, add_model_args, generation_config, open_session, read_text, run_config
from triforce.speculative import Generator

p = argparse.ArgumentParser()
add_model_args(p)
add_engine_args(p)
p.add_argument("--vary", choices=("rope", "window"), required=True)
p.add_argument("--new-tokens", type=int, default=64)
args = p.parse_args(sys.argv[1:])
run = run_config(args, max_new_tokens=args.new_tokens, lower_weights="same")
session = open_session(run, read_text("../shared/data/books/mobydick.txt"))
prompt = session.prompt_ids
base = replace(generation_config(replace(session.run, mode="triforce"), len(prompt), session.say),
               budget=8192, chunk_size=32, gamma1=4, gamma2=6)
max_len = len(prompt) + args.new_tokens
seed = Generator(session.loaded.models, base, "autoregressive", max_len=max_len)
seed.prefill(prompt)
prefilled = seed.snapshot()
models = session.loaded.models
if args.vary == "rope":
    variants = [({"drafter_rope": "native"}, models, {}),
                ({"drafter_rope": "scaled"}, replace(models, self_draft_rotary=None), {})]
else:
    variants = [({"window": w}, models, {"draft_window": w}) for w in (256, 1024, 2048)]
rows = []
for temperature, top_p in ((0.8, 1.0), (0.6, 0.9), (0.0, 1.0)):
    for label, variant, changes in variants:
        for s in (0, 1):
            cfg = replace(base, temperature=temperature, top_p=top_p, seed=s, **changes)
            tokens, seconds, stats = run_system(session, "triforce", cfg, prefilled, max_len, variant)
            d = stats.to_dict()
            rows.append(dict(T=temperature, top_p=top_p, **label, seed=s, ms=round(1e3 * seconds / (len(tokens) - 1), 1),
                             acc=d["acceptance"], tpf=d["tokens_per_full_pass"]))
            print(rows[-1], flush=True)
json.dump(rows, open(f"results/drafter-{args.vary}-32k-s38.json", "w"), indent=1)
