"""The model and nothing of the method: a Llama-family decoder (Llama 2/3, Qwen2, SmolLM2) that
attends through a cache object, its config, RoPE, attention kernels, checkpoint loading, weight-only
int8 twins, and tensor-parallel sharding. `speculative` (caches, engines) and `offload` (the KV tier
in host memory) both stand on this package; it imports neither."""
from .config import ModelConfig
from .errors import UserError
from .kv import Cache, FullKV, KVShape
from .transformer import Transformer

__all__ = ["Cache", "FullKV", "KVShape", "ModelConfig", "Transformer", "UserError"]
