"""Real-model checks on SmolLM2-135M (needs `triforce-prepare`); run with -m slow."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "smollm2-135m"
BOOK = ROOT.parent / "shared" / "data" / "books" / "persuasion.txt"

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not MODEL.is_dir(), reason="models/smollm2-135m missing: run triforce-prepare"),
              pytest.mark.skipif(not BOOK.is_file(), reason="../shared/data/books/persuasion.txt not present")]


def generate_json(mode, context=4096, new=48, *extra):
    cmd = [sys.executable, "-m", "triforce", "generate", "--model", str(MODEL), "--draft", "self",
           "--prompt-file", str(BOOK), "--context", str(context), "--max-new-tokens", str(new), "--mode", mode,
           "--temperature", "0", "--dtype", "float32", "--json", "--no-adaptive", *map(str, extra)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_greedy_every_mode_matches_autoregressive_on_a_book():
    """At a 4K-token context of a real book, in float32, every engine gives the autoregressive tokens,
    and so does generate.py's default, adaptive over triforce's levels."""
    reference = generate_json("autoregressive")
    assert reference["prompt_tokens"] == 4096 and len(reference["tokens"]) == 48
    for mode in ("speculative", "retrieval", "triforce"):
        out = generate_json(mode)
        assert out["tokens"] == reference["tokens"], mode
        assert out["tokens_per_full_pass"] > 1.5, (mode, out["tokens_per_full_pass"])
    adaptive = generate_json("triforce", 4096, 48, "--adaptive")
    assert adaptive["tokens"] == reference["tokens"] and adaptive["adaptive"]
    assert sum(adaptive["modes"].values()) == adaptive["full_passes"]


def test_a_bf16_verification_pass_gives_each_token_its_decode_step_logits():
    """bfloat16 on the stored blocks (the default where the CPU has avx512_bf16): a pass of 7 tokens
    over a 3,000-token cache (greedy verification) gives each token the logits of a pass of it alone
    (plain decoding), bit for bit, so greedy speculation cannot resolve a near-tie otherwise than
    plain decoding does. With attention's scores of 1-3 rows summed in another order than more rows'
    (before session 17) every token's logits differed, by up to 0.44."""
    import torch

    from triforce.model import decode_attention, stored_bf16
    from triforce.model.loader import load_model
    from triforce.speculative.caches import FullCache

    if not (decode_attention.available() and stored_bf16.available()):
        pytest.skip("no avx512_bf16 kernels here: bfloat16 is not this CPU's default")
    model = load_model(MODEL, torch.bfloat16, "cpu", max_len=4096, weights="stored")
    ids = torch.randint(0, 49152, (3007,), generator=torch.Generator().manual_seed(0))
    cache = FullCache(model.kv_shape(), 3100)
    with torch.inference_mode():
        model(ids[:3000], cache)
        together = model(ids[3000:], cache)
        cache.rollback(3000)
        alone = torch.cat([model(ids[t:t + 1], cache) for t in range(3000, 3007)])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "smollm2-135m"])
def test_real_checkpoint_logits_match_transformers(name):
    """The converted checkpoints (Qwen2 with q/k/v biases, SmolLM2) give transformers' logits."""
    import torch
    from transformers import AutoModelForCausalLM

    from triforce.speculative.caches import FullCache
    from triforce.model.loader import load_model

    folder = ROOT / "models" / name
    if not folder.is_dir():
        pytest.skip(f"models/{name} missing: run triforce-prepare --all")
    tokens = torch.arange(100, 164)
    # the folder's own (bfloat16) weights, as transformers reads them: in float32 `auto` would compute
    # with the GGUF's exact blocks instead, which the folder holds rounded to bfloat16 (0.17 apart in
    # SmolLM2's logits); this test is about the architecture, so both sides get the same weights
    ours = load_model(folder, torch.float32, weights="dequantized")
    got = ours(tokens, FullCache(ours.kv_shape(), 64))
    del ours
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ref(tokens[None]).logits[0]
    assert (got - expected).abs().max().item() < 1e-3  # float32 over 24-30 layers of real weights


@pytest.mark.long
def test_2000_tokens_at_16k_stay_lossless():
    """SmolLM2 at a 16K-token context of a real book (YaRN x2.5), float32, 2,000 new tokens: triforce with
    the target as its own drafter gives exactly the autoregressive tokens, while the retrieval cache
    fills up and is rebuilt and the StreamingLLM window wraps over a thousand times. One prefill serves both
    runs; about 35 minutes on one core."""
    from dataclasses import replace

    from bench import sweep
    from triforce.cli.common import generation_config, read_text
    from bench.measure import run_system
    from triforce.cli.common import open_session
    from triforce.speculative import Generator

    plan = sweep.parse_args(["--model", str(MODEL), "--draft", "self", "--context", "16384", "--new-tokens", "2000",
                             "--dtype", "float32", "--budget", "2048"])
    session = open_session(plan.run, read_text(BOOK))
    cfg = generation_config(replace(session.run, mode="triforce"), len(session.prompt_ids))
    max_len = len(session.prompt_ids) + 2000
    seed = Generator(session.loaded.models, cfg, "autoregressive", max_len=max_len)
    seed.prefill(session.prompt_ids)
    prefilled = seed.snapshot()
    reference, _, _ = run_system(session, "autoregressive", cfg, prefilled, max_len)
    gen = Generator(session.loaded.models, cfg, "triforce", max_len=max_len, prefilled=prefilled)
    tokens = gen.generate()
    assert len(reference) == 2000 and tokens == reference
    # absorbing 2,000 tokens overflows the 2,048-token retrieval cache (measured: 1 rebuild), and moves the
    # drafter's window about once per 64 tokens (its slack; 1,455 times, once a pass, before session 28)
    assert gen.stats.rebuilds >= 1 and gen.drafter.cache.evictions > 20, (gen.stats.rebuilds, gen.drafter.cache.evictions)


def test_a_reused_prompt_prefix_leaves_the_cache_a_whole_prefill_leaves(tmp_path, monkeypatch):
    """runtime/prefill.py on the real model, in the machine's default dtype: a longer prompt that
    begins with a kept one reuses its whole prefill pieces, and the file kept after it (the K/V of the
    other tokens, joined after the first file's) is the file a prefill from token 0 keeps, bit for bit:
    every K/V byte, the queries and the logits. Reusing up to the first differing token instead, off
    the pieces' grid, changed the bits here (session 50): another split of the same prompt rounds
    otherwise."""
    import triforce

    from ..helpers import kept_prompt, same_tensors

    text = BOOK.read_text()[60_000:72_000]
    settings = dict(model=str(MODEL), prefill_chunk=1024, max_new_tokens=4, mode="autoregressive",
                    adaptive=False, temperature=0.0, prompt_cache="on")
    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path / "reusing"))
    triforce.generate(text[:9000], **settings)
    reusing = triforce.generate(text, **settings)
    assert reusing.report["prompt_cache"]["reused"] == 2048 and reusing.stats.prompt_tokens > 2048 + 512
    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path / "whole"))
    whole = triforce.generate(text, **settings)
    assert whole.report["prompt_cache"]["reused"] == 0
    assert same_tensors(kept_prompt(reusing.report["prompt_cache"]["kept"]), kept_prompt(whole.report["prompt_cache"]["kept"]))
