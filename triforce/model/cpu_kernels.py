"""What the CPU kernels share (decode_attention.py, stored_bf16.py: bfloat16 on avx512_bf16;
stored_avx2.py: float32 on avx2): the CPU check, the build through torch's extension builder, and
the C++ helpers every kernel source starts with.

Each kernel module compiles its C++ at first use through torch's extension builder (a C++ compiler
and ninja, as --compile needs anyway; cached on disk across processes, and built ahead of a run with
progress by kernel_builds.py) into torch ops that torch.compile calls as
opaque kernels. A module whose build or self-check fails keeps torch's own ops.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .kv_dtype import cpu_flags

AVX512_BF16 = frozenset({"avx512f", "avx512bw", "avx512_bf16"})  # the bfloat16 kernels' code
AVX2 = frozenset({"avx2", "fma", "f16c"})  # the float32 kernels' code
# A CPU with avx512f (and no native bfloat16, so the model computes in float32: Xeons from Skylake-SP
# to Ice Lake) runs the float32 kernels as avx512f code, the same bits as their avx2 code
# (stored_avx2.py, decode_attention_f32.py). TRIFORCE_AVX512=0 keeps the avx2 code there too.
AVX512F = frozenset({"avx512f"})

CSRC = Path(__file__).with_name("csrc")  # the kernels' C++, as files a C++ editor and reader can take


def csrc(*names: str) -> str:
    """The text of these files of csrc/, joined in order: a kernel's source is its .cpp after the
    shared parts it uses (records.h: the stored blocks' decode; amx_frame.h: the AMX tile registers),
    and its build puts PRELUDE (prelude.h) before all (Kernel.text)."""
    return "".join((CSRC / name).read_text() for name in names)


PRELUDE = csrc("prelude.h")


def cpu_has(isa: frozenset[str] = AVX512_BF16) -> bool:
    return isa <= cpu_flags()


def wide_default() -> bool:
    """Whether the float32 kernels run their avx512f code: the CPU has it, TRIFORCE_AVX512 is not 0."""
    return cpu_has(AVX512F) and os.environ.get("TRIFORCE_AVX512", "1") != "0"


class WideCode:
    """Which code a float32 kernel module runs, its avx512f code or its avx2 code (the same bits):
    `use` switches the built module (its `use_avx512` op in torch.ops.`namespace`), `code` says."""

    def __init__(self, namespace: str, available: Callable[[], bool]):
        self.namespace, self.available, self.wide = namespace, available, False

    def use(self, on: bool) -> None:
        """Run the module's kernels as avx512f code (on: the CPU must have avx512f) or as avx2 code;
        the same bits either way (to time one against the other)."""
        import torch

        if on and not cpu_has(AVX512F):
            raise ValueError("this CPU has no avx512f")
        getattr(torch.ops, self.namespace).use_avx512(on)
        self.wide = on

    def code(self) -> str:
        """'avx512' or 'avx2' (the kernels built, else '')."""
        return ("avx512" if self.wide else "avx2") if self.available() else ""


_BUILT: dict[str, bool] = {}


@dataclass(frozen=True)
class Kernel:
    """One extension module: its C++ (after PRELUDE unless `prelude` is False), the CPU instructions
    its code uses (`isa`), the compiler's further flags, and `pool_ops`, the torch.ops namespace of
    a module whose kernels split work over threads (its use_pool op gets the process's pool,
    cpu_pool.py)."""

    name: str
    source: str
    isa: frozenset[str] = AVX512_BF16
    cflags: tuple[str, ...] = ()
    pool_ops: str = ""
    prelude: bool = True

    @property
    def text(self) -> str:
        return (PRELUDE if self.prelude else "") + self.source

    @property
    def flags(self) -> list[str]:
        return ["-O3", *self.cflags]

    @property
    def build_name(self) -> str:
        """The name with a hash of the source, flags, Python and torch (version and place): two
        checkouts or two environments keep a build each, instead of rebuilding one another's."""
        import sys

        import torch

        key = "\n".join([self.text, " ".join(self.flags), sys.version, torch.__version__, torch.__file__])
        return f"{self.name}_{hashlib.sha256(key.encode()).hexdigest()[:10]}"

    @property
    def directory(self) -> Path:
        from torch.utils.cpp_extension import get_default_build_root

        root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
        return Path(root) / "triforce" / self.build_name

    def fits(self) -> bool:
        """Whether this CPU has the instructions the code uses."""
        return cpu_has(self.isa)

    def compiled(self) -> bool:
        """Whether a build is on disk (loading it then takes a moment, not a compile)."""
        return (self.directory / f"{self.build_name}.so").exists()

    def load(self) -> bool:
        """Build (or find built) and load the module: whether it loaded. Once per process."""
        if self.name not in _LOADED:
            _LOADED[self.name] = _compile_and_load(self)
        return _LOADED[self.name]


_LOADED: dict[str, bool] = {}


_CONSTANT_RESULTS: list[Callable] = []


def constant_result(fn: Callable) -> Callable:
    """Mark fn (a kernel module's `available`) for torch.compile as returning a constant: dynamo then
    calls it at trace time and builds nothing of it inside a graph (torch.compiler.assume_constant_result).
    Marked when something compiles (`compile` below), not here: assume_constant_result imports
    torch._dynamo, a second of every eager run's start."""
    _CONSTANT_RESULTS.append(fn)
    return fn


def compile(fn: Callable, **options) -> Callable:
    """torch.compile(fn, **options), the kernel modules' `available` marked constant first."""
    import torch

    for marked in _CONSTANT_RESULTS:
        if torch.compiler.assume_constant_result(marked) is not marked:  # documented to return fn itself
            raise RuntimeError("torch.compiler.assume_constant_result wrapped the function: mark it at definition")
    return torch.compile(fn, **options)




def _compile_and_load(kernel: Kernel) -> bool:
    try:
        import fcntl

        from torch.utils.cpp_extension import load

        # torch's load_inline would start the source with <torch/extension.h> (pybind11, the C++
        # API), 14 of a module's 17 s of compiling; a file of our own includes only what it uses
        directory = kernel.directory
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / "build.flock", "w") as guard:
            # one process builds a module at a time; the kernel's lock goes with the process that
            # held it, however it ended. torch's own lock file does not: a build killed midway (the
            # machine shut down, the OOM killer) left it, and every later run waited on it forever
            fcntl.flock(guard, fcntl.LOCK_EX)
            (directory / "lock").unlink(missing_ok=True)  # held by no live build of ours: stale
            source = directory / "main.cpp"
            if not source.exists() or source.read_text() != kernel.text:
                source.write_text(kernel.text)
            load(kernel.build_name, [str(source)], extra_cflags=kernel.flags, build_directory=str(directory),
                 is_python_module=False)
        return True
    except Exception:  # noqa: BLE001 - not here, whatever the reason: the callers keep torch's ops
        return False


def built(kernel: Kernel, register_shapes: Callable[[], None], check: Callable[[], bool]) -> bool:
    """Whether `kernel` builds here, its ops' shapes registered for torch.compile, and passes `check`
    on a small case; only where the CPU has the instructions its code uses. Built and checked once
    per process: any failure (no compiler, no headers, an ISA the build rejects, a wrong result)
    means False."""
    if kernel.name not in _BUILT:
        _BUILT[kernel.name] = kernel.fits() and kernel.load() and _checked(
            register_shapes, check, kernel.pool_ops)
    return _BUILT[kernel.name]


def _checked(register_shapes: Callable[[], None], check: Callable[[], bool], pool_ops: str) -> bool:
    try:
        if pool_ops:
            import torch

            from . import cpu_pool

            getattr(torch.ops, pool_ops).use_pool(cpu_pool.address())
        register_shapes()
        return bool(check())
    except Exception:  # noqa: BLE001 - as in load
        return False
