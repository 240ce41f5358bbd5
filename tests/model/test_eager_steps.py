"""Eager CPU passes of a few rows through bound steps (model/eager_steps.py): the same bits as the
modules' path, no module called inside the layers, and the modules' path wherever it must run."""
from __future__ import annotations

import pytest
import torch

from triforce.model import eager_steps
from triforce.model.gguf_loader import load_gguf_model
from triforce.model.kv_dtype import use_kv_dtype
from triforce.model.quant import int8_twin
from triforce.speculative.caches import FullCache, StreamingCache
from triforce.speculative.retrieval import RetrievalCache

from ..conftest import hf_config
from .test_stored import Q4K_CFG, Q6K_STAND_INS, write_tiny_gguf

PREFIX = 40


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """SmolLM2's layout (Q4_1 matrices, a Q8_0 head) and Qwen2.5-Coder's (Q4_K, biases, some matrices
    dense), both with 64-wide heads so that every one-call kernel serves."""
    folder = tmp_path_factory.mktemp("gguf")
    write_tiny_gguf(folder / "llama.gguf", seed=11, cfg=Q4K_CFG)
    write_tiny_gguf(folder / "qwen2.gguf", seed=12, head_kind="Q4_K", kind="Q4_K", cfg=Q4K_CFG,
                    kept_dense=Q6K_STAND_INS, arch="qwen2")
    return folder


def logits(model, tokens, steps_on: bool, length: int = PREFIX) -> torch.Tensor:
    """The pass of `tokens` after `length` cached ones, through bound steps or the modules."""
    cache = FullCache(model.kv_shape(), 128)
    with torch.inference_mode():
        eager_steps.enabled = True
        model(torch.arange(length) % 48, cache)
        eager_steps.enabled = steps_on
        try:
            return model(tokens, cache)
        finally:
            eager_steps.enabled = True


CASES = [("llama", torch.float32, torch.float16), ("llama", torch.float32, None), ("llama", torch.bfloat16, None),
         ("qwen2", torch.float32, torch.float16), ("qwen2", torch.bfloat16, None), ("llama", torch.float64, None)]


@pytest.mark.parametrize("arch,dtype,kv_dtype", CASES)
@pytest.mark.parametrize("T", [1, 5, eager_steps.MAX_ROWS])
def test_bound_steps_give_the_modules_bits(ggufs, arch, dtype, kv_dtype, T):
    model = load_gguf_model(ggufs / f"{arch}.gguf", dtype, stored=dtype != torch.float64)
    use_kv_dtype(model, kv_dtype)
    tokens = torch.randint(0, 48, (T,), generator=torch.Generator().manual_seed(T))
    bound, modules = logits(model, tokens, True), logits(model, tokens, False)
    assert eager_steps.bound_layers(model, model.embed(tokens)) is not None
    assert torch.equal(bound, modules)


@pytest.mark.parametrize("T", [1, 7])
def test_fused_layers_give_the_bound_steps_bits(ggufs, monkeypatch, T):
    """A float32 layer over stored records runs as two calls around its attention
    (model/fused_layers.py): the bits of its four steps called one by one."""
    from triforce.model import fused_layers, layer_ops

    model = load_gguf_model(ggufs / "llama.gguf", torch.float32, stored=True)
    use_kv_dtype(model, torch.float16)
    tokens = torch.randint(0, 48, (T,), generator=torch.Generator().manual_seed(T))
    monkeypatch.setattr(fused_layers, "stack_enabled", False)  # the layers one by one (the stack: below)
    calls, attention_in = [], layer_ops.attention_in
    monkeypatch.setattr(layer_ops, "attention_in", lambda *a: calls.append(1) or attention_in(*a))
    fused = logits(model, tokens, True)
    assert len(calls) == len(model.layers)  # this pass's (the prefix's 40 tokens take the modules)
    monkeypatch.setattr(fused_layers, "enabled", False)
    assert torch.equal(fused, logits(model, tokens, True))
    assert len(calls) == len(model.layers)


CACHES = {
    "full": lambda model: FullCache(model.kv_shape(), 128),
    "streaming": lambda model: StreamingCache(model.kv_shape(), model.rotary, sinks=4, window=48, slack=16),
    "retrieval": lambda model: RetrievalCache(model.kv_shape(), budget=16, chunk_size=8, scratch=64),
}


@pytest.mark.parametrize("cache_kind", list(CACHES))
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16, None])
@pytest.mark.parametrize("T", [1, 7])
def test_a_stack_gives_the_layers_bits_one_call_a_pass(ggufs, monkeypatch, cache_kind, kv_dtype, T):
    """Every layer of a float32 pass in one call (fused_layers.stack, over any cache of plain slots):
    the logits, the cache's keys and values, and a full cache's kept queries of the layers called
    one by one; one call a pass, none into the layers' Python."""
    from triforce.model import fused_layers, layer_ops
    from triforce.speculative.caches import SlotCache

    model = load_gguf_model(ggufs / "llama.gguf", torch.float32, stored=True)
    use_kv_dtype(model, kv_dtype)
    tokens = torch.randint(0, 48, (T,), generator=torch.Generator().manual_seed(T))
    stacked, layer_calls = [], []
    run_stack, attention_in = SlotCache.run_stack, layer_ops.attention_in
    monkeypatch.setattr(SlotCache, "run_stack", lambda self, *a: stacked.append(run_stack(self, *a)) or stacked[-1])
    monkeypatch.setattr(layer_ops, "attention_in", lambda *a: layer_calls.append(1) or attention_in(*a))

    def pass_of(stack_on: bool):
        monkeypatch.setattr(fused_layers, "stack_enabled", stack_on)
        cache = CACHES[cache_kind](model)
        with torch.inference_mode():
            model(torch.arange(PREFIX) % 48, cache)  # more rows than a bound pass: the modules
            return model(tokens, cache), cache

    (logits_stacked, stacked_cache), (logits_layers, layers_cache) = pass_of(True), pass_of(False)
    assert len(stacked) == 1 and stacked[0] is not None and len(layer_calls) == len(model.layers)
    assert torch.equal(logits_stacked, logits_layers)
    assert torch.equal(stacked_cache.k, layers_cache.k) and torch.equal(stacked_cache.v, layers_cache.v)
    if cache_kind == "full":
        assert all(torch.equal(a, b) for a, b in zip(stacked_cache.queries, layers_cache.queries, strict=True))


