"""What a decode reads, by a model of bytes per pass (bench.py's "MiB read per token"): every level
reads its weights plus the KV its cache holds, so a level's bytes follow from the model shapes, the
context and the settings, whatever the machine."""
from __future__ import annotations

from triforce.model.config import ModelConfig


def kv_bytes_per_token(cfg: ModelConfig, elem: int) -> int:
    return cfg.kv_bytes(elem)


def weight_bytes(cfg: ModelConfig, elem: int) -> int:
    from bench.costmodel import ModelShape

    return ModelShape.from_config(cfg, bytes_per_value=elem).weight_bytes_read


class Traffic:
    """Bytes a pass reads at each level: the weights plus the KV that level's cache holds. The
    proposing levels read `lower_elem` bytes per weight (1 with --lower-weights int8)."""

    def __init__(self, target: ModelConfig, drafter: ModelConfig | None, elem: int, context: int, new_tokens: int,
                 cfg, lower_elem: int | None = None):
        """`drafter` None: the drafts are looked up in the sequence (no weights, no cache read)."""
        mean_len = context + new_tokens // 2
        lower_elem = lower_elem or elem
        self.full = weight_bytes(target, elem) + kv_bytes_per_token(target, elem) * mean_len
        self.middle = weight_bytes(target, lower_elem) + kv_bytes_per_token(target, elem) * min(cfg.budget, context)
        window = min(cfg.sink_tokens + cfg.draft_window, context)
        self.draft = self.assistant_full = 0
        if drafter is not None:
            self.draft = weight_bytes(drafter, lower_elem) + kv_bytes_per_token(drafter, elem) * window
            self.assistant_full = weight_bytes(drafter, elem) + kv_bytes_per_token(drafter, elem) * mean_len

    def ours(self, passes: dict) -> int:
        return passes.get("verify", 0) * self.full + passes.get("middle", 0) * self.middle + passes.get("draft", 0) * self.draft


def bytes_read(mode: str, stats: dict, traffic: Traffic) -> float:
    if mode == "hf-assisted":
        return stats["full_passes"] * traffic.full + stats["passes"]["draft"] * traffic.assistant_full
    if mode.startswith("hf-"):  # transformers' peers: one full pass per token
        return stats["full_passes"] * traffic.full
    return traffic.ours(stats["passes"])
