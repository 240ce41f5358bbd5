"""Dequantize a GGUF checkpoint into a plain bf16 HF folder, and check the result before trusting it.

Used by triforce/cli/prepare_models.py, which fetches the GGUFs and decides what to convert; this file
only knows transformers' GGUF reader. Every check names what went wrong in one line (PrepareError).
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from rich.progress import Progress

if TYPE_CHECKING:
    from triforce.cli.prepare_models import ModelSpec

CONVERT_STEPS = 5
# a line that exercises the tokenizer's code, whitespace and punctuation handling on the round trip
ROUND_TRIP_TEXT = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # Paris, France"


class PrepareError(Exception):
    """An expected failure; its message is one line that names the problem and the fix."""


@contextmanager
def _gguf_tensor_progress(progress: Progress, task):
    """Route transformers' per-tensor tqdm bar (printed straight to stderr) into our rich bar."""
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # layout changed: just do without the inner bar
        yield
        return
    original = getattr(gguf_utils, "tqdm", None)

    def tracked(items, **_):
        items = list(items)
        progress.update(task, total=len(items), completed=0)
        for item in items:
            yield item
            progress.advance(task)

    gguf_utils.tqdm = tracked
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def convert(gguf: Path, out: Path, spec: ModelSpec, progress: Progress) -> None:
    """Dequantize gguf into a bf16 HF folder at out (an existing, empty directory)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every input is local; never wait on a hub
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    steps = progress.add_task(f"{spec.folder}: converting", total=CONVERT_STEPS)

    def step(what: str, work, *args):
        progress.update(steps, description=f"{spec.folder}: {what}")
        result = work(*args)
        progress.advance(steps)
        return result

    tok = step("reading tokenizer", _read_tokenizer, gguf)
    model = step("dequantizing weights", _dequantize, gguf, spec, progress)
    step("writing model.safetensors", _write_weights, model, gguf, out, spec)
    step("writing config + tokenizer", _write_config, model, tok, out, spec)
    step("checking the reload", _check_reload, model, tok, out, spec)
    progress.update(steps, description=f"{spec.folder}: done")


def _read_tokenizer(gguf: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def _dequantize(gguf: Path, spec: ModelSpec, progress: Progress):
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {}
    try:  # v5 may keep weights in GGUF blocks when kernels exist; we want plain dense tensors
        from transformers import GgufConfig
        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    tensors = progress.add_task(f"{spec.folder}: tensors", total=None)
    with _gguf_tensor_progress(progress, tensors):
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     dtype=torch.float32, **kwargs)
    progress.remove_task(tensors)
    return model.eval()


def _write_weights(model, gguf: Path, out: Path, spec: ModelSpec) -> None:
    """save_pretrained refuses a GGUF-loaded model, and a fresh model would cost a random init, so
    the state dict is written directly; its keys are those from_pretrained expects for this class."""
    import torch
    from safetensors.torch import save_file

    cfg = model.config
    if cfg.model_type != spec.model_type or cfg.max_position_embeddings != spec.max_positions \
            or bool(cfg.tie_word_embeddings) != spec.tied:
        raise PrepareError(f"{gguf.name} converted to an unexpected config ({cfg.model_type}, "
                           f"{cfg.max_position_embeddings} positions, "
                           f"tied={cfg.tie_word_embeddings}); "
                           "transformers changed its GGUF mapping: pin the version that worked")
    state = {}
    for key, value in model.state_dict().items():
        if cfg.tie_word_embeddings and key == "lm_head.weight":
            continue  # tied: the reload re-ties it to embed_tokens
        if not value.is_floating_point():
            raise PrepareError(f"{key} is still quantized ({value.dtype}) after loading "
                               f"{gguf.name}; upgrade transformers or uninstall `kernels`")
        state[key] = value.detach().to(torch.bfloat16).contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


def _write_config(model, tok, out: Path, spec: ModelSpec) -> None:
    import torch

    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config  # the weights on disk are no longer GGUF
    cfg.dtype = torch.bfloat16
    cfg.architectures = [type(model).__name__]
    cfg.save_pretrained(out)
    # transformers 5 writes `dtype` and nests rope_theta in rope_parameters; add the v4 spellings so
    # older transformers and code reading config.json by hand see the same values (v5 accepts them).
    path = out / "config.json"
    raw = json.loads(path.read_text())
    raw["torch_dtype"] = "bfloat16"
    rope = raw.get("rope_parameters") or {}
    if "rope_theta" in rope and "rope_theta" not in raw:
        raw["rope_theta"] = rope["rope_theta"]
    path.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    gen = model.generation_config
    if spec.eos_ids:
        gen.eos_token_id = list(spec.eos_ids)
    for name, value in spec.sampling:
        setattr(gen, name, value)
    gen.save_pretrained(out)
    # tokenizer.json, tokenizer_config.json (special tokens) and chat_template.jinja
    tok.save_pretrained(out)


def _check_reload(model, tok, out: Path, spec: ModelSpec) -> None:
    """The folder reloads with every key, keeps Qwen's biases, round-trips the tokenizer, and its bf16
    weights predict what the dequantized float32 model predicts (catches mapping slips)."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reloaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    if any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")):
        raise PrepareError(f"converted {spec.folder} reloads with bad keys {info}; report this")
    if spec.model_type == "qwen2":  # Qwen2 always carries q/k/v biases; a lost one breaks outputs
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            if "model.layers.0.self_attn.q_proj.bias" not in set(f.keys()):
                raise PrepareError(f"converted {spec.folder} lost its q/k/v biases; report this")
    ids = tok(ROUND_TRIP_TEXT).input_ids
    tok2 = AutoTokenizer.from_pretrained(out)
    if tok2(ROUND_TRIP_TEXT).input_ids != ids or tok2.chat_template != tok.chat_template:
        raise PrepareError(f"converted {spec.folder} tokenizer does not round-trip; report this")
    with torch.no_grad():
        x = torch.tensor([ids])
        ref = model(x).logits.float()
        got = reloaded(x).logits.float()
    cos = torch.nn.functional.cosine_similarity(ref.flatten(), got.flatten(), dim=0).item()
    if cos < 0.99:
        raise PrepareError(f"converted {spec.folder} logits drift from the GGUF "
                           f"(cosine {cos:.4f}); report this")
