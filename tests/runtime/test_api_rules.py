"""The Python API follows the command line's rules: RoPE scaling for a prompt past the checkpoint's
positions, a retrieval-free mode for a prompt too short to retrieve from, each said in one line."""
import logging
from dataclasses import replace

import pytest
import torch

from triforce.model.config import ModelConfig
from triforce.model.errors import UserError
from triforce.model.rope import max_auto_positions, scaled_for
import triforce
from triforce.runtime.loading import load
from triforce.speculative import GenerationConfig, generate_ids
from triforce.speculative.retrieval import mode_for_prompt

from ..conftest import save_tiny, save_tokenizer


@pytest.fixture(scope="module")
def short_model(tmp_path_factory):
    """A tiny checkpoint trained on 64 positions only."""
    folder = tmp_path_factory.mktemp("short-positions")
    save_tiny(folder, seed=3, vocab=64, max_pos=64)
    save_tokenizer(folder, vocab=64)
    return folder


def words(n: int) -> list[int]:
    """A prompt of n token ids (the API takes ids as well as text)."""
    return [3 + i % 60 for i in range(n)]


# the API's settings for these tests: what the command-line tests pass as flags (tests/helpers.py)
SMALL = dict(draft="self", device="cpu", threads=1, temperature=0.0, adaptive=False)


def test_long_prompt_gets_yarn_and_a_note(short_model, caplog):
    cfg = GenerationConfig(max_new_tokens=4, budget=32, chunk_size=8)
    with caplog.at_level(logging.WARNING, logger="triforce"):
        result = triforce.generate(words(100), model=str(short_model), mode="autoregressive", max_new_tokens=4,
                                   dtype="float32", **SMALL)
    assert len(result.tokens) == 4
    notes = [r.getMessage() for r in caplog.records if "YaRN" in r.getMessage()]
    assert notes == ["104 tokens exceed the 64 trained positions: applying YaRN RoPE scaling x1.75 "
                     "(Settings.rope_scaling none refuses instead)"]
    # the same tokens as a model loaded with that scaling by hand
    scaled, _ = scaled_for(ModelConfig.from_folder(short_model), 104)
    by_hand = generate_ids(load(short_model, "self", target_config=scaled).models, words(100), "autoregressive", cfg)
    assert by_hand.tokens == result.tokens


def test_rope_none_refuses_and_auto_names_the_largest_context(short_model):
    with pytest.raises(UserError, match="refuses to extend"):
        triforce.generate(words(100), model=str(short_model), mode="autoregressive", max_new_tokens=4,
                          rope_scaling="none", **SMALL)
    cfg = ModelConfig.from_folder(short_model)
    assert max_auto_positions(cfg) == 64 * 32
    with pytest.raises(UserError, match=f"use Settings.context {64 * 32 - 10} or less"):
        scaled_for(cfg, 64 * 32 + 1, new_tokens=10)
    scaled_for(cfg, 64 * 32)  # the boundary itself is accepted


def test_short_prompt_falls_back_without_retrieval(tiny_folder, caplog):
    with caplog.at_level(logging.WARNING, logger="triforce"):
        fallback = triforce.generate(words(20), model=str(tiny_folder), mode="triforce", max_new_tokens=6,
                                     chunk_size=8, **SMALL)
    assert any("runs as speculative" in r.getMessage() for r in caplog.records)
    reference = triforce.generate(words(20), model=str(tiny_folder), mode="autoregressive", max_new_tokens=6, **SMALL)
    assert fallback.tokens == reference.tokens  # greedy: lossless whatever the levels
    assert fallback.stats.to_dict()["acceptance"].keys() == {"draft->verify"}


@pytest.mark.parametrize("budget,prompt,expected", [(64, 64, "speculative"), (64, 65, "triforce")])
def test_fallback_boundary(budget, prompt, expected):
    assert mode_for_prompt("triforce", budget, 8, prompt)[0] == expected
    assert mode_for_prompt("retrieval", budget, 8, prompt)[0] == ("autoregressive" if expected != "triforce"
                                                                  else "retrieval")
    assert mode_for_prompt("speculative", budget, 8, prompt) == ("speculative", None)


def test_prefill_pieces_follow_the_device_unless_set():
    """The API prefills in the command line's pieces: a whole 4K prompt in one causal piece on CPU."""
    assert GenerationConfig().prefill_piece("cpu") == 4096
    assert GenerationConfig().prefill_piece(torch.device("cuda", 0)) == 2048
    assert GenerationConfig(prefill_chunk=100).prefill_piece("cpu") == 100
    with pytest.raises(UserError, match="prefill chunk must be >= 1"):
        GenerationConfig(prefill_chunk=0)


def test_a_generator_feeds_its_prefill_in_the_device_pieces(short_model):
    from triforce.speculative import Generator

    models = load(short_model).models
    cfg = GenerationConfig(max_new_tokens=2, budget=32, chunk_size=8)
    assert Generator(models, cfg, "autoregressive", max_len=64).full.cache.max_feed == 4096
    cfg = GenerationConfig(max_new_tokens=2, budget=32, chunk_size=8, prefill_chunk=16)
    assert Generator(models, cfg, "autoregressive", max_len=64).full.cache.max_feed == 16


