"""Each of MKL's vector math functions called once, on one thread, before any op runs threaded.

torch sends contiguous float32/float64 unary ops on CPU (exp, log, cos, sqrt ...) to MKL's VML, one
call per intra-op thread on its chunk, asking for high accuracy. The oneMKL that torch's wheels carry
(2024.2) picks each function's kernel lazily, on that function's first call, and when two threads
make the first call at once one of them can run a low-accuracy kernel over its whole chunk, that
once (pytorch/pytorch#188792). Here that was the merge of a prefill piece's two attention parts
(attention._attend_past_and_piece): the first `torch.exp` of a process gave weights up to 1,772 ulps
off for the heads in the main thread's half, in about 1 process in 20 under load, and a 16K greedy
run parted from the others at a near-tie. Session 30's float32 cos that "moved between processes"
was probably the same race. A 64-element call runs on the calling thread alone, so calling every
such function once at import settles its kernel before any threaded use; it costs about a
millisecond.
"""
from __future__ import annotations

import torch

# the unary ops ATen's vml.h may route to MKL (a superset: an op that does not costs a few us)
VML_OPS = ("acos", "asin", "atan", "cos", "cosh", "erf", "erfc", "erfinv", "exp", "expm1", "lgamma", "log",
           "log10", "log1p", "log2", "sin", "sinh", "sqrt", "tan", "tanh", "trunc")
WARM_DTYPES = (torch.float32, torch.float64)
_warmed: list[bool] = []


def warm_vml() -> bool:
    """Call each VML-backed op once per dtype on this thread; the first call in a process does the
    work, later calls return at once. Returns whether this call warmed."""
    if _warmed:
        return False
    for dtype in WARM_DTYPES:
        x = torch.linspace(0.1, 0.9, 64, dtype=dtype)  # inside every op's domain; below any op's grain
        for name in VML_OPS:
            getattr(torch, name)(x)
    _warmed.append(True)
    return True
