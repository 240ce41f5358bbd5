"""Weight-only int8 copies of a model for the levels that only propose (drafter, retrieval middle).

On CPU every level of the hierarchy reads the model's weights once per pass, and a single-token pass
is bound by that read (SmolLM2-135M: ~70 of ~95 ms at a short context). The proposing levels never
decide what is emitted, since the full-cache level verifies every token with the exact weights, so
their weights may be approximated without changing the output distribution: an approximation can only
lower acceptance. int8 with one scale per output channel halves the bytes read and, through torch's
fused CPU kernel, about halves the time of a one-token matmul.
"""
from __future__ import annotations

import copy
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from .errors import UserError
from .stored import PackedLinear

LOWER_WEIGHTS = ("same", "int8")
# torch's int8 kernel is a matrix-vector product per row: on this project's CPU (bf16, 1 thread, a
# 1536x576 layer) 0.043 ms for 1 row against 0.116 for the exact bf16 weights, 0.084 vs 0.125 for 4,
# 0.165 vs 0.136 for 8, 5.1 vs 0.44 ms for 256. Draft (1 row) and middle (gamma1 + 1 rows) passes take
# it; prefill and the drafter's window refill (hundreds of rows) read the exact weights instead.
INT8_KERNEL_MAX_ROWS = 6


class Int8Linear(nn.Module):
    """y = x W^T + b with W stored as int8 rows times a per-row scale (symmetric, absmax)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        rows, scale = _quantize_rows(weight.detach())
        self.register_buffer("weight", rows)
        self.register_buffer("scale", scale)
        self.bias = bias  # shared with the exact layer, not copied
        self.exact = weight  # likewise: what passes of many rows read (a plain attribute, not state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] > INT8_KERNEL_MAX_ROWS and x.dtype == self.exact.dtype:
            return F.linear(x, self.exact, self.bias)
        if rows.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float16):
            out = torch._weight_int8pack_mm(rows, self.weight, self.scale)  # fused dequantizing GEMM
        else:  # float64 tests, other devices: correct, not fast
            out = F.linear(rows, self.weight.to(x.dtype)) * self.scale.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], -1)


QUANTIZE_BLOCK_ELEMENTS = 1 << 20  # 4 MB of fp32 rows at a time: the passes below stay in cache


def _quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: scale = absmax / 127 (rounded up to w's dtype, which the kernel takes) and the int8
    round(w / scale). A block of rows at a time, in place: Qwen2.5-1.5B's whole-tensor version made
    five fp32 copies of every weight and took 46 s of a chat's start (bf16 aminmax alone: 12 s)."""
    out = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scale = torch.empty(w.shape[0], dtype=w.dtype, device=w.device)
    step = max(1, QUANTIZE_BLOCK_ELEMENTS // max(1, w.shape[1]))
    for row in range(0, w.shape[0], step):
        block = w[row:row + step].to(torch.float32, copy=True)  # never the weight itself (fp32)
        exact = (block.abs().amax(dim=1) / 127).clamp_min(torch.finfo(w.dtype).tiny)
        rounded = exact.to(w.dtype)
        rounded = torch.where(rounded.float() < exact, torch.nextafter(rounded, torch.full_like(rounded, float("inf"))),
                              rounded)
        scale[row:row + step] = rounded
        out[row:row + step] = block.div_(rounded.float()[:, None]).round_().clamp_(-127, 127)
    return out, scale


def _quantized(linear: nn.Linear) -> Int8Linear:
    return Int8Linear(linear.weight, linear.bias)


def int8_twin(model: nn.Module) -> nn.Module:
    """A shallow copy of `model` whose matmul weights (attention, MLP, output head) are int8.

    Embeddings, norms, RoPE tables and the tensor-parallel all-reduce hook are shared with `model`;
    each rank of a sharded model quantizes its own shard (scales are per output row, so this is exact
    to the same rounding as an unsharded model's)."""
    twin = copy.copy(model)
    twin._modules = dict(model._modules)
    layers = []
    for block in model.layers:
        b = copy.copy(block)
        b._modules = dict(block._modules)
        attention, mlp = copy.copy(block.attention), copy.copy(block.mlp)
        attention._modules = {"wqkv": _quantized(block.attention.wqkv), "wo": _quantized(block.attention.wo)}
        mlp._modules = {"w13": _quantized(block.mlp.w13), "w2": _quantized(block.mlp.w2)}
        b._modules.update(attention=attention, mlp=mlp)
        layers.append(b)
    twin._modules["layers"] = nn.ModuleList(layers)
    head = model.embed.weight if model.lm_head is None else model.lm_head.weight
    twin._modules["lm_head"] = Int8Linear(head, None)
    return twin


def resolve_lower_weights(kind: str, device, dtype: torch.dtype = torch.bfloat16) -> str:
    """`auto` is int8 for bf16/fp16 on CPU, where the proposing levels are bound by reading weights
    and torch has a fused int8 kernel (measured: a draft pass 1.3-1.4x faster on SmolLM2 and
    Qwen2.5-0.5B, a middle pass 1.1-1.4x on Qwen2.5-1.5B at 32K), and the exact weights elsewhere:
    in float32 the kernel is slower than the exact matmul (0.58 vs 0.13 ms for one row)."""
    if kind != "auto":
        return kind
    cheaper = torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float16)
    return "int8" if cheaper else "same"


def lower_weights_for(model: nn.Module, kind: str) -> nn.Module | None:
    """The model the proposing levels run for `--lower-weights kind`; None means the model itself."""
    if kind not in LOWER_WEIGHTS:
        raise UserError(f"unknown Settings.lower_weights '{kind}': choose one of {', '.join(LOWER_WEIGHTS)}")
    if kind == "same" or any(isinstance(m, PackedLinear) for m in model.modules()):
        return None  # weights as stored (4-8 bits) already read fewer bytes than an int8 twin would
    if model.embed.weight.device.type != "cpu":
        raise UserError("Settings.lower_weights int8 is for the CPU path (torch's fused int8 kernel is CPU-only); "
                        "use Settings.lower_weights same on a GPU")
    return int8_twin(model)


def with_lower_weights(models, kind: str, target: bool = True, drafter: bool = True):
    """`models` (engine.Models) with its proposing levels reading `kind` weights: the target's as the
    retrieval middle or a self drafter reads them (`target`), and a separate drafter's (`drafter`).
    A level no mode of the run uses gets no copy (a Qwen2.5-1.5B twin takes seconds and 1.5 GB)."""
    if kind not in LOWER_WEIGHTS:
        raise UserError(f"unknown Settings.lower_weights '{kind}': choose one of {', '.join(LOWER_WEIGHTS)}")
    if kind == "same":
        return models
    # a drafter with no cheaper copy (weights as stored) stays itself: None would mean "the target drafts"
    draft = (lower_weights_for(models.drafter, kind) if drafter and models.drafter is not None else None) or models.drafter
    proposing = lower_weights_for(models.target, kind) if target else models.proposing_target
    return replace(models, proposing_target=proposing, drafter=draft)
