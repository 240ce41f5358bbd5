"""A Llama-family decoder (Llama 2/3, Qwen2, SmolLM2) that attends through a cache object.

Batch size is one sequence: tokens are (T,). q/k/v and gate/up are fused into single matmuls
(fewer, larger kernels matter on CPU). Head counts are per-instance so tensor parallelism can
shard them; model/tensor_parallel.py sums the sharded partial outputs with forward hooks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import functools
from functools import partial

from . import cpu_pool, eager_steps, first_calls, key_tiles, kv_dtype, layer_ops
from .kv import KVShape
from .config import ModelConfig
from .rope import Rotary, apply_rotary

first_calls.warm_vml()  # before any threaded op: MKL's first-call race (first_calls.py)


# bench/op_forms.py times both forms on a GPU side by side (a 16-bit model's norm rounds once on CUDA,
# twice elsewhere, as transformers' does; every level of a run uses the same one, so modes agree)
ONE_CALL_NORM_ON_CUDA = True


def dense_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for a dense weight, each row with the bits it gets in any pass.

    A verification pass must give each token the logits its own decode step gives, or a bf16 near-tie
    resolves one way in plain decoding and the other way in a speculative mode. torch's CPU product of
    16-bit rows takes one kernel for a single row and another for two or more, which round differently
    (Qwen2.5-1.5B's 151,936 x 1,536 dense head: up to 0.016 apart in a logit; a chat answer's greedy
    text changed with the passes an adaptive run chose), while among two or more rows each row's result
    is independent of the others (tests/model/test_dense_rows.py checks this on the machine at hand).
    So a single 16-bit CPU row goes through the two-row kernel beside a copy of itself: as fast or
    faster (1 and 2 threads, Qwen's shapes), and the same bits as in any verification pass.

    Where the CPU has no bf16 dot product (a Xeon with avx512 but neither avx512_bf16 nor AMX, session
    40), oneDNN's product of 4 or more bf16 rows takes other kernels again, whose bits differ from
    the two-row kernel's, and an odd count's last rows differ from an even count's. There every pass
    goes through two-row products, rows in pairs: each row gets the bits it gets alone, at about the
    cost of one product of 4 rows per pair (SmolLM2's 49,152 x 576 head, 2 threads: 7.2 ms a pair,
    13.5 for 4 rows at once)."""
    if x.dim() == 2 and x.dtype in ROW_PAIRED_DTYPES and x.device.type == "cpu" and not torch.compiler.is_compiling():
        if x.shape[0] == 1:
            return F.linear(x.expand(2, -1), weight, bias)[:1]
        if not rows_share_kernels():
            return torch.cat([F.linear(x[r:r + 2] if r + 2 <= x.shape[0] else x[r:].expand(2, -1), weight, bias)
                              for r in range(0, x.shape[0], 2)])[:x.shape[0]]
    return F.linear(x, weight, bias)


ROW_PAIRED_DTYPES = (torch.bfloat16, torch.float16)  # float32's product (MKL) rounds rows by their count: no cure here


@functools.lru_cache(maxsize=None)
def rows_share_kernels() -> bool:
    """Whether oneDNN computes each of many 16-bit rows as it computes two (tests/model/
    test_dense_rows.py, on the machine at hand): seen where the CPU multiplies bf16 itself (an EPYC
    with avx512_bf16, a Xeon with AMX), not on a Xeon with avx512 alone."""
    return bool({"avx512_bf16", "amx_bf16"} & kv_dtype.cpu_flags())


