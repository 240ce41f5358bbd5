"""Dense 16-bit products on CPU give a row the same bits whatever rows share its pass
(transformer.dense_product), so that a verification pass computes each token's logits as its own
decode step does with dense weights too (Q6_K matrices, which stay dense, and unquantized checkpoints)."""
import pytest
import torch

from triforce.model.transformer import dense_product

from ..conftest import save_tiny

# the dense matrices of the prepared models: SmolLM2's head, Qwen2.5-1.5B's MLP down and up, a projection
SHAPES = [(49152, 576), (1536, 8960), (8960, 1536), (256, 1536)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_features,in_features", SHAPES)
@pytest.mark.parametrize("pairs", [None, True], ids=["this-cpu", "in-pairs"])
def test_a_row_gets_its_bits_alone_and_among_others(monkeypatch, out_features, in_features, dtype, threads, pairs):
    """On the machine at hand, and with the rows in pairs (the form for CPUs whose many-row kernels
    round apart: transformer.rows_share_kernels) wherever this one is not such a CPU."""
    from triforce.model import transformer

    if pairs:
        if not transformer.rows_share_kernels():
            pytest.skip("this CPU takes the pairs already (the this-cpu case)")
        monkeypatch.setattr(transformer, "rows_share_kernels", lambda: False)
    g = torch.Generator().manual_seed(out_features + in_features)
    weight = (0.02 * torch.randn(out_features, in_features, generator=g)).to(dtype)
    bias = (0.1 * torch.randn(out_features, generator=g)).to(dtype)
    x = torch.randn(31, in_features, generator=g).to(dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        alone = [dense_product(x[r:r + 1], weight, bias) for r in range(31)]
        for T in (2, 3, 5, 7, 16, 31):
            together = dense_product(x[:T], weight, bias)
            assert all(torch.equal(together[r:r + 1], alone[r]) for r in range(T)), T
    finally:
        torch.set_num_threads(before)


def test_a_bf16_verification_pass_gives_each_token_its_decode_steps_logits(tmp_path):
    """A dense bf16 model (weights not from a GGUF): the logits of a 6-token pass, row by row, are
    bit for bit those of six 1-token passes."""
    from triforce.model.loader import load_model
    from triforce.speculative.caches import FullCache

    # Qwen2.5-1.5B's widths (1,536 and 8,960), where the one-row and many-row kernels round apart
    save_tiny(tmp_path, seed=3, vocab=4096, hidden=1536, layers=1, heads=12, kv_heads=2, inter=8960)
    model = load_model(tmp_path, torch.bfloat16)
    prompt = torch.randint(0, 4096, (40,), generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(0, 4096, (6,), generator=torch.Generator().manual_seed(2))

    def cache_after_prompt():
        cache = FullCache(model.kv_shape(), 64)
        model(prompt, cache, last_only=True)
        return cache

    together = model(tokens, cache_after_prompt())
    cache = cache_after_prompt()
    alone = torch.cat([model(tokens[t:t + 1], cache) for t in range(6)])
    assert torch.equal(together, alone)
