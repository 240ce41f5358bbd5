"""Loading a target and its drafter for a run: the target sharded under tensor parallelism, its RoPE
scaled for the run's length (model.rope.scaled_for, said in one line), the drafter checked to share
the target's tokenizer."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from triforce.model.config import ModelConfig
from triforce.model.errors import UserError
from triforce.model.loader import load_model, load_tokenizer, same_tokenizer, same_tokenizer_files
from triforce.model.rope import Rotary, scaled_for
from triforce.speculative.lookup import LookupDrafter
from triforce.speculative.models import Models

LOOKUP = "lookup"  # Settings.draft for drafts looked up in the sequence (speculative/lookup.py)

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
         tokenizer=None, weights: str = "auto") -> Loaded:
    """Load the target (sharded when world_size > 1) and the drafter (replicated; None/'self' = target;
    'lookup': no model, drafts looked up in the sequence).
    `tokenizer`: the target's, when the caller has already loaded it.

    Without `target_config`, the target's RoPE is scaled for `max_len` tokens by `rope_scaling`
    (model.rope.scaled_for: the command line's rule), said in one line when it is."""
    dtype = resolve_dtype(dtype)
    cfg = target_config
    if cfg is None:
        cfg, note = scaled_for(ModelConfig.from_folder(target), max_len or 0, rope_scaling)
        if note:
            log.warning(note)
    model = load_model(target, dtype, device, cfg, max_len, rank, world_size, progress, weights=weights)
    tokenizer = tokenizer or load_tokenizer(target)
    drafter, self_rotary = None, None
    if draft == LOOKUP:
        drafter = LookupDrafter()
    elif draft in (None, "self"):
        native = ModelConfig.from_folder(target)
        if native.rope_scaling != cfg.rope_scaling:  # a scaling added for this run's long context
            self_rotary = Rotary(native)
    else:
        draft_cfg = ModelConfig.from_folder(draft)
        if not (same_tokenizer_files(target, draft) or same_tokenizer(tokenizer, load_tokenizer(draft))):
            raise UserError(f"the drafter {draft} uses a different tokenizer from the target {target}; "
                            f"pick a drafter of the same model family or Settings.draft 'self'")
        drafter = load_model(draft, dtype, device, draft_cfg, weights=weights)
    return Loaded(Models(model, drafter, self_rotary), tokenizer, cfg)
