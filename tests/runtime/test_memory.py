"""runtime/memory.py: freed memory kept for the next tensors (glibc), measured by page faults in a
fresh process, since the setting is the process's."""
import os
import platform
import subprocess
import sys

import pytest

SCRIPT = """
import resource
import torch
from triforce.runtime.memory import reuse_freed_memory

torch.set_num_threads(1)  # one arena: worker threads' scratch would move the heap's settling

print(reuse_freed_memory())
# float32 over 1,024 tokens (bfloat16's products are emulated on CPUs without bf16 dot products: 72 s
# against 12 s, avx512 alone), an MLP twice SmolLM2's width: its 50 MB product is past the 32 MB up to
# which glibc's malloc may move its mmap threshold and settle without the setting (a 25 MB one did so
# in about one run in six here, and the control below failed), as a 7B model's products at 2,048 tokens are
x, up, down = torch.randn(1024, 576), torch.randn(576, 12288), torch.randn(6144, 576)


def faults(layers):  # a prefill piece's MLPs: a 50 MB product and its halves' intermediates, each layer
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    h = x
    for _ in range(layers):
        gate, value = (h @ up).chunk(2, dim=-1)
        h = (torch.nn.functional.silu(gate) * value) @ down
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


faults(12)  # the heap settles on the first layers (after 6, a loaded CI machine still saw 6K faults)
# Three windows: a loaded CI machine once saw one late 12 MB block (3,072 faults) in the first window
# after settling, and malloc as it is faulted 12-43K pages in every window seen.
print(*[faults(12) for _ in range(3)])
"""


def run(reuse: str) -> tuple[bool, list[int]]:
    env = {**os.environ, "TRIFORCE_REUSE_MEMORY": reuse}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    on, *faults = out.stdout.split()
    return on == "True", [int(f) for f in faults]


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_a_freed_tensor_is_reused_without_faulting_its_pages_again():
    """Twelve layers' MLPs with a 50 MB product: 184-295K page faults a window with malloc as it is
    (each such product comes from a fresh mapping), none once freed blocks are kept and the heap has
    settled (the fewest of three windows, so one late block on a loaded machine does not decide it)."""
    on, faults = run("1")
    assert on and min(faults) < 2000, faults
    off, faults = run("0")
    assert not off and max(faults) > 10000, faults


def test_the_setting_is_made_once_and_only_where_asked(monkeypatch):
    from triforce.runtime import memory

    calls = []
    monkeypatch.setattr(memory, "_mallopt", lambda: calls.append(1) or True)
    monkeypatch.setattr(memory, "_done", None)
    monkeypatch.setenv("TRIFORCE_REUSE_MEMORY", "0")
    assert memory.reuse_freed_memory() is False and calls == []
    monkeypatch.setattr(memory, "_done", None)
    monkeypatch.setenv("TRIFORCE_REUSE_MEMORY", "1")
    assert memory.reuse_freed_memory() is True and memory.reuse_freed_memory() is True and calls == [1]
