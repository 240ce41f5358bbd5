"""Weight-only int8 proposing levels (--lower-weights int8): cheaper drafts, the same output.

The int8 twin really is a different model (its logits differ from the target's), yet greedy output in
every mode equals autoregressive decoding with the exact weights, and sampled output keeps exactly
the target's distribution (the chi-square harness of test_sampling)."""
from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from triforce.speculative import GenerationConfig, Models, UserError, generate_ids
from triforce.speculative.caches import FullCache
from triforce.model.loader import load_model
from triforce.model import quant
from triforce.model.quant import (INT8_KERNEL_MAX_ROWS, Int8Linear, int8_twin, lower_weights_for, resolve_lower_weights,
                               with_lower_weights)
from triforce.speculative.sampling import Sampler

from ..helpers import assert_one_line_error, run
from ..conftest import save_tiny
from ..speculative.test_sampling import SETTINGS, chi_square_rejects, exact_joint, models, sample_joint  # noqa: F401 (fixture)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_int8_linear_is_the_dequantized_matmul(dtype):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=g).to(dtype)
    bias = torch.randn(96, generator=g).to(dtype)
    x = torch.randn(5, 64, generator=g).to(dtype)
    original = weight.clone()
    layer = Int8Linear(weight, bias)
    assert torch.equal(weight, original)  # quantizing leaves the exact weights alone
    assert layer.weight.dtype == torch.int8 and layer.weight.abs().max() >= 126
    dequantized = layer.weight.double() * layer.scale.double()[:, None]
    expected = F.linear(x.double(), dequantized, bias.double())
    tol = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float64: 1e-10}[dtype]
    assert torch.allclose(layer(x).double(), expected, atol=tol, rtol=tol)
    # per-row absmax rounding: each weight is off by at most half a step
    assert (dequantized - weight.double()).abs().max() <= layer.scale.double().max() / 2 + 1e-6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("q")
    save_tiny(folder, seed=31, vocab=48, layers=2, attention_bias=True)
    return load_model(folder, torch.float32)


def test_the_twin_is_a_different_model_sharing_the_rest(tiny):
    twin = int8_twin(tiny)
    assert twin.embed is tiny.embed and twin.norm is tiny.norm and twin.rotary is tiny.rotary
    assert isinstance(twin.layers[0].attention.wqkv, Int8Linear) and isinstance(tiny.layers[0].attention.wqkv, torch.nn.Linear)
    assert twin.layers[0].attention_norm is tiny.layers[0].attention_norm
    ids = torch.arange(INT8_KERNEL_MAX_ROWS) % 48  # a pass as short as a draft or middle one
    exact = tiny(ids, FullCache(tiny.kv_shape(), 20))
    approx = twin(ids, FullCache(twin.kv_shape(), 20))
    assert not torch.equal(exact, approx)  # otherwise the lossless tests below would prove nothing
    assert torch.allclose(exact, approx, atol=0.1)
    long = torch.arange(INT8_KERNEL_MAX_ROWS + 1) % 48  # a prefill-sized pass reads the exact weights
    assert torch.equal(tiny(long, FullCache(tiny.kv_shape(), 20)), twin(long, FullCache(twin.kv_shape(), 20)))


@pytest.mark.parametrize("mode,separate_drafter", [("speculative", False), ("speculative", True), ("retrieval", False),
                                                   ("triforce", False), ("triforce", True)])
def test_greedy_is_unchanged(tiny, mode, separate_drafter):
    ids = torch.randint(0, 48, (120,), generator=torch.Generator().manual_seed(4)).tolist()
    cfg = GenerationConfig(max_new_tokens=60, budget=48, chunk_size=8, gamma1=3, gamma2=4, draft_window=16,
                           sink_tokens=4)
    reference = generate_ids(Models(tiny, None), ids, "autoregressive", cfg)
    models = with_lower_weights(Models(tiny, tiny if separate_drafter else None), "int8")
    assert models.proposing_target is not None and (models.drafter is None) != separate_drafter
    result = generate_ids(models, ids, mode, cfg)
    assert result.tokens == reference.tokens
    assert result.stats.full_passes < 59


def test_sampled_distribution_is_exact(models):  # noqa: F811 (the fixture)
    target, _ = models
    exact = exact_joint(target, Sampler(SETTINGS["temperature"]))
    counts = sample_joint(with_lower_weights(Models(target, None), "int8"), "triforce", SETTINGS)
    rejects, stat, critical = chi_square_rejects(counts, exact)
    assert not rejects, f"chi-square {stat:.1f} > {critical:.1f}: int8 proposers changed the distribution"


