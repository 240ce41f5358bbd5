"""Tensor parallelism: process groups over torch.distributed (NCCL on GPUs, gloo on CPU).

Sharded loading lives in speculative/loader.py (each rank reads its slices from safetensors);
this package joins the group torchrun started and installs the all-reduce into the model.
"""
from .dist import TensorParallel, resolve_device, setup_tensor_parallel

__all__ = ["TensorParallel", "resolve_device", "setup_tensor_parallel"]
