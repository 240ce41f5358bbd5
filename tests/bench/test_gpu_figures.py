"""bench.gpu_figures: one line and exit 2 without CUDA; its plan covers every figure issue 22 names."""
import subprocess
import sys

import pytest
import torch

from bench import gpu_figures


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_cuda_one_line_and_exit_2(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bench.gpu_figures", "--out", str(tmp_path / "x.json")],
                          capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout.strip() == "needs a CUDA GPU" and not done.stderr
    assert not (tmp_path / "x.json").exists()


def test_the_plan_covers_the_figures():
    plan = dict(gpu_figures.steps("m", 64))
    commands = [" ".join(argv) for argv in plan.values()]
    for offload in ("none", "host"):
        runs = [c for c in commands if f"--offload {offload}" in c and "bfloat16" in c]
        assert len(runs) == 2 and sum("--temperature" in c for c in runs) == 1
        assert all("4096,32768" in c and gpu_figures.OURS in c for c in runs)
    assert any("hf-static" in c for c in commands) and any("hf-offloaded" in c for c in commands)
    assert any(c.startswith("bench.linkbench") for c in commands)
    assert any("float32" in c and "--offload host" in c for c in commands)
    assert plan["graph == eager tokens"] == ["pytest", "-q", "tests/gpu"]