class Linear(nn.Linear):
    """nn.Linear whose products are dense_product's: the same bits for a row whatever rows share its pass."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_product(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if layer_ops.serves(x) and self.weight.dtype == x.dtype:  # eager on CPU: one call where torch's is 6-9 kernels
            return layer_ops.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32 or (x.is_cuda and ONE_CALL_NORM_ON_CUDA and self.weight.dtype == x.dtype):
            # the weight inside: one call. On CUDA F.rms_norm is one fused kernel, which computes in
            # float32 and rounds once, where the form below is four (widen, norm, narrow, weight):
            # 6 of a layer's ~28 kernels, and a captured pass costs about its kernel count
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # float32 statistics, as the reference implementations do, then back to the model dtype and
        # times the weight in it (a 16-bit model rounds twice, as they do)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)

    def rows_step(self, like: torch.Tensor):
        """forward for eager passes of rows like `like`, the one-call norm chosen now (model/eager_steps.py)."""
        if layer_ops.serves(like) and self.weight.dtype == like.dtype:
            weight, eps = self.weight, self.eps
            return lambda x: layer_ops.rms_norm(x, weight, eps)
        return self.forward


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, cfg.head_dim
        self.wqkv = Linear(cfg.hidden_size, (n_heads + 2 * n_kv_heads) * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = Linear(n_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)

    def forward(self, x, cos, sin, cache, layer: int):
        return self._attend(x, cos, sin, cache, layer, self.wqkv, self._rotate, self.wo)

    def rows_step(self, like: torch.Tensor):
        """forward for eager passes of rows like `like`, each part's kernel chosen now (model/eager_steps.py)."""
        rotate = self._rotate
        if layer_ops.serves(like):
            heads, kv_heads = self.n_heads, self.n_kv_heads
            rotate = lambda qkv, cos, sin: layer_ops.rotary_qk(qkv, cos, sin, heads, kv_heads)  # noqa: E731
        return partial(self._attend, project_qkv=eager_steps.step(self.wqkv, like), rotate=rotate,
                       project_out=eager_steps.step(self.wo, like))

    def _attend(self, x, cos, sin, cache, layer: int, project_qkv, rotate, project_out):
        T, D = x.shape[0], self.head_dim
        qkv = project_qkv(x)
        q, k = rotate(qkv, cos, sin)
        v = qkv[:, (self.n_heads + self.n_kv_heads) * D:].view(T, self.n_kv_heads, D)
        return project_out(cache.attend(layer, q, k, v))

    def _rotate(self, qkv, cos, sin):
        """q and k, rotated, out of the fused projection."""
        if layer_ops.serves(qkv):  # eager on CPU: one call, the same bits, where torch's ops are 11
            return layer_ops.rotary_qk(qkv, cos, sin, self.n_heads, self.n_kv_heads)
        # q and k sit side by side in the fused projection: one rotation for both
        T, D, qk_heads = qkv.shape[0], self.head_dim, self.n_heads + self.n_kv_heads
        return apply_rotary(qkv[:, :qk_heads * D].view(T, qk_heads, D), cos, sin).split(
            [self.n_heads, self.n_kv_heads], dim=1)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate: int):
        super().__init__()
        self.intermediate = intermediate
        self.w13 = Linear(cfg.hidden_size, 2 * intermediate, bias=cfg.mlp_bias)  # gate, up
        self.w2 = Linear(intermediate, cfg.hidden_size, bias=cfg.mlp_bias)  # down

    def forward(self, x):
        return self._feed(x, self.w13, self.w2)

    def rows_step(self, like: torch.Tensor):
        """forward for eager passes of rows like `like`, each product's kernel chosen now (model/eager_steps.py)."""
        return partial(self._feed, gate_up=eager_steps.step(self.w13, like), down=eager_steps.step(self.w2, like))

    def _feed(self, x, gate_up, down):
        both = gate_up(x)
        # two slices, not Tensor.split: its Python wrapper took 4 us a layer of a ~180 us decode step
        return down(F.silu(both[..., :self.intermediate]) * both[..., self.intermediate:])


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, n_heads: int, n_kv_heads: int, intermediate: int):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention = Attention(cfg, n_heads, n_kv_heads)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, intermediate)

    def forward(self, x, cos, sin, cache, layer: int):
        x = x + self.attention(self.attention_norm(x), cos, sin, cache, layer)
        return x + self.mlp(self.mlp_norm(x))


def _embedding(vocab: int, hidden: int) -> nn.Embedding:
    if torch.get_default_device().type == "meta":  # the loaders build here, then load the weights
        # no init: nn.Embedding's normal_ on meta runs through torch's refs, which import torch._dynamo,
        # a second of every run's start
        return nn.Embedding.from_pretrained(torch.empty(vocab, hidden), freeze=False)
    return nn.Embedding(vocab, hidden)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, world_size: int = 1, max_len: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.world_size = world_size
        n_heads, n_kv = cfg.num_heads // world_size, cfg.num_kv_heads // world_size
        intermediate = cfg.intermediate_size // world_size
        self.embed = _embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, n_heads, n_kv, intermediate) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg, max_len)

    def kv_shape(self) -> KVShape:
        p = self.embed.weight
        # the cache may store fewer bits than the model computes with (model/kv_dtype.py)
        dtype = getattr(self, "kv_dtype", None) or p.dtype
        return KVShape(self.cfg.num_layers, self.layers[0].attention.n_kv_heads, self.cfg.head_dim,
                       dtype, p.device, key_tiles.serves(p.dtype, dtype, p.device, self.cfg.head_dim))

    def _apply(self, fn, recurse=True):
        eager_steps.forget(self)  # .to(), .float(), ...: the bound steps hold the old tensors
        self.__dict__.pop("_products_ours", None)
        return super()._apply(fn, recurse)

    def products_ours(self) -> bool:
        """Whether this model's products on CPU run through our kernels over stored blocks (and so
        over cpu_pool's threads), not torch's: asked once per model and dtype."""
        if "_products_ours" not in self.__dict__:
            dtype = self.embed.weight.dtype
            self._products_ours = any(
                m._records_kernels(torch.empty(1, m.in_features, dtype=dtype)) is not None
                for m in self.layers[0].modules() if hasattr(m, "_records_kernels"))
        return self._products_ours

    def forward(self, tokens: torch.Tensor, cache, last_only: bool = False) -> torch.Tensor:
        """tokens (T,) -> logits (T, vocab), or (1, vocab) for the last token only."""
        if tokens.device.type == "cpu" and not torch.compiler.is_compiling() and self.products_ours():
            # decode-sized passes on our products: torch's ops on one thread; longer ones on torch's
            few = tokens.shape[0] <= eager_steps.MAX_ROWS
            with cpu_pool.kernels_threaded() if few else cpu_pool.torch_threaded():
                return self._forward(tokens, cache, last_only)
        return self._forward(tokens, cache, last_only)

    def _forward(self, tokens: torch.Tensor, cache, last_only: bool) -> torch.Tensor:
        T = tokens.shape[0]
        positions = cache.begin(T)
        x = self.embed(tokens)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        layers = eager_steps.bound_layers(self, x)  # eager CPU passes of a few rows: kernels chosen once
        stack = eager_steps.bound_stack(self, x) if layers is not None and hasattr(cache, "run_stack") else None
        stacked = None if stack is None else cache.run_stack(stack, x, cos, sin)  # every layer in one call
        if stacked is not None:
            x = stacked
        else:
            for i, layer in enumerate(self.layers if layers is None else layers):
                x = layer(x, cos, sin, cache, i)
        cache.end(T)
        if last_only:
            x = x[-1:]
        x = self.norm(x)
        logits = dense_product(x, self.embed.weight) if self.lm_head is None else self.lm_head(x)
        return logits if logits.dtype == torch.float64 else logits.float()
