"""The model's shape, read from an HF config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from .errors import UserError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, bytes_per_value: int) -> int:
    """K and V of one token, all layers: the one formula the caches, the memory checks, the traffic
    model and the cost model use."""
    return 2 * layers * kv_heads * head_dim * bytes_per_value


def parameter_count(layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                    vocab: int, tied_embeddings: bool) -> int:
    """Weights of a Llama-family decoder: q/k/v/o and the three MLP matrices per layer, the embedding
    (and an untied output head); norms and biases are too small to count."""
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    mlp = 3 * hidden * intermediate
    return layers * (attention + mlp) + vocab * hidden * (1 if tied_embeddings else 2)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder. Qwen2 is Llama with biases on q/k/v."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "linear"|"dynamic"|"yarn"|"llama3", "factor": ...}
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    model_type: str = "llama"

    def __post_init__(self):
        if self.model_type not in SUPPORTED_ARCHITECTURES:
            raise UserError(f"unsupported architecture '{self.model_type}': this runtime serves "
                            f"{', '.join(SUPPORTED_ARCHITECTURES)} models; pick a Llama-family checkpoint")
        if self.num_heads % self.num_kv_heads:
            raise UserError(f"config has {self.num_heads} attention heads, not a multiple of "
                            f"{self.num_kv_heads} KV heads; the checkpoint's config.json is inconsistent")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token at 2 bytes per value (bf16), all layers."""
        return self.kv_bytes(2)

    def kv_bytes(self, bytes_per_value: int, tokens: int = 1) -> int:
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, bytes_per_value) * tokens

    @property
    def parameters(self) -> int:
        return parameter_count(self.num_layers, self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim,
                               self.intermediate_size, self.vocab_size, self.tie_word_embeddings)

    @property
    def trained_positions(self) -> int:
        """Positions the checkpoint was trained on, before any RoPE scaling is applied."""
        scaling = self.rope_scaling or {}
        return int(scaling.get("original_max_position_embeddings") or self.max_position_embeddings)

    @property
    def max_positions(self) -> int:
        """Positions the model supports with its RoPE scaling."""
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type", "default") in ("default", None):
            return self.max_position_embeddings
        factor = float(scaling.get("factor", 1.0))
        return max(self.max_position_embeddings, int(self.trained_positions * factor))

    def with_rope_scaling(self, scaling: dict | None) -> "ModelConfig":
        return replace(self, rope_scaling=scaling)

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        model_type = hf.get("model_type", "")
        try:
            heads = hf["num_attention_heads"]
            hidden = hf["hidden_size"]
            attention_bias = bool(hf.get("attention_bias", False))
            scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
            theta = hf.get("rope_theta") or (scaling or {}).get("rope_theta") or 10000.0
            if scaling is not None:
                scaling = dict(scaling)
                scaling.setdefault("rope_type", scaling.get("type", "default"))
                if scaling["rope_type"] == "default":
                    scaling = None
            return cls(
                vocab_size=hf["vocab_size"],
                hidden_size=hidden,
                intermediate_size=hf["intermediate_size"],
                num_layers=hf["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=hf.get("num_key_value_heads") or heads,
                head_dim=hf.get("head_dim") or hidden // heads,
                max_position_embeddings=hf.get("max_position_embeddings", 2048),
                rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
                rope_theta=float(theta),
                rope_scaling=scaling,
                # Qwen2 always has q/k/v biases and never an o_proj bias.
                qkv_bias=attention_bias or model_type == "qwen2",
                o_bias=attention_bias and model_type != "qwen2",
                mlp_bias=bool(hf.get("mlp_bias", False)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                model_type=model_type,
            )
        except KeyError as missing:
            raise UserError(f"config.json lacks {missing}; the checkpoint folder is incomplete or not a "
                            f"Llama-family model") from None

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        path = Path(folder) / "config.json"
        if not Path(folder).is_dir():
            raise UserError(f"model folder {folder} does not exist; run triforce-prepare "
                            f"or pass Settings.model DIR with an HF-format checkpoint")
        if not path.is_file():
            raise UserError(f"{folder} has no config.json; pass an HF-format checkpoint folder")
        try:
            hf = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{path} is not valid JSON ({e}); re-download or re-convert the model") from None
        if not isinstance(hf, dict):
            raise UserError(f"{path} is not a JSON object; re-download or re-convert the model")
        return cls.from_hf(hf)
