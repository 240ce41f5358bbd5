"""Lossless hierarchical speculative decoding (TriForce) for long-context Llama-family models."""
from .api import Loaded, Result, generate, generate_ids, load
from .config import GenerationConfig, ModelConfig
from .engine import MODES, Generator, Models
from .errors import UserError

__all__ = ["GenerationConfig", "Generator", "Loaded", "MODES", "ModelConfig", "Models", "Result", "UserError",
           "generate", "generate_ids", "load"]
