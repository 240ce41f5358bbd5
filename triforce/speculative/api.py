"""Token ids in, token ids out, for models already in memory (tests, benchmarks). The settings-level
API, which the command line uses too, is `triforce.generate` (triforce.runtime.api)."""
from __future__ import annotations

from dataclasses import dataclass

from .config import GenerationConfig
from .engine import Generator
from .models import Models
from .stats import Stats


@dataclass
class Result:
    tokens: list[int]
    text: str | None
    stats: Stats


def generate_ids(models: Models, prompt: list[int], mode: str, config: GenerationConfig,
                 max_len: int | None = None) -> Result:
    """Token ids in, token ids out, for in-memory models (tests, benchmarks)."""
    gen = Generator(models, config, mode, max_len=max_len or len(prompt) + config.max_new_tokens)
    gen.prefill(prompt)
    return Result(gen.generate(), None, gen.stats)

