"""RoPE's cos and sin are the same bits in every process, pass shape and device: read from a table
of numpy's float64 values rounded to float32. torch's float32 cos on CPU went through MKL, whose
results moved with the buffer (one run of `triforce generate` in five flipped a greedy token)."""
import numpy as np
import pytest
import torch

from triforce.model.config import ModelConfig
from triforce.model.rope import Rotary, apply_rotary

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}


def config(**extra) -> ModelConfig:
    return ModelConfig(vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1, num_heads=1,
                       num_kv_heads=1, head_dim=64, max_position_embeddings=2048, rope_theta=10000.0, **extra)


def reference(rotary: Rotary, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 angles as the model computes them, then cos/sin in float64 rounded to float32."""
    freqs = (positions.to(torch.float32)[:, None] * rotary.inv_freq[None, :]).double().numpy()
    cos = torch.from_numpy(np.cos(freqs).astype(np.float32)) * rotary.scale
    sin = torch.from_numpy(np.sin(freqs).astype(np.float32)) * rotary.scale
    return torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)


@pytest.mark.parametrize("scaling", [None, YARN])
@pytest.mark.parametrize("max_len", [None, 300])
def test_every_position_reads_the_reference_in_any_pass_shape(scaling, max_len):
    rotary = Rotary(config(rope_scaling=scaling), max_len)
    positions = torch.arange(6000)  # past the table built first: it grows
    want_cos, want_sin = reference(rotary, positions)
    cos, sin = rotary.cos_sin(positions, torch.float32)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    for p in (0, 1, 299, 300, 4095, 5999):  # a decode step's position alone, and a short pass
        one_cos, one_sin = rotary.cos_sin(torch.tensor([p]), torch.float32)
        assert torch.equal(one_cos[0], want_cos[p]) and torch.equal(one_sin[0], want_sin[p])
    three = rotary.cos_sin(torch.arange(17, 20), torch.bfloat16)
    assert torch.equal(three[0], want_cos[17:20].bfloat16()) and torch.equal(three[1], want_sin[17:20].bfloat16())


def test_shift_back_and_forth_is_the_rotation_of_its_angle():
    rotary = Rotary(config(), 64)
    x = torch.randn(5, 2, 64, dtype=torch.float64)
    for delta in (7, -7, 130, -130):
        freqs = torch.full((1,), float(abs(delta)))[:, None] * rotary.inv_freq[None, :]
        cos, sin = np.cos(freqs.double().numpy()).astype(np.float32), np.sin(freqs.double().numpy()).astype(np.float32)
        cos, sin = torch.from_numpy(cos).double(), torch.from_numpy(sin).double() * (1 if delta > 0 else -1)
        want = apply_rotary(x, torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1))
        assert torch.equal(rotary.shift(x, delta), want)


def test_a_runs_table_covers_the_proposals_past_its_length():
    """A run's table reaches HEADROOM positions past its length, where the levels propose: a table
    that grew mid-run handed a compiled pass (made over the old one) a tensor of another shape."""
    from triforce.model.rope import HEADROOM

    rotary = Rotary(config(), 1032)
    table = rotary._table(torch.device("cpu"))[0]
    rotary.cos_sin(torch.arange(1032, 1032 + HEADROOM), torch.float32)
    assert rotary.length == 1032 + HEADROOM and rotary._table(torch.device("cpu"))[0] is table
    rotary.cos_sin(torch.tensor([1032 + HEADROOM]), torch.float32)  # past it: the table grows
    assert rotary.length > 1032 + HEADROOM and rotary._table(torch.device("cpu"))[0] is not table


def test_cover_grows_the_table_up_front_and_keeps_what_a_graph_may_read():
    rotary = Rotary(config(), 300)
    rotary.cos_sin(torch.arange(4), torch.float32)  # a table on the CPU, as a first pass makes it
    old = rotary._tables[torch.device("cpu")]
    rotary.cover(100)  # already covered: nothing changes
    assert rotary._tables[torch.device("cpu")] is old
    rotary.cover(5000)
    assert rotary.length == 5000 and rotary._tables[torch.device("cpu")][0].shape[0] == 5000
    assert any(t is old for t in rotary._retired)  # a captured graph's table stays alive
    want_cos, want_sin = reference(rotary, torch.arange(4999, 5000))
    cos, sin = rotary.cos_sin(torch.tensor([4999]), torch.float32)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin) and rotary.length == 5000


@pytest.mark.parametrize("mode", ["retrieval", "triforce"])
def test_a_generator_covers_every_position_it_can_reach_before_any_pass(mode):
    """On CUDA a position past the table is a device-side assert (the CPU table grows on IndexError,
    so CPU runs never showed it): bench.big_target's model was built without headroom and triforce's
    widest verification (gamma2 rounds of gamma1 + 1) ran past its end on the H200. The generator
    covers its whole sequence when it is built, so no pass grows the table."""
    from triforce.speculative import GenerationConfig, Generator, Models
    from triforce.model.transformer import Transformer

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, max_position_embeddings=340)
    torch.manual_seed(0)
    target, drafter = Transformer(cfg).eval(), Transformer(cfg).eval()  # no max_len: tables end at 340
    gen_cfg = GenerationConfig(max_new_tokens=24, budget=64, chunk_size=8, gamma1=3, gamma2=8, adaptive=False)
    gen = Generator(Models(target, drafter), gen_cfg, mode, max_len=340)
    used = [target, drafter] if mode == "triforce" else [target]  # retrieval runs no drafter
    covered = [m.rotary.length for m in used]
    assert min(covered) >= gen.seq.ids.shape[0] > 340
    gen.prefill([3 + (i * 7) % 60 for i in range(300)])
    with torch.no_grad():
        gen.generate()
    assert [m.rotary.length for m in used] == covered  # no pass went past a table
