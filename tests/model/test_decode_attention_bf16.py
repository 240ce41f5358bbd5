"""decode_attention.attend: bf16 attention in one call (scores, softmax and values' product) against
float64, and the bits each row gets whatever rows share its call, so that bf16 greedy verification on
stored weights computes each token's logits exactly as its own decode step does. (That it reads
nothing past the limits: tests/model/test_decode_attention_f32.py, with the float32 kernel.)"""
import pytest
import torch

from triforce.model import decode_attention as bf16
from triforce.model import stored_bf16
from tests.model.test_decode_attention_f32 import attend_reference

needs_kernels = pytest.mark.skipif(not bf16.available(), reason="no avx512_bf16 or no C++ compiler: attention keeps bmm")

# The error of attend's output against float64, relative to softmax . |values|: the output's rounding to
# bf16 (2^-8 of |output| <= softmax . |values|), the weights' rounding to bf16 (2^-8 each), float32 sums.
# Measured at most 0.0047 over the cases below; 2^-7 = 0.0078. A key left out at 77 keys, or counted
# twice, moves the output by about 1/77 of a value: it does not fit.
BOUND = 2 ** -7


def inputs(H, R, S, D, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(H, n, D, generator=g).bfloat16() for n in (R, S, S))


@needs_kernels
@pytest.mark.parametrize("D", bf16.HEAD_DIMS)
@pytest.mark.parametrize("S", [1, 9, 77, 1000, 2051, 5000])
@pytest.mark.parametrize("rep,T", [(1, 1), (3, 1), (3, 4), (3, 7), (6, 7)])
def test_attend_equals_float64(rep, T, S, D, products):
    """Every token sees the keys up to its own (the last T are the new tokens); at 2,051 keys and 7
    tokens the earliest of them see nothing of the second span."""
    if T > S:
        pytest.skip("fewer keys than new tokens")
    rows, keys, values = inputs(2, rep * T, S, D, seed=rep * 1000 + T * 100 + S + D)
    limits = torch.arange(S - T + 1, S + 1)
    got = bf16.attend(rows, keys, values, limits, D ** -0.5)
    want, scale = attend_reference(rows, keys, values, limits, D ** -0.5)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape and torch.isfinite(got).all()
    assert ((got.double() - want).abs() / scale).max().item() <= BOUND


@needs_kernels
@pytest.mark.parametrize("D", bf16.HEAD_DIMS)
@pytest.mark.parametrize("spread", [1.0, 30.0])
def test_each_weight_is_softmax_to_bf16(D, spread, products):
    """The weights themselves: over D keys whose values are the identity, a row's output is its
    softmax. Each weight (exp as 2^t through a degree-4 polynomial, 3e-6 of its value) is rounded to
    bf16, the sum divides them and the output is rounded again: within 2^-7 of each probability, and
    where scores lie 30x further apart (e^-700 at the far end, under float32's range) the small ones
    are near zero and the large ones still right."""
    g = torch.Generator().manual_seed(D + int(spread))
    rows = (torch.randn(2, 6, D, generator=g) * spread).bfloat16()
    keys = torch.randn(2, D, D, generator=g).bfloat16()
    values = torch.eye(D).bfloat16().expand(2, D, D).contiguous()
    got = bf16.attend(rows, keys, values, torch.tensor([D]), D ** -0.5).double()
    want = torch.softmax(torch.einsum("hrd,hsd->hrs", rows.double(), keys.double()) * D ** -0.5, dim=-1)
    assert (got - want).abs().max().item() <= 2 ** -7 * want.max().item()
    big = want > 1e-3
    assert ((got - want).abs()[big] / want[big]).max().item() <= 2 ** -7
    assert (got[want < 1e-30] < 1e-30).all()


