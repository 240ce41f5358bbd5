"""Lossless hierarchical speculative decoding (TriForce) for long-context Llama-family models.

    import triforce
    result = triforce.generate("Once upon a time", max_new_tokens=64)
    result.text, result.settings, result.stats.to_dict()

Importing the package loads nothing heavy: torch and transformers load with the first name used.
"""
from __future__ import annotations

import getpass
import importlib
import os
import tempfile


def _inductor_cache_per_isa() -> None:
    """torch.compile's on-disk caches do not key on ATEN_CPU_CAPABILITY: a graph built under avx2 and
    served to a process without it (or the reverse) ran with the other ISA's vector width and wrote
    past its buffers ("double free or corruption"). A process that sets the capability gets a cache
    folder of its own, unless it chose one."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    if capability and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        try:
            user = getpass.getuser()
        except Exception:  # noqa: BLE001 - no user name (a container): any stable name will do
            user = "user"
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"torchinductor_{user}_{capability}")


_inductor_cache_per_isa()

_EXPORTS = {
    "generate": "triforce.runtime.api", "Result": "triforce.runtime.api", "Settings": "triforce.runtime.settings",
    "Session": "triforce.runtime.session",
    "GenerationConfig": "triforce.speculative.config", "Generator": "triforce.speculative.engine",
    "Models": "triforce.speculative.models", "MODES": "triforce.speculative.modes",
    "ModelConfig": "triforce.model.config", "UserError": "triforce.model.errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'triforce' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
