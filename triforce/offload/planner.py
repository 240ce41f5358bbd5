"""What stays on the device: weights, drafter, retrieval cache, on-chip KV layers, staging buffers.

Pure arithmetic over a `Request` and a free-memory figure, so it is unit-tested with made-up
figures; `free_device_memory` measures the real one. The plan is made before the KV cache is
allocated; a request that cannot fit fails with one line naming the shortfall and the fix.

Streaming needs two staging slots (double buffer) of one layer's K and V at the maximum context;
every on-chip layer costs one more layer of K and V and saves its share of each pass's copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from triforce.model.kv import KVShape
from triforce.model.errors import UserError

GiB = 2**30
DEFAULT_WORKSPACE = 512 * 2**20  # activations, logits, allocator slack


@dataclass(frozen=True)
class Request:
    num_layers: int
    layer_token_bytes: int  # K and V of one token in one layer
    max_len: int
    weights: int = 0  # target + drafter parameters still to be placed (0 when already loaded)
    retrieval_cache: int = 0
    drafter_cache: int = 0
    workspace: int = DEFAULT_WORKSPACE
    onchip_layers: int | None = 0  # None: as many as fit
    offload: bool = True  # False: the whole KV cache must be resident

    @property
    def layer_bytes(self) -> int:
        return self.layer_token_bytes * self.max_len

    @property
    def fixed(self) -> int:
        return self.weights + self.retrieval_cache + self.drafter_cache + self.workspace

    def staging(self, onchip: int) -> int:
        return min(2, self.num_layers - onchip) * self.layer_bytes

    def need(self, onchip: int) -> int:
        return self.fixed + onchip * self.layer_bytes + self.staging(onchip)


@dataclass(frozen=True)
class Plan:
    free: int
    onchip_layers: int
    staging: int
    onchip_kv: int
    fixed: int

    @property
    def used(self) -> int:
        return self.fixed + self.onchip_kv + self.staging

    @property
    def headroom(self) -> int:
        return self.free - self.used


def plan(req: Request, free: int) -> Plan:
    """Decide on-chip layers; raise UserError when the request cannot fit in `free` bytes."""
    L = req.num_layers
    if not req.offload:
        need = req.fixed + L * req.layer_bytes
        if need > free:
            raise UserError(f"the whole KV cache does not fit on the device: {_short(need, free)} "
                            f"({_parts(req, L)}); use Settings.offload host, or lower Settings.context or GenerationConfig.budget")
        return Plan(free, L, 0, L * req.layer_bytes, req.fixed)
    fitting = [n for n in range(L + 1) if req.need(n) <= free]
    if req.onchip_layers is None:
        if not fitting:
            raise UserError(f"offloading does not fit on the device: {_short(req.need(0), free)} "
                            f"({_parts(req, 0)}); {_fix(req, free)}")
        n = max(fitting)
    else:
        n = req.onchip_layers
        if not 0 <= n <= L:
            raise UserError(f"Settings.onchip_layers {n} is outside 0..{L} (the model has {L} layers)")
        if req.need(n) > free:
            hint = f"use Settings.onchip_layers {max(fitting)}" if fitting else _fix(req, free)
            raise UserError(f"offloading with {n} on-chip layers does not fit on the device: "
                            f"{_short(req.need(n), free)} ({_parts(req, n)}); {hint}")
    return Plan(free, n, req.staging(n), n * req.layer_bytes, req.fixed)


def _short(need: int, free: int) -> str:
    return f"needs {need / GiB:.2f} GiB, {free / GiB:.2f} GiB free, {(need - free) / GiB:.2f} GiB missing"


def _parts(req: Request, onchip: int) -> str:
    parts = [("weights", req.weights), ("retrieval cache", req.retrieval_cache), ("drafter cache", req.drafter_cache),
             ("workspace", req.workspace), (f"{onchip} on-chip layers", onchip * req.layer_bytes),
             ("staging", req.staging(onchip))]
    return ", ".join(f"{name} {b / GiB:.2f}" for name, b in parts if b)


def _fix(req: Request, free: int) -> str:
    """The change that makes a zero-on-chip plan fit: a shorter context if that is enough."""
    room = free - req.fixed
    if room > 0:
        tokens = room // (2 * req.layer_token_bytes)
        return f"lower Settings.context to about {tokens} tokens, or lower GenerationConfig.budget"
    return "lower GenerationConfig.budget or use a smaller model (weights and fixed caches alone exceed free memory)"


# ---------------------------------------------------------------------- measuring and sizing
def free_device_memory(device) -> int:
    """Bytes the next allocations can use: the driver's free figure (the smaller of pynvml's and
    torch's, which agree unless another process races us) plus what torch's allocator has cached."""
    device = torch.device(device)
    free, _ = torch.cuda.mem_get_info(device)
    try:
        import pynvml

        pynvml.nvmlInit()
        bus = torch.cuda.get_device_properties(device).pci_bus_id
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus.encode() if isinstance(bus, str) else bus)
        free = min(free, pynvml.nvmlDeviceGetMemoryInfo(handle).free)
    except Exception:  # nvidia-ml-py missing, or an old torch without pci_bus_id: torch's figure stands
        pass
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def shape_request(shape: KVShape, max_len: int, onchip_layers: int | None = 0, reserve: int = 0,
                  workspace: int = DEFAULT_WORKSPACE) -> Request:
    """The request for a full cache of `shape`, with `reserve` bytes kept for caches made after it."""
    return Request(shape.num_layers, shape.bytes_per_token // shape.num_layers, max_len,
                   retrieval_cache=reserve, workspace=workspace, onchip_layers=onchip_layers)
