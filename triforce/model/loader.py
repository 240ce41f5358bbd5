"""Load HF-format checkpoint folders (config.json + *.safetensors) into the project's model.

Tensors are read one at a time with `safetensors.safe_open`; with tensor parallelism each rank
reads only its own rows/columns (`get_slice`), never the whole model.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .config import ModelConfig
from .errors import UserError
from .gguf_loader import gguf_origin, load_gguf_model, resolve_weights
from .rope import Rotary
from .tensor_parallel import check_shardable, shard
from .transformer import Transformer


class CheckpointReader:
    """Name -> tensor over all safetensors files of a folder, with sliced reads."""

    def __init__(self, folder: Path):
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise UserError(f"{folder} has no *.safetensors files; convert the checkpoint to safetensors "
                            f"(triforce-prepare does this)")
        self.handles, self.where = [], {}
        for path in files:
            try:
                handle = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError, ValueError) as e:
                raise UserError(f"{path} is corrupt or truncated ({e}); re-download or re-convert the model") from None
            self.handles.append((path, handle))
            for name in handle.keys():
                self.where[name] = len(self.handles) - 1

    def has(self, name: str) -> bool:
        return name in self.where

    def read(self, name: str, dim: int | None = None, part: int = 0, parts: int = 1) -> torch.Tensor:
        """The tensor, or its `part`-th of `parts` equal pieces along `dim`."""
        if name not in self.where:
            raise UserError(f"checkpoint lacks tensor '{name}'; the model folder is incomplete or of another architecture")
        path, handle = self.handles[self.where[name]]
        try:
            if dim is None or parts == 1:
                return handle.get_tensor(name)
            view = handle.get_slice(name)
            size = view.get_shape()[dim] // parts
            index = [slice(None)] * len(view.get_shape())
            index[dim] = slice(part * size, (part + 1) * size)
            return view[tuple(index)]
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise UserError(f"{path} is corrupt or truncated at '{name}' ({e}); re-download or re-convert the model") from None


def _layer_tensors(reader: CheckpointReader, cfg: ModelConfig, i: int, rank: int, world: int) -> dict:
    """Our parameter names for layer i -> tensors, fused and sharded (model/tensor_parallel.py).

    The row-parallel layers' biases are added once, on rank 0, because the all-reduce sums every
    rank's output; a column-parallel bias is split like its weight's rows.
    """
    hf = f"model.layers.{i}."
    qkv, o = shard("attention.wqkv", rank, world), shard("attention.wo", rank, world)
    gate_up, down = shard("mlp.w13", rank, world), shard("mlp.w2", rank, world)
    out = {
        "attention_norm.weight": reader.read(hf + "input_layernorm.weight"),
        "mlp_norm.weight": reader.read(hf + "post_attention_layernorm.weight"),
        "attention.wqkv.weight": torch.cat([reader.read(hf + f"self_attn.{p}_proj.weight", **qkv) for p in "qkv"]),
        "attention.wo.weight": reader.read(hf + "self_attn.o_proj.weight", **o),
        "mlp.w13.weight": torch.cat([reader.read(hf + f"mlp.{p}_proj.weight", **gate_up) for p in ("gate", "up")]),
        "mlp.w2.weight": reader.read(hf + "mlp.down_proj.weight", **down),
    }
    if cfg.qkv_bias:
        out["attention.wqkv.bias"] = torch.cat([reader.read(hf + f"self_attn.{p}_proj.bias", **qkv) for p in "qkv"])
    if cfg.o_bias:
        bias = reader.read(hf + "self_attn.o_proj.bias")
        out["attention.wo.bias"] = bias if rank == 0 else torch.zeros_like(bias)
    if cfg.mlp_bias:
        out["mlp.w13.bias"] = torch.cat([reader.read(hf + f"mlp.{p}_proj.bias", **gate_up) for p in ("gate", "up")])
        bias = reader.read(hf + "mlp.down_proj.bias")
        out["mlp.w2.bias"] = bias if rank == 0 else torch.zeros_like(bias)
    return {f"layers.{i}.{k}": v for k, v in out.items()}


def load_model(folder: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               cfg: ModelConfig | None = None, max_len: int | None = None, rank: int = 0,
               world_size: int = 1, progress=None, weights: str = "auto") -> Transformer:
    """Build the model from an HF folder or a GGUF file. `cfg` overrides config.json (e.g. a RoPE
    scaling). `weights`: "stored" computes with the GGUF's quantized blocks (a GGUF file, or the one
    a prepared folder was made from; CPU only), "dequantized" with dense weights in `dtype`, "auto"
    the stored ones where they are known and measured faster (model/gguf_loader.py)."""
    folder = Path(folder)
    kind = resolve_weights(weights, folder, device, dtype, world_size)
    if folder.is_file() or kind == "stored":
        if torch.device(device).type != "cpu" or world_size != 1:
            raise UserError(f"loading a GGUF ({folder}) is for one CPU rank; convert it with triforce-prepare")
        source = folder if folder.is_file() else gguf_origin(folder)
        if cfg is None and folder.is_dir():
            cfg = ModelConfig.from_folder(folder)
        return load_gguf_model(source, dtype, kind == "stored", cfg, max_len, progress)
    cfg = cfg or ModelConfig.from_folder(folder)
    check_shardable(cfg, world_size)
    reader = CheckpointReader(folder)
    with torch.device("meta"):
        model = Transformer(cfg, world_size=world_size, max_len=max_len)
    state = {"embed.weight": reader.read("model.embed_tokens.weight"), "norm.weight": reader.read("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        name = "lm_head.weight" if reader.has("lm_head.weight") else "model.embed_tokens.weight"
        state["lm_head.weight"] = reader.read(name)
    for i in range(cfg.num_layers):
        state.update(_layer_tensors(reader, cfg, i, rank, world_size))
        if progress is not None:
            progress(i + 1, cfg.num_layers)
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise UserError(f"checkpoint tensors do not match config.json ({str(e).splitlines()[-1].strip()}); "
                        f"the folder mixes files of different models") from None
    model.rotary = Rotary(cfg, max_len)  # the one built under the meta device holds no values
    model.rotary.inv_freq = model.rotary.inv_freq.to(device)
    return model.eval().requires_grad_(False)


def load_tokenizer(folder: str | Path):
    """The checkpoint's tokenizer, offline: where transformers' TokenizersBackend would serve tokenizer.json
    as it stands, or where an earlier start kept the backend transformers built for these files,
    `tokenizer.Tokenizer`, which encodes and decodes without importing transformers."""
    import os

    from .tokenizer import load_served, remember

    light = load_served(folder)
    if light is not None:
        return light
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        if _declares_tokenizers_backend(folder):
            # what AutoTokenizer returns for such a folder (the ones `triforce prepare` writes), without
            # the model's AutoConfig it loads first: 1.0 -> 0.1 s of every start
            from transformers import TokenizersBackend

            full = TokenizersBackend.from_pretrained(str(folder))
        else:
            from transformers import AutoTokenizer

            full = AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # transformers raises many types for a broken folder
        raise UserError(f"cannot load the tokenizer from {folder} ({type(e).__name__}); the folder needs "
                        f"tokenizer.json/tokenizer_config.json") from None
    remember(folder, full)
    return full


def _declares_tokenizers_backend(folder: str | Path) -> bool:
    """tokenizer_config.json names transformers' TokenizersBackend (tokenizer.json as it is) and no
    code of its own."""
    try:
        declared = json.loads((Path(folder) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(declared, dict) and declared.get("tokenizer_class") == "TokenizersBackend" and "auto_map" not in declared


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def same_tokenizer_files(a: str | Path, b: str | Path) -> bool:
    """True when two folders hold byte-identical tokenizer files (a drafter converted beside its target):
    the same tokenizer, known without loading the second one (seconds for Qwen's 151K vocabulary)."""
    files = [(Path(a) / name, Path(b) / name) for name in TOKENIZER_FILES]
    return all(x.is_file() and y.is_file() and x.read_bytes() == y.read_bytes() for x, y in files)


def same_tokenizer(a, b) -> bool:
    """True when two tokenizers map text to the same ids (vocabulary and special tokens)."""
    if a is b:
        return True
    return a.get_vocab() == b.get_vocab() and a.all_special_ids == b.all_special_ids


def read_hf_config(folder: str | Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())
