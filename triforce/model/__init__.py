"""The model and nothing of the method: a Llama-family decoder (Llama 2/3, Qwen2, SmolLM2) that
attends through a cache object, its config, RoPE, attention kernels, checkpoint loading, weight-only
int8 twins, and tensor-parallel sharding. `speculative` (caches, engines) and `offload` (the KV tier
in host memory) both stand on this package; it imports neither. Names load on first use, so that
`triforce.model.errors` is importable without torch (the command line checks flags before torch)."""
import importlib

_EXPORTS = {"Cache": ".kv", "FullKV": ".kv", "KVShape": ".kv", "ModelConfig": ".config", "Transformer": ".transformer",
            "UserError": ".errors"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'triforce.model' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