def test_a_stack_leaves_a_cache_it_does_not_suit_to_the_layers(ggufs, monkeypatch):
    """A cache whose attention takes another route for these rows (keys in tiles; a dtype the kernels
    lack) runs the layers one by one: run_stack says so with None."""
    from triforce.model import fused_layers

    model = load_gguf_model(ggufs / "llama.gguf", torch.float32, stored=True)
    x = torch.zeros(1, model.cfg.hidden_size)
    stack = eager_steps.bound_stack(model, x)
    assert stack is not None
    cache = FullCache(model.kv_shape(), 64)
    cos, sin = model.rotary.cos_sin(torch.tensor([0]), x.dtype)
    for k, tiled in ((cache.k, True), (cache.k.double(), False)):
        monkeypatch.setattr(cache, "k", k)
        monkeypatch.setattr(cache, "tiled", tiled)
        assert cache.run_stack(stack, x, cos, sin) is None
    monkeypatch.setattr(fused_layers, "stack_enabled", False)
    assert eager_steps.bound_stack(model, x) is None


def test_layers_with_a_product_that_is_not_one_op_keep_their_steps(ggufs):
    """bf16 products choose AMX per call, dense ones are torch's: no fused layer for them."""
    from triforce.model import fused_layers

    for arch, dtype in (("llama", torch.bfloat16), ("qwen2", torch.float32)):
        model = load_gguf_model(ggufs / f"{arch}.gguf", dtype, stored=True)
        like = torch.zeros(eager_steps.MAX_ROWS, model.cfg.hidden_size, dtype=dtype)
        assert all(fused_layers.step(block, like) is None for block in model.layers), arch
        assert fused_layers.stack(model.layers, like) is None


class ModuleCalls:
    """Counts nn.Module calls (not forward methods called directly)."""

    def __init__(self, monkeypatch):
        self.count, call = 0, torch.nn.Module.__call__

        def counted(module, *args, **kwargs):
            self.count += 1
            return call(module, *args, **kwargs)

        monkeypatch.setattr(torch.nn.Module, "__call__", counted)


def test_a_bound_pass_calls_no_module_inside_its_layers(ggufs, monkeypatch):
    model = load_gguf_model(ggufs / "llama.gguf", torch.float32, stored=True)
    cache = FullCache(model.kv_shape(), 64)
    with torch.inference_mode():
        model(torch.arange(9), cache)
        outside = 4 if model.lm_head is not None else 3  # the model, its embedding, final norm and head
        calls = ModuleCalls(monkeypatch)
        model(torch.tensor([5]), cache)
        assert calls.count == outside
        eager_steps.enabled = False
        try:
            model(torch.tensor([6]), cache)
        finally:
            eager_steps.enabled = True
    assert calls.count - outside == outside + 9 * len(model.layers)  # the block, its norms, attention, MLP, four products


def test_a_pass_of_more_rows_or_with_hooks_runs_the_modules(ggufs):
    """Prefill pieces, the progress bar's watch and tensor parallelism's all-reduce (hooks on the
    layers' modules, which bound steps would skip) take the modules' path, pass by pass."""
    model = load_gguf_model(ggufs / "llama.gguf", torch.float32, stored=True)
    x = torch.zeros(1, model.cfg.hidden_size)
    assert eager_steps.bound_layers(model, x) is not None
    assert eager_steps.bound_layers(model, torch.zeros(eager_steps.MAX_ROWS + 1, model.cfg.hidden_size)) is None
    seen = []
    handles = [block.attention.register_forward_hook(lambda m, i, out: seen.append(out.shape)) for block in model.layers]
    assert eager_steps.bound_layers(model, x) is None
    with torch.inference_mode():
        model(torch.tensor([5]), FullCache(model.kv_shape(), 8))
    assert len(seen) == len(model.layers)
    for handle in handles:
        handle.remove()
    assert eager_steps.bound_layers(model, x) is not None


def test_an_int8_twin_computes_with_its_own_linears():
    """int8_twin's shallow copy shares the model's attributes but not its linears: it may not run on
    steps bound to the original's."""
    from triforce.model.config import ModelConfig
    from triforce.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_hf(hf_config(hidden=128, heads=2, kv_heads=1, inter=96).to_dict())).eval()
    tokens = torch.tensor([3, 1, 4])
    first = logits(model, tokens, True)
    twin = int8_twin(model)
    assert torch.equal(logits(twin, tokens, True), logits(twin, tokens, False))
    assert not torch.equal(logits(twin, tokens, True), first)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_moved_model_computes_with_its_new_tensors(ggufs, dtype):
    """_apply (.to() and the like) replaces the stored records: steps bound before it are dropped."""
    model = load_gguf_model(ggufs / "llama.gguf", dtype, stored=True)
    tokens = torch.tensor([3, 1, 4])
    first = logits(model, tokens, True)
    old = list(model.buffers())
    model._apply(lambda t: t.clone())
    for t in old:
        t.zero_()  # steps bound before the _apply would read these
    assert torch.equal(logits(model, tokens, True), first)
