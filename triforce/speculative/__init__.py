"""Lossless hierarchical speculative decoding (TriForce) for long-context Llama-family models."""
from .api import Loaded, Result, generate, generate_ids, load
from triforce.model.config import ModelConfig
from triforce.model.errors import UserError

from .config import GenerationConfig
from .engine import MODES, Generator, Models

__all__ = ["GenerationConfig", "Generator", "Loaded", "MODES", "ModelConfig", "Models", "Result", "UserError",
           "generate", "generate_ids", "load"]