def test_unknown_kind_is_refused(tiny):
    with pytest.raises(UserError, match="Settings.lower_weights"):
        lower_weights_for(tiny, "int4")


def test_generate_cli_int8_gives_the_autoregressive_tokens(tiny_folder):
    prompt = " ".join(f"t{i % 60 + 3}" for i in range(300))
    common = ("--model", tiny_folder, "--draft", "self", "--prompt", prompt, "--max-new-tokens", 40,
              "--budget", 64, "--chunk-size", 8, "--json")
    reference = run("generate", *common, "--mode", "autoregressive")
    assert reference.returncode == 0, reference.stderr
    for mode in ("retrieval", "triforce"):
        proc = run("generate", *common, "--mode", mode, "--lower-weights", "int8")
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["tokens"] == json.loads(reference.stdout)["tokens"]


def test_int8_on_a_gpu_is_one_line(tiny_folder):
    proc = run("generate", "--model", tiny_folder, "--prompt", "t3 t4", "--device", "cuda", "--lower-weights", "int8")
    # without CUDA the device check answers first; with it, the int8 check
    assert_one_line_error(proc, *(["lower-weights"] if torch.cuda.is_available() else []))


def test_auto_is_int8_in_half_precision_on_cpu_only():
    assert resolve_lower_weights("auto", "cpu", torch.bfloat16) == "int8"
    assert resolve_lower_weights("auto", "cpu", torch.float32) == "same"  # the kernel is slower than fp32 matmul
    assert resolve_lower_weights("auto", "cuda", torch.bfloat16) == "same"
    assert resolve_lower_weights("same", "cpu") == "same" and resolve_lower_weights("int8", "cuda") == "int8"


def test_stats_table_names_int8_proposers(tiny):
    from rich.console import Console

    from triforce.cli.stats import print_stats_table

    ids = torch.randint(0, 48, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    cfg = GenerationConfig(max_new_tokens=8, budget=16, chunk_size=4, gamma1=2, gamma2=3, draft_window=8, sink_tokens=2)
    stats = generate_ids(with_lower_weights(Models(tiny, None), "int8"), ids, "triforce", cfg).stats
    for kind in ("int8", "same"):
        console = Console(record=True, width=120)
        print_stats_table(console, "triforce", stats, kind)
        assert ("proposing levels' weights" in console.export_text()) == (kind == "int8")


def test_blockwise_quantization_matches_the_whole_tensor_formula(monkeypatch):
    """The int8 rows computed a block at a time equal round(w / scale) of the whole tensor."""
    g = torch.Generator().manual_seed(5)
    weight = (torch.randn(37, 19, generator=g) * torch.rand(37, 1, generator=g) * 3).to(torch.bfloat16)
    weight[3] = 0  # a row of zeros gets the tiny scale, not a division by zero
    monkeypatch.setattr(quant, "QUANTIZE_BLOCK_ELEMENTS", 19 * 5)  # blocks of 5 rows, the last one short
    layer = Int8Linear(weight, None)
    w = weight.float()
    exact = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.bfloat16).tiny)
    assert torch.all(layer.scale.float() >= exact) and layer.scale.dtype == torch.bfloat16
    expected = (w / layer.scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
    assert torch.equal(layer.weight, expected) and layer.weight[3].abs().sum() == 0
    assert layer.weight.abs().amax(dim=1)[torch.arange(37) != 3].min() >= 126  # each row uses its range


@pytest.mark.parametrize("modes,separate,target_twin,drafter_twin", [
    (("autoregressive",), True, False, False),
    (("speculative",), True, False, True),
    (("speculative",), False, True, False),  # the target drafts for itself
    (("retrieval",), True, True, False),
    (("triforce",), True, True, True),
    (("autoregressive", "retrieval"), True, True, False),
])
def test_only_the_levels_a_mode_runs_get_a_cheaper_copy(tiny, modes, separate, target_twin, drafter_twin):
    drafter = copy.copy(tiny) if separate else None
    models = Models(tiny, drafter)
    target, draft = models.proposers(modes)
    lowered = with_lower_weights(models, "int8", target, draft)
    assert (lowered.proposing_target is not None) == target_twin
    assert (lowered.drafter is not drafter) == drafter_twin and lowered.target is tiny
    with pytest.raises(UserError, match="unknown Settings.lower_weights"):
        with_lower_weights(models, "int4", target, draft)
