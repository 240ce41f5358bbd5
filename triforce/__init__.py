"""Lossless hierarchical speculative decoding (TriForce) for long-context Llama-family models.

    import triforce
    result = triforce.generate("Once upon a time", max_new_tokens=64)
    result.text, result.settings, result.stats.to_dict()

Importing the package loads nothing heavy: torch and transformers load with the first name used.
"""
from __future__ import annotations

import importlib

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
