"""Session 39's check of triforce's drafts a round at 32K (run from the repository root):

    PYTHONPATH=. python results/gamma1-32k-s39.py --model models/smollm2-135m --context 32768 --dtype bfloat16

One prefill of Moby Dick, then triforce with the GPU's rounds (on the device, R rounds a full pass),
budget 8,192, chunk 32, gamma2 6 and 16, at gamma1 1 and 4, for 64 tokens: temperature 0.8 with
seeds 0-2, and greedy. What a run counts - the drafter's acceptance, rounds and tokens a full pass -
hangs on the models, not the device, so the H200's time a token is projected from these counts and
session 36's measured pass costs there (results/gamma1-projection-s39.py: a drafter pass 1.5 ms, a
round's middle part 3.9, a full pass at 32K 14.2; plain decoding 14.9 ms a token). Writes
results/gamma1-32k-s39.json."""
import argparse
import json
import sys
from dataclasses import replace

from bench.measure import run_system
from triforce.cli.common import add_engine_args, add_model_args, generation_config, open_session, read_text, run_config
from triforce.speculative import Generator

DRAFTER_MS, MIDDLE_MS, VERIFY_MS, PLAIN_MS = 1.50, 3.90, 14.2, 1000 / 67.0  # H200, sessions 36-37

p = argparse.ArgumentParser()
add_model_args(p)
add_engine_args(p)
p.add_argument("--new-tokens", type=int, default=64)
args = p.parse_args(sys.argv[1:])
run = run_config(args, max_new_tokens=args.new_tokens, lower_weights="same")
session = open_session(run, read_text("../shared/data/books/mobydick.txt"))
prompt = session.prompt_ids
base = replace(generation_config(replace(session.run, mode="triforce"), len(prompt), session.say),
               budget=8192, chunk_size=32, gamma2=16, device_rounds=True)
max_len = len(prompt) + args.new_tokens
seed = Generator(session.loaded.models, replace(base, gamma1=4), "autoregressive", max_len=max_len)
seed.prefill(prompt)
prefilled = seed.snapshot()
rows = []
for gamma2 in (6, 16):
    for temperature, seeds in ((0.8, (0, 1, 2)), (0.0, (0,))):
        for s in seeds:
            for gamma1 in (1, 4):
                cfg = replace(base, temperature=temperature, seed=s, gamma1=gamma1, gamma2=gamma2)
                tokens, seconds, stats = run_system(session, "triforce", cfg, prefilled, max_len)
                d = stats.to_dict()
                rounds = d["passes"]["middle"] / d["full_passes"]  # one middle pass a round
                ms = rounds * (gamma1 * DRAFTER_MS + MIDDLE_MS) + VERIFY_MS  # projected H200 ms a full pass
                rows.append(dict(gamma2=gamma2, T=temperature, seed=s, gamma1=gamma1,
                                 draft_middle=round(d["acceptance"].get("draft->middle", 0.0), 3),
                                 middle_verify=round(d["acceptance"].get("middle->verify", 0.0), 3),
                                 rounds_per_full_pass=round(rounds, 2), tokens_per_full_pass=round(d["tokens_per_full_pass"], 2),
                                 h200_projected_x_plain=round(PLAIN_MS * d["tokens_per_full_pass"] / ms, 2),
                                 tokens_head=tokens[:8]))
                print(rows[-1], flush=True)
json.dump(rows, open("results/gamma1-32k-s39.json", "w"), indent=1)
