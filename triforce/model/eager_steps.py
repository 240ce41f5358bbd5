"""Eager CPU passes of a few rows through kernels chosen once per model and dtype, not once per call.

At 64 cached tokens a SmolLM2 float32 step on one avx2 core spends ~6 ms in its kernels and ~1.5 ms
more reaching them through the modules: eight nn.Module calls a layer, and on every call each product
asking which kernel serves its rows, each norm and rotation whether its one-call op does. Within a
model, a dtype and a pass of up to MAX_ROWS rows the answers never change, so this module takes them
once and keeps, per layer, its pass as a bound callable: two calls around the attention where every
product is one op (model/fused_layers.py), else its four steps (attention_norm, attention, mlp_norm,
mlp) bound (`rows_step` on the modules that have a choice to make). The kernels and their order are
the modules' own, so the bits are too (tests/model/test_eager_steps.py); 7.9 -> 6.4 ms a step there.

The modules' path stays for everything else: torch.compile (which traces the modules), GPUs (graphs
replay without Python), prefill pieces (their kernels dwarf the calls), and any model with hooks
(tensor parallelism's all-reduce, the progress bar's watch), which only module calls run.
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch import nn

from . import fused_layers, layer_ops
from .attention import SDPA_MIN_QUERIES

enabled = True  # off: every pass goes through the modules (`python -m bench.layer_calls --switch eager_steps`)
MAX_ROWS = SDPA_MIN_QUERIES - 1  # decode, draft and verification passes: those attention serves in one call

# per model, its layers' bound steps per (dtype, layer_ops.enabled); weak, and keyed by the model object:
# int8_twin's shallow copy shares the original's __dict__ but not its linears, so a plan kept there
# would compute the twin with the original's weights
_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def watched(model: nn.Module) -> bool:
    """Hooks on the model or its first layer (cli.progress.watch_layers during a prefill, tensor
    parallelism's all-reduce): bound steps and compiled or captured graphs would skip or trace them, so
    such a pass runs through the modules. The first layer stands for all (both hook every layer)."""
    hooked = _watch_list.get(model)
    if hooked is None:  # a model's modules stay; listing them walked ~12 of them every pass (30 us)
        layers = getattr(model, "layers", None)
        hooked = _watch_list[model] = (model, *(layers[0].modules() if layers else ()))
    return any(m._forward_pre_hooks or m._forward_hooks for m in hooked)


_watch_list: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per model: the modules `watched` reads


def bound_layers(model: nn.Module, x: torch.Tensor) -> list[Callable] | None:
    """Each layer's pass (x, cos, sin, cache, layer) -> x, bound for a pass of x (T, hidden), or None
    where the pass goes through the modules (module docstring)."""
    if (torch.compiler.is_compiling() or not enabled or x.device.type != "cpu" or x.shape[0] > MAX_ROWS
            or watched(model)):
        return None
    return _plan(model, x)[0]


def bound_stack(model: nn.Module, x: torch.Tensor):
    """Every layer of a pass of x in one call (fused_layers.stack), or None: where bound_layers gives
    None, or a layer is not two calls. The caller passes it to a cache that `runs_stack`."""
    if bound_layers(model, x) is None:
        return None
    return _plan(model, x)[1]


def _plan(model: nn.Module, x: torch.Tensor) -> tuple[list[Callable], object]:
    plans = _plans.setdefault(model, {})
    # bench.layer_calls switches these between runs
    key = (x.dtype, layer_ops.enabled, fused_layers.enabled, fused_layers.stack_enabled)
    if key not in plans:
        like = x.new_empty(MAX_ROWS, x.shape[-1])
        plans[key] = ([fused_layers.step(b, like) or layer_steps(b, like) for b in model.layers],
                      fused_layers.stack(model.layers, like))
    return plans[key]


def layer_steps(block: nn.Module, like: torch.Tensor) -> Callable:
    """block's pass as its four steps, bound for rows like `like`."""
    attention_norm, attention, mlp_norm, mlp = (step(m, like) for m in (block.attention_norm, block.attention,
                                                                         block.mlp_norm, block.mlp))

    def layer(x, cos, sin, cache, index: int):
        x = x + attention(attention_norm(x), cos, sin, cache, index)
        return x + mlp(mlp_norm(x))
    return layer


def forget(model: nn.Module) -> None:
    """Drop a model's bound steps: its tensors were moved or converted (Transformer._apply)."""
    _plans.pop(model, None)


def step(module: nn.Module, like: torch.Tensor) -> Callable:
    """module's forward for passes of rows like `like` (T, hidden): its `rows_step`, which chooses its
    kernels now, where it has one; else its forward (without nn.Module's call: no hooks here)."""
    choose = getattr(module, "rows_step", None)
    return module.forward if choose is None else choose(like)
