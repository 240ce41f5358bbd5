"""Our model gives transformers' logits on the same weights (float32, max abs diff < 1e-4)."""
import pytest
import torch

from triforce.speculative.caches import FullCache, StreamingCache
from triforce.model.config import ModelConfig
from triforce.model.loader import load_model
from triforce.model.rope import rope_frequencies

from ..conftest import hf_config, save_tiny, save_tokenizer

CASES = {
    "llama-gqa": dict(model_type="llama"),
    "llama-mha-tied": dict(model_type="llama", heads=4, kv_heads=4, tie=True),
    "llama-bias": dict(model_type="llama", attention_bias=True),
    "qwen2": dict(model_type="qwen2", heads=4, kv_heads=1),
    "linear": dict(rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "yarn": dict(rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512}),
    "llama3": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, theta=500000.0),
    "dynamic": dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case):
    ref = save_tiny(tmp_path, seed=3, **CASES[case])
    model = load_model(tmp_path, torch.float32)
    tokens = torch.randint(0, 64, (70,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref(tokens[None]).logits[0]
    # in one pass, then split in pieces through the cache: both must match
    got = model(tokens, FullCache(model.kv_shape(), 80))
    assert (got - expected).abs().max().item() < 1e-4
    cache = FullCache(model.kv_shape(), 80)
    pieces = [model(tokens[a:b], cache) for a, b in ((0, 33), (33, 34), (34, 40), (40, 70))]
    assert (torch.cat(pieces) - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("case", ["linear", "yarn", "llama3", "dynamic"])
def test_rope_frequencies_match_transformers(case):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = hf_config(**CASES[case])
    ours = ModelConfig.from_hf(hf.to_dict())
    inv_freq, scale = rope_frequencies(ours)
    kind = CASES[case]["rope_scaling"]["rope_type"]
    ref_freq, ref_scale = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
    assert torch.allclose(inv_freq, ref_freq.float(), rtol=1e-6)
    assert scale == pytest.approx(ref_scale)


def test_streaming_cache_matches_short_context(tmp_path):
    """With one layer a token's K/V depend on the token alone, so after evictions the streaming
    cache must give exactly the logits of a fresh run over the sinks + recent window at positions
    0..n-1: this checks that moved keys were re-rotated to their new slots."""
    save_tiny(tmp_path, seed=4, layers=1)
    model = load_model(tmp_path, torch.float64)
    tokens = torch.randint(0, 64, (200,), generator=torch.Generator().manual_seed(1))
    cache = StreamingCache(model.kv_shape(), model.rotary, sinks=4, window=32, slack=8)
    for i in range(0, 195, 5):
        model(tokens[i:i + 5], cache)
    out = model(tokens[195:200], cache)
    assert cache.evictions > 3
    sinks, recent = cache.window_tokens()
    assert sinks == 4 and recent >= 32 and cache.length == 200
    visible = torch.cat((tokens[:sinks], tokens[200 - recent:200]))
    fresh = model(visible, FullCache(model.kv_shape(), 64))[-5:]
    assert (out - fresh).abs().max().item() < 1e-5  # cos/sin are float32


def test_identical_tokenizer_files_need_no_second_load(tmp_path):
    from triforce.model.loader import same_tokenizer_files

    for name, vocab in (("a", 64), ("b", 64), ("c", 80)):
        save_tokenizer(tmp_path / name, vocab=vocab)
    assert same_tokenizer_files(tmp_path / "a", tmp_path / "b")
    assert not same_tokenizer_files(tmp_path / "a", tmp_path / "c")  # then the vocabularies are compared
    (tmp_path / "b" / "tokenizer_config.json").unlink()
    assert not same_tokenizer_files(tmp_path / "a", tmp_path / "b")


def test_tokenizer_loads_as_autotokenizer_does(tmp_path, monkeypatch):
    """A folder whose tokenizer_config.json names TokenizersBackend (what prepare writes) loads without
    AutoTokenizer (its AutoConfig took 1 s of every start) and gives AutoTokenizer's tokenizer; any
    other folder still goes through AutoTokenizer."""
    import json

    import transformers

    from triforce.model.loader import load_tokenizer

    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path / "kept"))  # no backend kept by another test
    save_tokenizer(tmp_path / "t", vocab=64)
    save_tiny(tmp_path / "t", vocab=64)
    want = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "t"))
    auto = []
    original = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: auto.append(a) or original(*a, **k))
    got = load_tokenizer(tmp_path / "t")  # model/tokenizer.py's, over transformers' TokenizersBackend
    assert type(got.full) is type(want) and not auto
    text = "t0 t5 t63 t1 t7 unknown"
    assert got(text)["input_ids"] == want(text)["input_ids"] and got.get_vocab() == want.get_vocab()
    assert got.all_special_ids == want.all_special_ids and got.eos_token_id == want.eos_token_id
    config = tmp_path / "t" / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "tokenizer_class": "PreTrainedTokenizerFast"}))
    assert load_tokenizer(tmp_path / "t")(text)["input_ids"] == want(text)["input_ids"] and len(auto) == 1
    again = load_tokenizer(tmp_path / "t")  # the backend AutoTokenizer built, kept: no AutoTokenizer
    assert again.encode(text, add_special_tokens=False) == want.encode(text, add_special_tokens=False) and len(auto) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_rounds_as_the_reference(dtype):
    """Eager on CPU one call of ours (layer_ops.rms_norm, the mean summed in float64); elsewhere
    float32 puts the weight inside torch's rms_norm (one call fewer a norm): the same bits as the
    reference's separate product. A 16-bit model rounds the normalized value to its dtype before the
    weight's product, as transformers' Llama does: torch's ops give the reference's bits, ours the
    same but where the order of the float32 statistics' sum moves a rounding by one unit."""
    from triforce.model import layer_ops
    from triforce.model.transformer import RMSNorm

    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=g))
    norm = norm.to(dtype)
    x = torch.randn(7, 576, generator=g).to(dtype)
    variance = x.float().pow(2).mean(-1, keepdim=True)
    reference = norm.weight * (x.float() * torch.rsqrt(variance + 1e-5)).to(dtype)
    with torch.no_grad():
        got = norm(x)
    assert got.dtype == dtype
    if layer_ops.available():  # eager on CPU: one call, the mean summed in float64
        assert torch.equal(got, layer_ops.rms_norm(x, norm.weight, 1e-5))
    elif dtype == torch.float32:
        assert torch.equal(got, norm.weight * torch.nn.functional.rms_norm(x, (576,), eps=1e-5))
    else:
        assert torch.equal(got, reference)
    if dtype == torch.float32:
        torch.testing.assert_close(got, reference, rtol=1e-6, atol=1e-6)
    else:  # one unit of bfloat16's last place at most, and on few elements (1 in 10^5 measured)
        assert ((got.float() - reference.float()).abs() <= 2 ** -7 * reference.float().abs()).all()
        assert (got != reference).sum() <= 2
