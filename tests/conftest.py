"""Tiny random Llama-family checkpoints built in memory (no model hub), saved in HF format."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# the programs tests start (python -m triforce ...) import this checkout, installed or not
_ROOT = str(Path(__file__).resolve().parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join([_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])
torch.set_num_threads(1)  # tiny models: thread wake-ups cost more than they save
# what a run keeps for later runs (tokenizer backends transformers built) goes to this session's own
# folder, which the programs tests start inherit: no test finds what an earlier run of the suite kept
_CACHE = tempfile.mkdtemp(prefix="triforce-tests-cache-")
os.environ["TRIFORCE_CACHE"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, True)


def hf_config(model_type="llama", vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, inter=48,
              max_pos=4096, rope_scaling=None, tie=False, attention_bias=False, theta=10000.0):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
                  tie_word_embeddings=tie, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, pad_token_id=None)
    params = {"rope_type": "default", "rope_theta": theta}
    if rope_scaling:
        params.update(rope_scaling)
    if model_type == "qwen2":
        return Qwen2Config(**common, rope_parameters=params, use_sliding_window=False)
    return LlamaConfig(**common, rope_parameters=params, attention_bias=attention_bias)


def save_tiny(folder, seed=0, dtype=torch.float32, **kw):
    """A random HF model saved to `folder`; returns the transformers model (eval, float64 for reference)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = hf_config(**kw)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # visible, non-trivial values everywhere, biases included
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 if "bias" in name else 0.08))
    model.to(dtype).save_pretrained(folder, safe_serialization=True)
    return model.eval()


def save_tokenizer(folder, vocab=64):
    """A word-level tokenizer over `vocab` ids (tokens 't0'.. 't{vocab-1}'), saved next to a model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", eos_token="t1", unk_token="t2")
    fast.save_pretrained(folder)


TEMPLATE = (  # ChatML, as SmolLM2 and Qwen write it
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_byte_level(folder: Path) -> None:
    """A small byte-level BPE (SmolLM2's and Qwen's kind) with special tokens and a chat template, saved
    the way `triforce prepare` saves a converted GGUF's tokenizer."""
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers
    from transformers import TokenizersBackend

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([(Path(_ROOT) / "triforce" / "data" / "persuasion.txt").read_text()[:20_000]], trainer)
    tok = TokenizersBackend(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                            unk_token="<|endoftext|>", pad_token="<|im_end|>")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)


def tiny_with_tokenizer(tmp_path_factory, name: str, seed: int) -> Path:
    """A fresh folder holding a tiny Llama (2 layers, GQA 4/2 heads, 64 ids) and its word-level tokenizer."""
    folder = tmp_path_factory.mktemp(name)
    save_tiny(folder, seed=seed, vocab=64, layers=2, hidden=32, heads=4, kv_heads=2, inter=48)
    save_tokenizer(folder, vocab=64)
    return folder


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """A saved tiny Llama (GQA 4/2 heads) with tokenizer, shared by tests that only read it."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny(folder, seed=1, vocab=64)
    save_tokenizer(folder, vocab=64)
    return folder
