"""The CPU kernels compiled ahead of a run, with progress and an honest time left
(triforce/model/kernel_builds.py), and the run saying so before its weights load."""
import io
import threading

import pytest
import torch
from rich.console import Console

from triforce.cli.common import loading_status
from triforce.model import cpu_kernels, kernel_builds
from triforce.model.kernel_builds import BuildClock, compile_all


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_time_left_waits_for_a_module_then_counts_the_rest():
    now = FakeClock()
    clock = BuildClock(total=4, workers=2, now=now)
    a, b = clock.started(), clock.started()
    now.t += 8
    assert clock.seconds_left() is None  # nothing done: no pace measured yet
    assert clock.line() == "compiling the CPU kernels (first run here): 0 of 4 done, 8 s"
    clock.finished(a)
    c = clock.started()
    # b has had 8 of the 8 s a module takes (a second at least), c none, one module waits for a worker
    assert clock.seconds_left() == pytest.approx(8 + 8)
    clock.finished(b)
    clock.started()
    now.t += 2
    # two under way for 2 s of a mean 8 s: 6 s left, none waiting
    assert clock.seconds_left() == pytest.approx(6)
    assert clock.line().endswith("2 of 4 done, 10 s, about 6 s left")
    now.t += 7  # slower than the mean: at least a second left, never a negative time
    assert clock.seconds_left() == pytest.approx(1)
    clock.finished(c)
    assert clock.durations == [8, 8, 9]


class Gate:
    """A module whose build takes until the test opens it."""

    def __init__(self, name):
        self.name, self.opened, self.loaded = name, threading.Event(), False

    def load(self):
        assert self.opened.wait(30)
        self.loaded = True
        return True


def test_compile_all_reports_while_modules_build_and_once_at_the_end(monkeypatch):
    monkeypatch.setattr(kernel_builds, "REPORT_SECONDS", 0.01)
    gates = [Gate("a"), Gate("b"), Gate("c")]
    lines = []

    def report(line):
        lines.append(line)
        if len(lines) == 3:  # the clock has moved twice with nothing built: let them finish
            for gate in gates:
                gate.opened.set()

    assert compile_all(gates, report, workers=2) == 3
    assert all(g.loaded for g in gates)
    assert lines[0].startswith("compiling the CPU kernels (first run here): 0 of 3 done")
    assert lines[-1].startswith("compiled the CPU kernels in ")
    assert len(lines) >= 4


def test_nothing_to_compile_says_nothing():
    lines = []
    assert compile_all([], lines.append) == 0 and lines == []


def test_a_module_that_fails_to_build_does_not_stop_the_others():
    class Broken:
        def load(self):
            raise RuntimeError("no compiler")

    ok = Gate("ok")
    ok.opened.set()
    class Refused:  # Kernel.load's way: no compiler, no headers
        name = "triforce_refused"

        def load(self):
            return False

    lines = []
    # the run goes on: their callers keep torch's ops, and the last line says which did not build
    assert compile_all([Broken(), ok, Refused()], lines.append, workers=1) == 3
    assert ok.loaded
    assert lines[-1].startswith("compiled 1 of 3 CPU kernels in ")
    assert "triforce_refused" in lines[-1] and "C++ compiler" in lines[-1] and "torch's ops" in lines[-1]


def test_the_modules_a_run_needs_follow_dtype_and_weights():
    names = lambda dtype, stored: {k.name for k in kernel_builds.kernels(dtype, stored)}  # noqa: E731
    if cpu_kernels.cpu_has(cpu_kernels.AVX512_BF16):
        assert "triforce_stored_bf16" in names(torch.bfloat16, True)
        assert "triforce_stored_bf16" not in names(torch.bfloat16, False)
        assert "triforce_decode_attention" in names(torch.bfloat16, False)
    if cpu_kernels.cpu_has(cpu_kernels.AVX2):
        assert {"triforce_decode_attention_f32", "triforce_stored_f32"} <= names(torch.float32, True)
        assert "triforce_stored_f32" not in names(torch.float32, False)
    assert {"triforce_cpu_pool", "triforce_layer_ops"} <= names(torch.float32, False)
    assert names(torch.float64, True) == {"triforce_cpu_pool", "triforce_layer_ops"}


def test_a_build_is_named_by_its_source_and_torch():
    kernel = cpu_kernels.Kernel("triforce_probe", "int x;")
    other = cpu_kernels.Kernel("triforce_probe", "int y;")
    assert kernel.build_name != other.build_name and kernel.build_name.startswith("triforce_probe_")
    assert kernel.directory.name == kernel.build_name


def test_a_log_gets_the_first_line_and_the_end():
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    with loading_status(console, "loading m") as update:
        update("compiling the CPU kernels (first run here): 0 of 2 done, 0 s")
        update("compiling the CPU kernels (first run here): 1 of 2 done, 1 s, about 1 s left")
        update("compiled the CPU kernels in 2 s (once per machine)")
        update("loading m")
    assert out.getvalue().splitlines() == ["compiling the CPU kernels (first run here): 0 of 2 done, 0 s",
                                           "compiled the CPU kernels in 2 s (once per machine)"]


def test_a_session_compiles_before_loading_and_says_so(monkeypatch, tiny_folder):
    from triforce.runtime.session import Session
    from triforce.runtime.settings import make_settings

    built = Gate("kernel")
    built.opened.set()
    asked = []

    def kernels(dtype, stored):
        asked.append((dtype, stored))
        return [built]

    monkeypatch.setattr(kernel_builds, "kernels", kernels)
    monkeypatch.setattr(Gate, "compiled", lambda self: self.loaded, raising=False)
    said = []

    class Loading:
        def __init__(self, what):
            said.append(("enter", what))

        def __enter__(self):
            return said.append

        def __exit__(self, *exc):
            said.append(("exit",))

    run = make_settings(None, None, model=str(tiny_folder), dtype="float32", device="cpu", threads=1)
    Session(run, "t5 t6 t7", loading=Loading).load()
    assert asked == [(torch.float32, False)]  # a folder with no GGUF origin: no stored products
    assert built.loaded
    lines = [s for s in said if isinstance(s, str)]
    assert lines[0].startswith("compiling the CPU kernels") and lines[-2].startswith("compiled the CPU kernels")
    assert lines[-1].startswith("loading ") and said[-1] == ("exit",)


def test_a_build_killed_midway_does_not_hang_the_next_run(tmp_path):
    """torch's build lock is a file that outlives a killed process; the next build must not wait on
    it forever. A child process builds a tiny module over a stale lock, within a time limit."""
    import os
    import subprocess
    import sys

    code = (
        "from triforce.model import cpu_kernels\n"
        "k = cpu_kernels.Kernel('triforce_stale_lock_probe', '#include <torch/library.h>\\n"
        "TORCH_LIBRARY(triforce_stale_lock_probe, m) { m.def(\"f(Tensor x) -> Tensor\"); }\\n', "
        "isa=frozenset(), prelude=False)\n"
        "k.directory.mkdir(parents=True)\n"
        "(k.directory / 'lock').touch()  # as a killed build leaves it\n"
        "print('built', k.load(), k.compiled(), not (k.directory / 'lock').exists())\n")
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "built True True True", done.stderr[-2000:]