def test_a_gpu_budget_is_a_quarter_of_the_prompt_from_4096_to_8192_within_4_gib():
    """On a GPU a middle pass costs its kernels, not its budget: the default follows the prompt (at 32K,
    SmolLM2 made 6.05 tokens a full pass at 8,192 against 4.88 at 4,096), its cache within 4 GiB
    (TriForce's one-GPU setting for Llama-2-7B)."""
    from triforce.runtime.settings import default_budget, kv_token_bytes

    assert [default_budget(n, 32, gpu=True) for n in (4096, 16384, 32768, 131072)] == [4096, 4096, 8192, 8192]
    assert default_budget(131072, 32, gpu=True, kv_token_bytes=512 * 1024) == 8192  # Llama-2-7B: MHA, 32 layers
    assert default_budget(131072, 32, gpu=True, kv_token_bytes=819200) == 5216  # Llama-2-13B: 40 layers, 40 heads
    assert default_budget(131072, 32, gpu=True, kv_token_bytes=2 * 2**20) == 4096  # never below 4,096
    assert default_budget(131072, 32, gpu=False) == 8192 and default_budget(4096, 32, gpu=False) == 1024
    assert kv_token_bytes(None) == 0 and kv_token_bytes("/nonexistent/model") == 0


@pytest.mark.parametrize("mode,adaptive,offload,device,gamma2", [
    ("triforce", True, "host", "cuda", 16),  # the default: the chooser's cap at TriForce's offloaded 16
    ("retrieval", False, "host", "cuda", 16),
    ("triforce", False, "host", "cuda", 6),  # fixed triforce: 0.81x plain decoding sampled at 16 (1.40x at 6)
    ("triforce", True, "none", "cuda", 6),  # the KV on the GPU: a full pass costs 2 ms, not the link's 14
    ("triforce", True, "host", "cpu", 3),
    ("speculative", True, "host", "cuda", 4),  # no middle level: gamma2 stays gamma1's business
])
def test_gamma2_defaults_follow_the_device_and_where_the_kv_lives(monkeypatch, mode, adaptive, offload, device, gamma2):
    import triforce.parallel
    from triforce.runtime.settings import generation_config, make_settings

    monkeypatch.setattr(triforce.parallel, "resolve_device", lambda spec: device)
    run = make_settings(mode=mode, adaptive=adaptive, offload=offload, budget=4096, sampling="greedy")
    cfg = generation_config(run, prompt_len=32768)
    assert (cfg.gamma2 if mode != "speculative" else cfg.gamma1) == gamma2
    assert generation_config(replace(run, gamma2=5), prompt_len=32768).gamma2 == 5  # a chosen gamma2 stays


@pytest.mark.parametrize("adaptive,draft,device,gamma1", [
    (False, None, "cuda", 1),  # the target drafting for itself: a draft costs a middle pass on a GPU
    (False, "self", "cuda", 1),
    (False, "lookup", "cuda", 4),  # lookups cost no pass
    (False, "/models/llama-68m", "cuda", 4),  # a drafter of its own, far cheaper than the middle pass
    (True, None, "cuda", 1),  # the adaptive default there weighs no lookups (SELF_DRAFT_GPU_LOOKUP)
    (True, "/models/llama-68m", "cuda", 4),  # it weighs lookups beside a drafter of its own: their rounds too
    (False, None, "cpu", 2),  # a CPU's middle pass also reads its budget of KV
])
def test_gamma1_defaults_follow_what_a_draft_costs(monkeypatch, adaptive, draft, device, gamma1):
    """runtime/settings.py SELF_DRAFT_GPU_GAMMA1: g drafts a round make middle tokens no faster than
    one wherever acceptance x middle pass <= drafter pass."""
    import triforce.parallel
    from triforce.runtime.settings import generation_config, make_settings

    monkeypatch.setattr(triforce.parallel, "resolve_device", lambda spec: device)
    run = make_settings(mode="triforce", adaptive=adaptive, draft=draft, offload="host", budget=4096,
                        sampling="greedy")
    assert generation_config(run, prompt_len=32768).gamma1 == gamma1
    assert generation_config(replace(run, gamma1=3), prompt_len=32768).gamma1 == 3  # a chosen gamma1 stays
    assert generation_config(replace(run, lookup=True), prompt_len=32768).gamma1 == (4 if adaptive else gamma1)


@pytest.mark.parametrize("draft,device,lookup", [
    (None, "cuda", False),  # the target drafting for itself on a GPU: retrieval beats lookups there
    ("self", "cuda", False),
    ("/models/llama-68m", "cuda", True),  # a drafter of its own: unmeasured on a GPU, lookups as before
    (None, "cpu", True),  # a CPU's middle pass reads its budget of KV; a lookup costs nothing
])
def test_adaptive_weighs_lookups_where_they_paid(monkeypatch, draft, device, lookup):
    """runtime/settings.py SELF_DRAFT_GPU_LOOKUP: on H200s the adaptive default weighing lookups beside
    the target drafting for itself made 2.10x plain decoding at 32K, 2.93x without; a choice stays."""
    import triforce.parallel
    from triforce.runtime.settings import generation_config, make_settings

    monkeypatch.setattr(triforce.parallel, "resolve_device", lambda spec: device)
    run = make_settings(mode="triforce", draft=draft, offload="host", budget=4096, sampling="greedy")
    assert run.adaptive and generation_config(run, prompt_len=32768).lookup is lookup
    for chosen in (True, False):
        assert generation_config(replace(run, lookup=chosen), prompt_len=32768).lookup is chosen


def test_kv_token_bytes_reads_the_model_folder(tmp_path):
    from triforce.model.loader import load_model
    from triforce.runtime.settings import kv_token_bytes

    from ..conftest import save_tiny
    save_tiny(tmp_path, layers=3)
    shape = load_model(tmp_path, torch.bfloat16, "cpu").kv_shape()
    assert kv_token_bytes(str(tmp_path)) == shape.bytes_per_token > 0
