"""Sampling is reproducible across processes: generate.py --json --no-adaptive with the same --seed gives
the same tokens in two separate runs, and another seed gives other tokens. (With --adaptive, the
default, which passes run depends on timings: a seed then fixes the distribution, not the text.) (One process against two
tensor-parallel ranks, sampled, is tests/test_tp.py::test_sampled_tokens_match.)"""
from __future__ import annotations

import json

import pytest

from ..helpers import run

PROMPT = " ".join(f"t{i % 60 + 3}" for i in range(200))
NEW_TOKENS = 48  # a random tiny model spreads its probability: two seeds agreeing on 48 tokens is ~impossible
MODES = ["triforce", "autoregressive"]


@pytest.fixture(scope="module")
def sampled(tiny_folder):
    """(mode, seed, run) -> tokens; each run a fresh process, each computed once per module."""
    done = {}

    def tokens(mode: str, seed: int, run_index: int = 0) -> list[int]:
        key = (mode, seed, run_index)
        if key not in done:
            proc = run("generate", "--model", tiny_folder, "--draft", "self", "--prompt", PROMPT, "--mode", mode,
                       "--max-new-tokens", NEW_TOKENS, "--temperature", "0.8", "--top-p", "0.9", "--seed", seed,
                       "--no-adaptive", "--budget", "64", "--chunk-size", "8", "--json")
            assert proc.returncode == 0, proc.stderr
            done[key] = json.loads(proc.stdout)["tokens"]
            assert len(done[key]) == NEW_TOKENS
        return done[key]

    return tokens


@pytest.mark.parametrize("mode", MODES)
def test_same_seed_same_tokens(sampled, mode):
    assert sampled(mode, seed=11, run_index=0) == sampled(mode, seed=11, run_index=1)


@pytest.mark.parametrize("mode", MODES)
def test_other_seed_other_tokens(sampled, mode):
    assert sampled(mode, seed=11) != sampled(mode, seed=12)


def test_a_resume_counts_no_pass_as_decoding():
    """resume() refills the drafter's window and rebuilds the retrieval cache: prefill work, which the
    decode statistics and the adaptive chooser's timings leave out."""
    from bench.kernels import tiny_target
    from triforce.speculative import GenerationConfig, Generator, Models

    cfg = GenerationConfig(max_new_tokens=6, budget=64, chunk_size=8, gamma1=2, gamma2=3, draft_window=32,
                           sink_tokens=4)
    gen = Generator(Models(tiny_target(2), None), cfg, "triforce", 300)
    gen.prefill([3 + (i * 7) % 200 for i in range(200)])
    snap = gen.snapshot()
    gen.generate()
    gen.resume(snap.prompt, snap.queries, snap.first)
    assert gen.stats.phase == "decode" and sum(gen.stats.to_dict()["passes"].values()) == 0
    assert not any(lv.timings for lv in (gen.full, gen.middle, gen.drafter))
    gen.generate()
    assert gen.stats.to_dict()["passes"]["draft"] > 0
