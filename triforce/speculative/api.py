"""The Python entry point: load a target and a drafter, generate, get tokens and statistics.

    from triforce.speculative import generate, GenerationConfig
    result = generate("models/smollm2-135m", "self", "Once upon a time", mode="triforce",
                      config=GenerationConfig(max_new_tokens=64, budget=512))
    result.tokens, result.text, result.stats.to_dict()
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from triforce.model.config import ModelConfig
from triforce.model.errors import UserError
from triforce.model.loader import load_model, load_tokenizer, same_tokenizer, same_tokenizer_files
from triforce.model.rope import Rotary, scaled_for

from .config import GenerationConfig
from .engine import Generator, Models
from .retrieval import mode_for_prompt
from .stats import Stats

log = logging.getLogger("triforce")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64, "float16": torch.float16}


@dataclass
class Loaded:
    models: Models
    tokenizer: object
    target_config: ModelConfig


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype '{dtype}': choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load(target: str | Path, draft: str | Path | None = "self", dtype: str | torch.dtype = "float32",
         device: str = "cpu", target_config: ModelConfig | None = None, max_len: int | None = None,
         rank: int = 0, world_size: int = 1, progress: Callable | None = None, rope_scaling: str = "auto",
         tokenizer=None) -> Loaded:
    """Load the target (sharded when world_size > 1) and the drafter (replicated; None/'self' = target).
    `tokenizer`: the target's, when the caller has already loaded it.

    Without `target_config`, the target's RoPE is scaled for `max_len` tokens by `rope_scaling`
    (model.rope.scaled_for: the command line's rule), said in one line when it is."""
    dtype = resolve_dtype(dtype)
    cfg = target_config
    if cfg is None:
        cfg, note = scaled_for(ModelConfig.from_folder(target), max_len or 0, rope_scaling)
        if note:
            log.warning(note)
    model = load_model(target, dtype, device, cfg, max_len, rank, world_size, progress)
    tokenizer = tokenizer or load_tokenizer(target)
    drafter, self_rotary = None, None
    if draft in (None, "self"):
        native = ModelConfig.from_folder(target)
        if native.rope_scaling != cfg.rope_scaling:  # a scaling added for this run's long context
            self_rotary = Rotary(native)
    else:
        draft_cfg = ModelConfig.from_folder(draft)
        if not (same_tokenizer_files(target, draft) or same_tokenizer(tokenizer, load_tokenizer(draft))):
            raise UserError(f"the drafter {draft} uses a different tokenizer from the target {target}; "
                            f"pick a drafter of the same model family or --draft self")
        drafter = load_model(draft, dtype, device, draft_cfg)
    return Loaded(Models(model, drafter, self_rotary), tokenizer, cfg)


@dataclass
class Result:
    tokens: list[int]
    text: str | None
    stats: Stats


def generate(target: str | Path | Loaded, draft: str | Path | None, prompt: str | list[int], mode: str = "triforce",
             config: GenerationConfig | None = None, dtype: str | torch.dtype = "float32", device: str = "cpu",
             on_tokens: Callable | None = None, rope_scaling: str = "auto") -> Result:
    """Generate from a prompt (text or token ids); returns the new token ids and statistics.

    The rules of the command line apply: a prompt plus new tokens longer than the checkpoint's
    positions gets YaRN RoPE scaling (`rope_scaling`, as --rope-scaling), and a prompt too short to
    retrieve from runs without the retrieval level; each is said in one line (logging, warning)."""
    config = config or GenerationConfig()
    if isinstance(target, Loaded):
        loaded = target
        ids = loaded.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        needed = len(ids) + config.max_new_tokens
        if needed > loaded.target_config.max_positions:
            raise UserError(f"{needed} tokens exceed the {loaded.target_config.max_positions} positions the model was "
                            f"loaded for; load(..., max_len={needed}) applies RoPE scaling, or shorten the prompt")
    else:
        tokenizer = load_tokenizer(target)
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        needed = len(ids) + config.max_new_tokens
        loaded = load(target, draft, dtype, device, max_len=needed, rope_scaling=rope_scaling, tokenizer=tokenizer)
    mode, note = mode_for_prompt(mode, config.budget, config.chunk_size, len(ids))
    if note:
        log.warning(note)
    gen = Generator(loaded.models, config, mode, max_len=needed)
    gen.prefill(ids)
    tokens = gen.generate(on_tokens=on_tokens)
    text = loaded.tokenizer.decode(tokens) if loaded.tokenizer is not None else None
    return Result(tokens, text, gen.stats)


def generate_ids(models: Models, prompt: list[int], mode: str, config: GenerationConfig,
                 max_len: int | None = None) -> Result:
    """Token ids in, token ids out, for in-memory models (tests, benchmarks)."""
    gen = Generator(models, config, mode, max_len=max_len or len(prompt) + config.max_new_tokens)
    gen.prefill(prompt)
    return Result(gen.generate(), None, gen.stats)


__all__ = ["load", "generate", "generate_ids", "Result", "Loaded", "GenerationConfig", "ModelConfig", "replace"]
