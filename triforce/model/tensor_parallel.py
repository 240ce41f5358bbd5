"""Tensor parallelism of the model, in one place: which weights each rank holds, and where the
partial outputs are summed.

Megatron-style sharding over `world_size` ranks: the column-parallel layers (the fused q/k/v and
gate/up projections) keep a 1/world slice of their output rows, so each rank owns whole attention
heads and a slice of the MLP; the row-parallel layers (attention's output and the MLP's down
projection) keep the matching slice of their input columns and produce partial sums. `apply_tp`
registers the sum as a forward hook on each attention and MLP module, so the model code has no
process-group plumbing and every copy that shares those modules (a self drafter, an int8 twin
built from them) reduces the same way. The loader reads each rank's slice straight from the
safetensors files (`shard`), never the whole tensor.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .config import ModelConfig
from .errors import UserError

COLUMN_PARALLEL = ("attention.wqkv", "mlp.w13")  # outputs split over ranks
ROW_PARALLEL = ("attention.wo", "mlp.w2")  # inputs split; outputs are partial sums


def check_shardable(cfg: ModelConfig, world_size: int) -> None:
    """Tensor parallelism splits heads and the MLP evenly over the ranks."""
    if cfg.num_kv_heads % world_size or cfg.num_heads % world_size or cfg.intermediate_size % world_size:
        raise UserError(f"tensor parallel degree {world_size} does not divide the model's {cfg.num_kv_heads} KV "
                        f"heads / {cfg.num_heads} heads; use Settings.tp 1 or a divisor of {cfg.num_kv_heads}")


def shard(layer: str, rank: int, world_size: int) -> dict:
    """How rank `rank` reads the weight of `layer` (e.g. "attention.wo"): the dimension split and its part."""
    if layer in COLUMN_PARALLEL:
        return dict(dim=0, part=rank, parts=world_size)
    if layer in ROW_PARALLEL:
        return dict(dim=1, part=rank, parts=world_size)
    return dict(dim=None)  # replicated


def apply_tp(model: nn.Module, all_reduce: Callable[[torch.Tensor], torch.Tensor],
             check: Callable[[torch.Tensor], None] | None = None) -> nn.Module:
    """Sum the row-parallel partial outputs of a sharded model with `all_reduce` (in place, returns x);
    with `check`, also hand every forward's logits to it (a cross-rank consistency check)."""
    if getattr(model, "tensor_parallel_applied", False):
        raise ValueError("tensor parallelism is already applied to this model")
    for block in model.layers:
        for module in (block.attention, block.mlp):
            module.register_forward_hook(lambda _module, _inputs, out: all_reduce(out))
    if check is not None:
        model.register_forward_hook(lambda _module, _inputs, logits: check(logits))
    model.tensor_parallel_applied = True
    return model