@needs_kernels
@pytest.mark.parametrize("rep,T,D", [(1, 3, 64), (3, 4, 64), (3, 7, 64), (6, 7, 64), (2, 5, 128)])
def test_attend_gives_each_row_its_one_token_bits(rep, T, D, products):
    """A verification pass of T tokens gives each token exactly what a pass of that token alone gives
    (the scores of 1-3 rows once summed in another order than more rows' did), and 1 and 2 threads
    agree (the spans follow the keys alone)."""
    S = 5000
    rows, keys, values = inputs(3, rep * T, S, D, seed=T + D)
    limits = torch.arange(S - T + 1, S + 1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = bf16.attend(rows, keys, values, limits, D ** -0.5)
        torch.set_num_threads(1)
        one = bf16.attend(rows, keys, values, limits, D ** -0.5)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    grouped = rows.view(3, rep, T, D)
    for t in range(T):
        alone = bf16.attend(grouped[:, :, t].contiguous(), keys, values, limits[t:t + 1], D ** -0.5)
        assert torch.equal(alone, two.view(3, rep, T, D)[:, :, t])


@needs_kernels
@pytest.mark.parametrize("D", bf16.HEAD_DIMS)
def test_prefill_gives_each_row_the_bits_of_attend(D, products):
    """A prefill piece's rows (many row tiles, steps of 256 keys) against `attend` of each token alone:
    within the float64 bound both, and the tiles' part-tile and odd-key edges (301 keys before 13
    tokens) are read as zeros, not as the next row's weights."""
    start, T, rep = 301, 13, 3
    g = torch.Generator().manual_seed(D)
    q = torch.randn(T, 2 * rep, D, generator=g).bfloat16()
    keys, values = (torch.randn(2, start + T, D, generator=g).bfloat16() for _ in range(2))
    got = bf16.prefill(q, keys, values, start, D ** -0.5).view(T, 2, rep, D)
    for t in (0, 6, T - 1):
        rows = q[t].view(2, rep, D)
        want, scale = attend_reference(rows, keys, values, torch.tensor([start + t + 1]), D ** -0.5)
        assert ((got[t].double() - want).abs() / scale).max().item() <= BOUND


@needs_kernels
def test_the_process_takes_the_tiles_where_the_cpu_has_them():
    """AMX CPUs run both products on tiles unless TRIFORCE_AMX=0; others never do."""
    from triforce.model import cpu_kernels, stored_amx

    assert bf16.tiles() == (cpu_kernels.cpu_has(stored_amx.AMX) and not stored_amx.OFF)


@needs_kernels
def test_attend_refuses_what_does_not_fit():
    rows, keys, values = inputs(2, 6, 40, 64, seed=1)
    with pytest.raises(RuntimeError, match="one count per token"):
        bf16.attend(rows, keys, values, torch.arange(4), 0.125)  # 6 rows are not a multiple of 4 tokens
    with pytest.raises(RuntimeError, match="bfloat16"):
        bf16.attend(rows.float(), keys, values, torch.tensor([40]), 0.125)


# --- a whole bf16 model on its stored blocks (SmolLM2's logits, bit for bit: tests/cli/test_real_model.py) ---

GQA_CFG = dict(hidden=192, heads=3, kv_heads=1, inter=256, layers=2, vocab=64)  # SmolLM2's head_dim, group of 3


@pytest.fixture(scope="module")
def gqa_gguf(tmp_path_factory):
    from tests.model.test_stored import write_tiny_gguf

    path = tmp_path_factory.mktemp("gguf") / "gqa.gguf"
    write_tiny_gguf(path, seed=4, cfg=GQA_CFG)
    return path


@needs_kernels
@pytest.mark.skipif(not stored_bf16.available(), reason="no bf16 kernels over stored blocks")
@pytest.mark.parametrize("mode", ["speculative", "retrieval", "triforce"])
def test_bf16_greedy_on_stored_weights_is_autoregressive(gqa_gguf, mode):
    """Every mode's greedy tokens are plain decoding's in bfloat16 on stored blocks, with no tie
    allowance. (This tiny model's scores are small enough that the earlier attention's 1-3-row order
    also passed here; SmolLM2's logits tell the two apart: tests/cli/test_real_model.py.)"""
    from triforce.model.gguf_loader import load_gguf_model
    from triforce.speculative import GenerationConfig, Models, generate_ids

    target = load_gguf_model(gqa_gguf, torch.bfloat16, stored=True)
    ids = torch.randint(0, 64, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    cfg = GenerationConfig(max_new_tokens=48, budget=64, chunk_size=8, gamma1=3, gamma2=5, draft_window=32,
                           sink_tokens=4)
    reference = generate_ids(Models(target, None), ids, "autoregressive", cfg)
    result = generate_ids(Models(target, None), ids, mode, cfg)
    assert result.tokens == reference.tokens
