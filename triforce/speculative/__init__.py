"""The method: caches, sampling and verification, the engines (Generator), the adaptive chooser.
Names load on first use (`triforce.speculative.modes` is importable without torch)."""
import importlib

_EXPORTS = {"GenerationConfig": ".config", "Generator": ".engine", "MODES": ".modes", "Models": ".models",
            "Result": ".api", "generate_ids": ".api", "ModelConfig": "triforce.model.config",
            "UserError": "triforce.model.errors"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'triforce.speculative' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
