"""bench/decode_fidelity.py on a tiny GGUF built here: decode steps and the same tokens as one pass,
through the bf16 kernels and through torch's bmm attention."""
import pytest
import torch

from bench import decode_fidelity
from triforce.model import decode_attention, stored_bf16
from tests.model.test_decode_attention_bf16 import GQA_CFG
from tests.model.test_stored import write_tiny_gguf


@pytest.mark.skipif(not (decode_attention.available() and stored_bf16.available()), reason="no avx512_bf16 kernels")
def test_steps_and_one_pass_give_the_same_bf16_logits_and_bmm_serves_when_asked(tmp_path, monkeypatch):
    path = tmp_path / "gqa.gguf"
    write_tiny_gguf(path, seed=4, cfg=GQA_CFG)
    ids = torch.randint(0, 64, (207,), generator=torch.Generator().manual_seed(0))
    alone, together = decode_fidelity.decode(str(path), torch.bfloat16, ids, 200)
    assert alone.shape == together.shape == (7, 64) and torch.equal(alone, together)
    calls = []
    kernel = decode_attention.cache_attend  # what an eager pass calls
    monkeypatch.setattr(decode_attention, "cache_attend", lambda *a: calls.append(1) or kernel(*a))
    with decode_fidelity.bf16_kernels(False):
        decode_fidelity.decode(str(path), torch.bfloat16, ids, 200)
    assert not calls and decode_attention.serves is not None
    decode_fidelity.decode(str(path), torch.bfloat16, ids, 200)
    assert calls  # served again once the block ends
