"""MKL's vector math warmed on one thread before the model runs (triforce/model/first_calls.py)."""
import subprocess
import sys

import torch

from triforce.model import first_calls


def test_every_warmed_op_exists_and_takes_the_warm_input():
    # a later torch that renames or drops an op must fail here, not at the import of the model
    for dtype in first_calls.WARM_DTYPES:
        x = torch.linspace(0.1, 0.9, 64, dtype=dtype)
        for name in first_calls.VML_OPS:
            assert torch.isfinite(getattr(torch, name)(x)).all(), name


def test_the_ops_the_engine_calls_are_warmed():
    # the merge of prefill attention (exp), sampling (log), RoPE tables and norms (cos, sin, sqrt)
    assert {"exp", "log", "cos", "sin", "sqrt", "tanh"} <= set(first_calls.VML_OPS)
    assert set(first_calls.WARM_DTYPES) == {torch.float32, torch.float64}


def test_importing_the_model_warms_before_anything_else_runs():
    code = ("import torch\n"
            "from triforce.model import first_calls\n"
            "assert not first_calls._warmed\n"
            "import triforce.model.transformer\n"
            "assert first_calls._warmed\n"
            "assert first_calls.warm_vml() is False  # once per process\n"
            "print('warmed')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "warmed"
