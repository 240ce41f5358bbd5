"""bfloat16 products of rows with weights as stored (GGUF blocks) through AMX tiles, on CPUs with
AMX (Intel Sapphire Rapids and later): stored_bf16's records and arithmetic, with each block's
products summed by one tile instruction for up to 16 rows of x at once.

stored_bf16's avx512 kernels multiply every row of x by a block's decoded codes with 16 dpbf16
instructions, so a pass over T rows costs T times the arithmetic: on a Xeon with AMX and 16 GB/s of
memory, SmolLM2's weights took 2.1x as long for 7 rows as for one (the byte floor is the same).
Here a block of 32 columns and 16 output rows is decoded once (stored_bf16's table lookups) into a
tile of bfloat16 pairs, and TDPBF16PS sums it against a tile of up to 16 rows of x: the same exact
products (bfloat16 codes times bfloat16 x), float32 sums in the tile's order, then each row's block
sum scaled by d (and the min term m * sum(x) for Q4) in float32 as stored_bf16 does. Each row of the
tile is its own sum, whatever rows share it, so a verification pass gives each token the bits of its
one-token pass; that holds only if the one-token pass takes this path too, so on a CPU with AMX every
bfloat16 product over records does (stored_bf16 routes to it once `available()` says so).

AMX state is asked of Linux once per process (arch_prctl ARCH_REQ_XCOMP_PERM); each task loads its
tile configuration and releases the tiles when done, so torch's own AMX GEMMs (oneDNN) and ours may
run on the same threads.
"""
from __future__ import annotations

import os

import torch

from . import cpu_kernels

AMX = cpu_kernels.AVX512_BF16 | frozenset({"amx_tile", "amx_bf16"})
# TRIFORCE_AMX=0: the avx512 kernels on an AMX CPU too (to time one against the other)
OFF = os.environ.get("TRIFORCE_AMX", "1") == "0"

SOURCE = cpu_kernels.csrc("records.h", "amx_frame.h", "stored_amx.cpp")

KERNEL = cpu_kernels.Kernel("triforce_stored_amx", SOURCE, isa=AMX, pool_ops="triforce_stored_amx")


@cpu_kernels.constant_result  # torch.compile asks at trace time, and builds nothing inside a graph
def available() -> bool:
    """Whether this CPU has AMX, Linux lends its tiles, and the kernels build here and compute the
    dequantized product on a small case. Asked once per process; False keeps stored_bf16's avx512
    kernels for every row count."""
    return not OFF and cpu_kernels.built(KERNEL, _register_shapes, _self_check)


def _register_shapes() -> None:
    from .stored_bf16 import register_shapes

    register_shapes("triforce_stored_amx")


def _self_check() -> bool:
    from .stored_bf16 import _self_check as check

    ops = torch.ops.triforce_stored_amx
    return bool(ops.enable()) and check(ops.q4_product, ops.q8_product)
